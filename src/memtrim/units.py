"""Byte counts and before/after changes as text: the one home for both.

A leaf module (imports nothing of memtrim): analysis, report, verify and bench all print bytes.
"""

from __future__ import annotations

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def format_bytes(n: int | float) -> str:
    """1,207,959,552 -> '1.12 GiB'; binary units, three significant figures, sign kept."""
    value = float(n)
    if value != value:  # NaN: say so rather than print a number
        return "? B"
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in _UNITS:
        if value < 1024 or unit == _UNITS[-1]:
            if unit == "B":
                return f"{sign}{int(value)} B"
            return f"{sign}{value:.3g} {unit}" if value < 100 else f"{sign}{value:.0f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_delta(before: int, after: int) -> str:
    """The change from ``before`` to ``after`` bytes with its sign: '-563 MiB', '+4 MiB', '±0 B'."""
    delta = after - before
    if delta == 0:
        return "±0 B"
    return ("+" if delta > 0 else "-") + format_bytes(abs(delta))


def format_ratio(
    before: int | float, after: int | float, *, smaller: str = "smaller", larger: str = "larger"
) -> str:
    """How many times smaller (or larger) ``after`` is: '64.0x smaller', '1.5x larger', 'same'.

    Growth reads as growth: ``format_ratio(2, 4)`` is '2.0x larger', never '0.5x smaller'. A side that
    is zero gives 'none before' / 'none after'.
    """
    if before == after:
        return "same"
    if after == 0:
        return "none after"
    if before == 0:
        return "none before"
    if after < before:
        return f"{before / after:.1f}x {smaller}"
    return f"{after / before:.1f}x {larger}"


def format_change(before: int, after: int) -> str:
    """'581 MiB -> 18 MiB (-563 MiB)': both sides and the signed change."""
    return f"{format_bytes(before)} -> {format_bytes(after)} ({format_delta(before, after)})"
