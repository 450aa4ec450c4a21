"""The timeline as inline SVG: drawn in Python, so it shows in a notebook (where scripts may not run),
in a saved HTML file with scripts off, and in the full report (whose small script only adds clicks).

Every string drawn comes from :func:`text`, which escapes it for HTML/SVG.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass

from memtrim.report.escape import safe
from memtrim.report.series import Layer, Timeline
from memtrim.units import format_bytes

ROLE_COLORS = {
    "parameter": "#4e79a7",
    "gradient": "#f28e2c",
    "optimizer_state": "#af7aa1",
    "activation": "#59a14f",
    "buffer": "#76b7b2",
    "temporary": "#e15759",
    "input": "#9c755f",
    "output": "#edc949",
    "other": "#bab0ab",
}
LINE_COLORS = ("#4e79a7", "#e15759", "#59a14f", "#f28e2c", "#af7aa1", "#76b7b2", "#edc949", "#ff9da7")
OTHER_COLOR = "#c9c9c9"
PHASE_FILLS = {"forward": "#eaf1fb", "backward": "#fdf0e4", "optimizer": "#f1ebf7", "other": "#f4f4f4"}
FREED_COLOR = "#d0d0d0"
PEAK_COLOR = "#c0392b"


def text(value: object) -> str:
    """``value`` as text that is safe inside HTML or SVG (terminal control characters escaped too)."""
    return html.escape(safe(str(value)), quote=True)


def layer_colors(layers: Sequence[Layer], mode: str) -> list[str]:
    if mode == "role":
        return [ROLE_COLORS.get(layer.name, OTHER_COLOR) for layer in layers]
    colors = []
    for i, layer in enumerate(layers):
        last = i == len(layers) - 1
        colors.append(
            OTHER_COLOR if last and layer.name == "other lines" else LINE_COLORS[i % len(LINE_COLORS)]
        )
    return colors


def _nice_step(span: float, ticks: int = 5) -> float:
    raw = span / max(ticks, 1)
    if raw <= 0:
        return 1.0
    magnitude = 10 ** math.floor(math.log10(raw))
    for factor in (1, 2, 2.5, 5, 10):
        if raw <= factor * magnitude:
            return factor * magnitude
    return 10 * magnitude


def _byte_step(span: float) -> float:
    """A tick step in bytes that reads well in binary units (1, 2, 5, 10... of KiB/MiB/GiB)."""
    unit = 1.0
    while span / unit >= 1024 * 4 and unit < 2.0**60:
        unit *= 1024
    return _nice_step(span / unit) * unit


@dataclass(frozen=True)
class Plot:
    """Where data lands in the picture."""

    width: int
    height: int
    left: int
    right: int
    top: int
    bottom: int
    x_max: float
    y_min: float
    y_max: float

    def px(self, x: float) -> float:
        return self.left + (self.width - self.left - self.right) * (x / self.x_max if self.x_max else 0.0)

    def py(self, y: float) -> float:
        inner = self.height - self.top - self.bottom
        return self.top + inner * (1 - (y - self.y_min) / (self.y_max - self.y_min))

    def x_of(self, px: float) -> float:
        return (px - self.left) / (self.width - self.left - self.right) * self.x_max


WIDTH = 960
"""The pictures' width in SVG units (the page scales it to fit)."""
LEFT, RIGHT = 78, 16
"""The margins left and right of the plotting area (the byte axis' labels, a gap)."""


def plot_columns(width: int = WIDTH) -> int:
    """The pixel columns of the plotting area of a picture ``width`` wide: the buckets a timeline is
    thinned to (:func:`memtrim.report.series.timeline`), so each column keeps its lowest and highest
    moment and no column's extremes are lost."""
    return width - LEFT - RIGHT


def plot_for(x_max: float, y_min: float, y_max: float, width: int, height: int, bands: int = 0) -> Plot:
    y_max = max(y_max, 1.0) * 1.06
    y_min = y_min * 1.06 if y_min < 0 else 0.0
    return Plot(width, height + 18 * bands, LEFT, RIGHT, 22, 38 + 18 * bands, max(x_max, 1.0), y_min, y_max)


