"""The timeline as a PNG (matplotlib, the ``plots`` extra): stacked by role, phases shaded, regions
marked, the peak annotated — for a README or a pull request."""

from __future__ import annotations

import io
from typing import Any

from memtrim.analysis import Analysis
from memtrim.report.escape import safe
from memtrim.report.files import write_bytes_atomically
from memtrim.report.series import Timeline, timeline
from memtrim.report.svg import PEAK_COLOR, PHASE_FILLS, layer_colors
from memtrim.units import format_bytes


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message says which extra brings it."""


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise MissingExtra(
            "the PNG needs matplotlib: pip install 'memtrim[plots]' (or pip install matplotlib)"
        ) from exc
    return plt


def require_matplotlib() -> None:
    """Raise :class:`MissingExtra` now if the PNG could not be drawn later."""
    _pyplot()


def _unit(top: float) -> tuple[float, str]:
    for power, name in ((4, "TiB"), (3, "GiB"), (2, "MiB"), (1, "KiB")):
        if top >= 1024**power:
            return 1024.0**power, name
    return 1.0, "B"


def png_bytes(
    analysis: Analysis, *, mode: str = "role", title: str | None = None, tl: Timeline | None = None
) -> bytes:
    """The PNG of ``analysis``'s timeline, stacked by ``mode`` (``"role"`` or ``"line"``)."""
    plt = _pyplot()
    tl = tl or timeline(analysis, buckets=800)
    layers = tl.by_role if mode == "role" else tl.by_line
    colors = layer_colors(layers, mode)
    scale, unit = _unit(max(tl.top, 1))
    fig, ax = plt.subplots(figsize=(11, 4.2), dpi=100)
    try:
        for span in tl.phases:
            ax.axvspan(span.start, span.end, color=PHASE_FILLS.get(span.name, "#f4f4f4"), zorder=0, lw=0)
        xs = [*tl.x, float(tl.ops)]
        if layers:
            ys = [[v / scale for v in (*layer.values, layer.values[-1])] for layer in layers]
            labels = [safe(layer.name) for layer in layers]
            ax.stackplot(xs, ys, labels=labels, colors=colors, step="post", alpha=0.9, zorder=2)
        if any(tl.freed_before):
            ax.fill_between(
                xs,
                [-v / scale for v in (*tl.freed_before, tl.freed_before[-1])],
                0,
                step="post",
                color="#d0d0d0",
                label="from before the region, freed",
                zorder=2,
            )
        ax.step(
            xs, [v / scale for v in (*tl.total, tl.total[-1])], where="post", color="#222", lw=0.9, zorder=3
        )
        if tl.peak_x is not None:
            ax.axvline(tl.peak_x, color=PEAK_COLOR, ls="--", lw=1, zorder=4)
            ax.annotate(
                f"peak {format_bytes(tl.peak_bytes)}",
                (tl.peak_x, tl.peak_bytes / scale),
                xytext=(8 if tl.peak_x < 0.7 * max(tl.ops, 1) else -8, 6),
                textcoords="offset points",
                ha="left" if tl.peak_x < 0.7 * max(tl.ops, 1) else "right",
                color=PEAK_COLOR,
                fontweight="bold",
                zorder=5,
            )
        room = 1.12 + 0.06 * min(len(tl.regions), 3)  # region bars sit above the highest point
        top = max(tl.top, 1) / scale * room
        for i, span in enumerate(tl.regions):
            y = max(tl.top, 1) / scale * (1.1 + 0.06 * (i % 3))
            ax.plot([span.start, span.end], [y, y], color="#444", lw=3, solid_capstyle="butt", zorder=4)
            ax.text(span.start, y, f" {safe(span.name)}", va="bottom", fontsize=8, color="#333", zorder=5)
        for span in tl.phases:
            if span.end - span.start > 0.08 * max(tl.ops, 1):
                ax.text(
                    (span.start + span.end) / 2,
                    0.01,
                    span.name,
                    transform=ax.get_xaxis_transform(),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                    color="#777",
                )
        ax.set_xlim(0, max(tl.ops, 1))
        ax.set_ylim(min(0.0, -max(tl.freed_before, default=0) / scale * 1.1), top)
        ax.set_xlabel(f"op number ({safe(tl.device)})")
        ax.set_ylabel(f"live above the region's start ({unit})")
        ax.set_title(
            safe(title) if title else f"memtrim: peak {format_bytes(tl.peak_bytes)} on {safe(tl.device)}",
            fontsize=11,
            loc="left",
        )
        ax.legend(
            loc="upper left",
            bbox_to_anchor=(1.005, 1.0),
            fontsize=8,
            frameon=False,
            title=mode,
            title_fontsize=8,
        )
        ax.grid(axis="y", color="#e3e3e3", lw=0.6)
        fig.tight_layout()
        out = io.BytesIO()
        fig.savefig(out, format="png")
        return out.getvalue()
    finally:
        plt.close(fig)


def save_png(analysis: Analysis, path: str, *, mode: str = "role", title: str | None = None) -> None:
    """Write :func:`png_bytes` to ``path`` atomically."""
    write_bytes_atomically(path, png_bytes(analysis, mode=mode, title=title))
