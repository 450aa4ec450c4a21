"""Human-readable byte counts."""

from __future__ import annotations


def format_bytes(n: int) -> str:
    """1,207,959,552 -> '1.12 GiB'; binary units, three significant figures."""
    value = float(n)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            if unit == "B":
                return f"{sign}{int(value)} B"
            return f"{sign}{value:.3g} {unit}" if value < 100 else f"{sign}{value:.0f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def short_path(path: str | None, keep: int = 2) -> str:
    if not path:
        return "?"
    parts = path.replace("\\", "/").split("/")
    return "/".join(parts[-keep:])