def _steps(xs: Sequence[float], ys: Sequence[float], plot: Plot) -> list[str]:
    """A step curve: each value holds until the next point."""
    points: list[str] = []
    prev = 0.0
    for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
        py = plot.py(y)
        if i:
            points.append(f"{plot.px(x):.1f},{prev:.1f}")
        points.append(f"{plot.px(x):.1f},{py:.1f}")
        prev = py
    if xs:
        points.append(f"{plot.px(plot.x_max):.1f},{prev:.1f}")
    return points


def _axes(plot: Plot, x_label: str) -> list[str]:
    out = []
    x0, x1 = plot.left, plot.width - plot.right
    y0, y1 = plot.top, plot.height - plot.bottom
    step = _byte_step(plot.y_max - plot.y_min)
    value = math.ceil(plot.y_min / step) * step
    while value <= plot.y_max:
        y = plot.py(value)
        out.append(f'<line x1="{x0}" x2="{x1}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e3e3e3"/>')
        out.append(
            f'<text x="{x0 - 6}" y="{y + 4:.1f}" text-anchor="end" font-size="11" fill="#555">'
            f"{text(format_bytes(value))}</text>"
        )
        value += step
    xstep = max(1.0, _nice_step(plot.x_max, 8))
    value = 0.0
    while value <= plot.x_max:
        x = plot.px(value)
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y1}" y2="{y1 + 4}" stroke="#888"/>')
        out.append(
            f'<text x="{x:.1f}" y="{y1 + 16}" text-anchor="middle" font-size="11" fill="#555">'
            f"{value:.0f}</text>"
        )
        value += xstep
    out.append(f'<line x1="{x0}" x2="{x1}" y1="{plot.py(0):.1f}" y2="{plot.py(0):.1f}" stroke="#999"/>')
    out.append(f'<rect x="{x0}" y="{y0}" width="{x1 - x0}" height="{y1 - y0}" fill="none" stroke="#bbb"/>')
    out.append(
        f'<text x="{x1}" y="{y1 + 30}" text-anchor="end" font-size="11" fill="#555">{text(x_label)}</text>'
    )
    return out


def _phases(tl: Timeline, plot: Plot) -> list[str]:
    out = []
    y0, y1 = plot.top, plot.height - plot.bottom
    for span in tl.phases:
        x0, x1 = plot.px(span.start), plot.px(span.end)
        fill = PHASE_FILLS.get(span.name, "#f4f4f4")
        out.append(
            f'<rect class="phase" x="{x0:.1f}" y="{y0}" width="{max(x1 - x0, 0.5):.1f}" height="{y1 - y0}" '
            f'fill="{fill}"><title>{text(span.name)}</title></rect>'
        )
        if x1 - x0 > 60:
            out.append(
                f'<text x="{(x0 + x1) / 2:.1f}" y="{y0 + 13}" text-anchor="middle" font-size="11" '
                f'fill="#777">{text(span.name)}</text>'
            )
    return out


def _regions(tl: Timeline, plot: Plot) -> list[str]:
    out = []
    base = plot.height - plot.bottom + 38
    for i, span in enumerate(tl.regions):
        y = base + 18 * (i % max(1, _bands(tl)))
        x0, x1 = plot.px(span.start), plot.px(span.end)
        out.append(
            f'<rect class="region" x="{x0:.1f}" y="{y}" width="{max(x1 - x0, 1.5):.1f}" height="5" '
            'fill="#555">'
            f"<title>region {text(span.name)}</title></rect>"
        )
        out.append(f'<text x="{x0:.1f}" y="{y + 14}" font-size="10" fill="#333">{text(span.name)}</text>')
    return out


def _bands(tl: Timeline) -> int:
    return min(len(tl.regions), 3)


def _peak(x: float | None, value: int, plot: Plot, label: str, color: str = PEAK_COLOR) -> list[str]:
    if x is None:
        return []
    px, py = plot.px(x), plot.py(value)
    anchor = "end" if px > plot.width * 0.7 else "start"
    dx = -6 if anchor == "end" else 6
    return [
        f'<line class="peak" x1="{px:.1f}" x2="{px:.1f}" y1="{plot.top}" y2="{plot.height - plot.bottom}" '
        f'stroke="{color}" stroke-dasharray="4 3"/>',
        f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3.5" fill="{color}"/>',
        f'<text x="{px + dx:.1f}" y="{max(py - 6, plot.top + 24):.1f}" text-anchor="{anchor}" font-size="12" '
        f'font-weight="bold" fill="{color}">{text(label)}</text>',
    ]


