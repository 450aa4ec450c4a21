"""The live-memory timeline as the pictures draw it: bytes by role (or by source line) over the op
sequence, with the phases, the regions and the peak, read from an :class:`~memtrim.analysis.Analysis`.

One pass over the headline device's :class:`~memtrim.analysis.LiveCurve`. Long traces are thinned to a
few points per pixel: each bucket of the op axis keeps its lowest and its highest moment, so the peak
(and every dip) survives exactly. The HTML report, the notebook view and the PNG all read this.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from memtrim.analysis import Analysis, Role
from memtrim.trace.model import Site, site_text

OTHER_LINES = "other lines"


@dataclass(frozen=True)
class Layer:
    """One band of the stacked chart: bytes alive at each point."""

    name: str
    values: tuple[int, ...]


@dataclass(frozen=True)
class Span:
    """A stretch of the op axis: a phase (``name`` is its value) or a region."""

    name: str
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """The headline device's timeline, thinned to at most about ``2 * buckets`` points."""

    device: str
    ops: int
    """Ops in the trace: the x axis runs from 0 to this."""
    x: tuple[float, ...]
    """The op running at each point (its number in the trace)."""
    ticks: tuple[int, ...]
    """The trace tick of each point (for "what was alive here")."""
    total: tuple[int, ...]
    """Live bytes above the region's start at each point (the curve the peak is read from)."""
    by_role: tuple[Layer, ...]
    by_line: tuple[Layer, ...]
    freed_before: tuple[int, ...]
    """Bytes of tensors from before the region freed by then (the curve lies this far below the
    stack's top; drawn below zero)."""
    phases: tuple[Span, ...]
    regions: tuple[Span, ...]
    peak_x: float | None
    peak_bytes: int
    region_peaks: tuple[tuple[str, int], ...]
    """Per region span, in order: its name and the highest live bytes while it was open."""

    @property
    def top(self) -> int:
        """The highest point of the stack (never below the curve)."""
        stacked = [sum(layer.values[i] for layer in self.by_role) for i in range(len(self.x))]
        return max([0, self.peak_bytes, *stacked])


def op_index(op_ticks: list[int], tick: int) -> int:
    """The number of the op running at ``tick`` (the last one started at or before it; 0 before any)."""
    return max(0, bisect.bisect_right(op_ticks, tick) - 1)


def _kept(xs: list[int], live: list[int], ops: int, buckets: int) -> list[int]:
    """Event indices to draw: per bucket of the op axis, the lowest and the highest moment."""
    if len(xs) <= 2 * buckets:
        return list(range(len(xs)))
    width = max(ops, 1) / buckets
    keep: list[int] = []
    bucket, low, high = -1, 0, 0
    for i, x in enumerate(xs):
        b = int(x / width)
        if b != bucket:
            if bucket >= 0:
                keep.extend(sorted({low, high}))
            bucket, low, high = b, i, i
        else:
            if live[i] < live[low]:
                low = i
            if live[i] > live[high]:
                high = i
    keep.extend(sorted({low, high}))
    if keep[-1] != len(xs) - 1:
        keep.append(len(xs) - 1)
    return keep


def line_layers_for(analysis: Analysis, count: int) -> list[Site | None]:
    """The lines that get their own band: the largest at the peak, then those of the largest
    temporaries."""
    chosen: list[Site | None] = []
    for group in analysis.lines_at_peak:
        if len(chosen) < count and group.site not in chosen:
            chosen.append(group.site)
    for temp in analysis.temporaries:
        if len(chosen) >= count:
            break
        if temp.device == analysis.peak.device and temp.site not in chosen:
            chosen.append(temp.site)
    return chosen


def timeline(analysis: Analysis, *, buckets: int = 600, lines: int = 8) -> Timeline:
    """The headline device's timeline (see the module docstring)."""
    log = analysis.log
    curve = analysis.curve()
    op_ticks = [row.tick for row in log.ops.rows]
    n_ops = len(op_ticks)
    allocations = analysis.allocations
    roles = analysis.roles
    xs = [op_index(op_ticks, t) for t in curve.ticks]
    keep = _kept(xs, curve.live, n_ops, buckets)

    line_sites = line_layers_for(analysis, lines)
    line_slot = {site: i for i, site in enumerate(line_sites)}
    role_order = list(Role)
    role_slot = {role: i for i, role in enumerate(role_order)}
    role_sums = [0] * len(role_order)
    line_sums = [0] * (len(line_sites) + 1)
    freed = 0

    out_x: list[float] = [0.0]
    out_ticks: list[int] = [-1]
    out_total: list[int] = [0]
    out_roles: list[list[int]] = [[0] for _ in role_order]
    out_lines: list[list[int]] = [[0] for _ in line_sums]
    out_freed: list[int] = [0]
    wanted = iter(keep)
    next_kept = next(wanted, None)
    for i, (delta, ident) in enumerate(zip(curve.deltas, curve.ids, strict=True)):
        a = allocations[ident]
        if a.preexisting:
            freed -= delta
        else:
            role_sums[role_slot[roles[ident]]] += delta
            line_sums[line_slot.get(a.site, len(line_sites))] += delta
        if i == next_kept:
            out_x.append(float(xs[i]))
            out_ticks.append(curve.ticks[i])
            out_total.append(curve.live[i])
            for slot, value in enumerate(role_sums):
                out_roles[slot].append(value)
            for slot, value in enumerate(line_sums):
                out_lines[slot].append(value)
            out_freed.append(freed)
            next_kept = next(wanted, None)

    by_role = tuple(
        Layer(role.value, tuple(values))
        for role, values in zip(role_order, out_roles, strict=True)
        if any(values)
    )
    names = [site_text(site) for site in line_sites] + [OTHER_LINES]
    by_line = tuple(
        Layer(name, tuple(values)) for name, values in zip(names, out_lines, strict=True) if any(values)
    )

    phases: list[Span] = []
    for i, row in enumerate(log.ops.rows):
        if phases and phases[-1].name == row.phase.value:
            continue
        if phases:
            phases[-1] = Span(phases[-1].name, phases[-1].start, float(i))
        phases.append(Span(row.phase.value, float(i), float(n_ops)))

    regions: list[Span] = []
    for r in log.regions:
        end_tick = r.end_tick if r.end_tick is not None else log.end_tick
        start = float(op_index(op_ticks, r.start_tick)) if n_ops else 0.0
        end = float(op_index(op_ticks, end_tick) + 1) if r.end_tick is not None and n_ops else float(n_ops)
        regions.append(Span(r.name, start, max(start, end)))

    peak = analysis.peak
    peak_x = float(op_index(op_ticks, peak.tick)) if peak.tick is not None else None
    return Timeline(
        device=curve.device,
        ops=n_ops,
        x=tuple(out_x),
        ticks=tuple(out_ticks),
        total=tuple(out_total),
        by_role=by_role,
        by_line=by_line,
        freed_before=tuple(out_freed),
        phases=tuple(phases),
        regions=tuple(regions),
        peak_x=peak_x,
        peak_bytes=peak.bytes,
        region_peaks=analysis.region_peaks,
    )