def _stack(tl: Timeline, layers: Sequence[Layer], colors: Sequence[str], plot: Plot) -> list[str]:
    out = []
    n = len(tl.x)
    below = [0] * n
    for layer, color in zip(layers, colors, strict=True):
        above = [below[i] + layer.values[i] for i in range(n)]
        top = _steps(tl.x, above, plot)
        bottom = _steps(tl.x, below, plot)
        points = " ".join(top + bottom[::-1])
        out.append(
            f'<polygon class="layer" points="{points}" fill="{color}" fill-opacity="0.85">'
            f"<title>{text(layer.name)}</title></polygon>"
        )
        below = above
    if any(tl.freed_before):
        top = _steps(tl.x, [0] * n, plot)
        bottom = _steps(tl.x, [-v for v in tl.freed_before], plot)
        out.append(
            f'<polygon points="{" ".join(top + bottom[::-1])}" fill="{FREED_COLOR}">'
            "<title>tensors from before the region, freed inside it</title></polygon>"
        )
    return out


def timeline_svg(tl: Timeline, *, mode: str = "role", width: int = WIDTH, height: int = 320) -> str:
    """The stacked timeline by ``mode`` (``"role"`` or ``"line"``), phases shaded, regions below the
    axis, the peak marked, and the live curve above the region's start drawn on top."""
    layers = tl.by_role if mode == "role" else tl.by_line
    colors = layer_colors(layers, mode)
    low = -max(tl.freed_before, default=0)
    plot = plot_for(tl.ops, low, tl.top, width, height, _bands(tl))
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="memtrim-timeline" data-mode="{text(mode)}" '
        f'viewBox="0 0 {width} {plot.height}" width="100%" preserveAspectRatio="xMinYMin meet" '
        f'font-family="system-ui, sans-serif" data-left="{plot.left}" data-right="{plot.right}" '
        f'data-xmax="{plot.x_max}" data-top="{plot.top}" data-bottom="{plot.height - plot.bottom}">',
        *_phases(tl, plot),
        *_axes(plot, f"op number ({tl.device})"),
        *_stack(tl, layers, colors, plot),
        f'<polyline points="{" ".join(_steps(tl.x, tl.total, plot))}" fill="none" stroke="#222" '
        'stroke-width="1"><title>live bytes above the region\'s start</title></polyline>',
        *_regions(tl, plot),
        *_peak(tl.peak_x, tl.peak_bytes, plot, f"peak {format_bytes(tl.peak_bytes)}"),
        '<line class="cursor" x1="0" x2="0" y1="0" y2="0" stroke="#000" visibility="hidden"/>',
        "</svg>",
    ]
    return "\n".join(parts)


COMPARE_COLORS = ("#4e79a7", "#e15759")


def compare_svg(curves: Sequence[tuple[str, Timeline]], *, width: int = WIDTH, height: int = 300) -> str:
    """Two (or more) live curves on one axis, each with its peak marked."""
    x_max = max((tl.ops for _, tl in curves), default=1)
    top = max((max(tl.total, default=0) for _, tl in curves), default=0)
    low = min((min(tl.total, default=0) for _, tl in curves), default=0)
    plot = plot_for(x_max, low, top, width, height)
    parts = [
        '<svg xmlns="http://www.w3.org/2000/svg" class="memtrim-compare" '
        f'viewBox="0 0 {width} {plot.height}" '
        'width="100%" preserveAspectRatio="xMinYMin meet" font-family="system-ui, sans-serif">',
        *_axes(plot, "op number"),
    ]
    for i, (label, tl) in enumerate(curves):
        color = COMPARE_COLORS[i % len(COMPARE_COLORS)]
        parts.append(
            f'<polyline points="{" ".join(_steps(tl.x, tl.total, plot)[:-1])}" fill="none" stroke="{color}" '
            f'stroke-width="1.5"><title>{text(label)}</title></polyline>'
        )
        parts += _peak(tl.peak_x, tl.peak_bytes, plot, f"{label}: {format_bytes(tl.peak_bytes)}", color)
    parts.append("</svg>")
    return "\n".join(parts)
