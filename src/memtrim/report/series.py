"""The live-memory timeline as the pictures draw it: bytes by role (or by source line) over the op
sequence, with the phases, the regions and the peak, read from an :class:`~memtrim.analysis.Analysis`.

Read from the headline device's :class:`~memtrim.analysis.LiveCurve`. A trace with more than two
events per bucket is thinned: the op axis is cut into ``buckets`` equal stretches (the HTML and the
notebook pass one per pixel column of the chart, :func:`memtrim.report.svg.plot_columns`) and each keeps
its first lowest and first highest moment (:mod:`memtrim.report.downsample`), so the peak, at its op,
and every dip survive exactly. The HTML report, the notebook view, the diff and the PNG all read this.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

from memtrim.analysis import Analysis, LiveCurve, Role
from memtrim.report.downsample import extremes, starts_at, sums_at
from memtrim.trace.model import Site, site_text

OTHER_LINES = "other lines"
BEFORE_REGION = len(Role)
"""The role slot of tensors from before the region (see :func:`role_slots`)."""


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


def bucket_starts(op_ticks: Sequence[int], event_ticks: Sequence[int], buckets: int) -> list[int]:
    """Where each of ``buckets`` equal stretches of the op axis starts, as an index of the events:
    bucket ``b`` holds the events of ops ``ceil(b * ops / buckets)`` up to the next bucket's first op."""
    n_ops = len(op_ticks)
    firsts = sorted({-(-b * n_ops // buckets) for b in range(1, buckets)} - {0, n_ops})
    return [0, *starts_at(event_ticks, (op_ticks[k] for k in firsts))]


def _kept(op_ticks: Sequence[int], curve: LiveCurve, buckets: int) -> list[int]:
    """Event indices to draw: every event when there are few; else, per bucket of the op axis, the
    lowest and the highest moment (see :mod:`memtrim.report.downsample`)."""
    if len(curve.ticks) <= 2 * buckets:
        return list(range(len(curve.ticks)))
    return extremes(curve.live, bucket_starts(op_ticks, curve.ticks, buckets))


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


def role_slots(analysis: Analysis, curve: LiveCurve) -> list[int]:
    """Per event of ``curve``, the slot of its allocation's role: ``list(Role).index(role)``, or
    ``len(Role)`` (:data:`BEFORE_REGION`) for a tensor from before the region (its free)."""
    allocations, roles = analysis.allocations, analysis.roles
    slot_of = {role: i for i, role in enumerate(Role)}
    return [BEFORE_REGION if allocations[ident].preexisting else slot_of[roles[ident]] for ident in curve.ids]


def _line_slots(analysis: Analysis, curve: LiveCurve, line_sites: Sequence[Site | None]) -> list[int]:
    """Per event of ``curve``, the slot of its allocation's line: its index in ``line_sites``, else
    ``len(line_sites)`` ("other lines"), or one more for a tensor from before the region."""
    allocations = analysis.allocations
    wanted = {site: i for i, site in enumerate(line_sites)}
    other, before = len(line_sites), len(line_sites) + 1
    by_object: dict[int, int] = {}  # id(site) -> its slot: a Site's own hash is Python code, id() is not
    slots = []
    for ident in curve.ids:
        a = allocations[ident]
        if a.preexisting:
            slots.append(before)
            continue
        key = id(a.site)
        slot = by_object.get(key)
        if slot is None:
            slot = by_object[key] = wanted.get(a.site, other)
        slots.append(slot)
    return slots


def timeline(analysis: Analysis, *, buckets: int = 600, lines: int = 8) -> Timeline:
    """The headline device's timeline, at most about ``2 * buckets`` points (see the module docstring)."""
    log = analysis.log
    curve = analysis.curve()
    rows = log.ops.rows
    op_ticks = list(map(attrgetter("tick"), rows))
    n_ops = len(op_ticks)
    keep = _kept(op_ticks, curve, buckets)

    line_sites = line_layers_for(analysis, lines)
    role_order = list(Role)
    role_sums = sums_at(curve.deltas, role_slots(analysis, curve), len(role_order) + 1, keep)
    line_sums = sums_at(curve.deltas, _line_slots(analysis, curve, line_sites), len(line_sites) + 2, keep)

    by_role = tuple(
        Layer(role.value, (0, *values))
        for role, values in zip(role_order, role_sums, strict=False)
        if any(values)
    )
    names = [site_text(site) for site in line_sites] + [OTHER_LINES]
    by_line = tuple(
        Layer(name, (0, *values)) for name, values in zip(names, line_sums, strict=False) if any(values)
    )

    phases: list[Span] = []
    first = 0
    for phase, run in itertools.groupby(map(attrgetter("phase"), rows)):
        count = sum(1 for _ in run)
        phases.append(Span(phase.value, float(first), float(first + count)))
        first += count
    if phases:  # the last phase runs to the end of the axis
        phases[-1] = Span(phases[-1].name, phases[-1].start, float(n_ops))

    regions: list[Span] = []
    for r in log.regions:
        end_tick = r.end_tick if r.end_tick is not None else log.end_tick
        start = float(op_index(op_ticks, r.start_tick)) if n_ops else 0.0
        end = float(op_index(op_ticks, end_tick) + 1) if r.end_tick is not None and n_ops else float(n_ops)
        regions.append(Span(r.name, start, max(start, end)))

    peak = analysis.peak
    peak_x = float(op_index(op_ticks, peak.tick)) if peak.tick is not None else None
    ticks, live = curve.ticks, curve.live
    return Timeline(
        device=curve.device,
        ops=n_ops,
        x=(0.0, *(float(op_index(op_ticks, ticks[i])) for i in keep)),
        ticks=(-1, *(ticks[i] for i in keep)),
        total=(0, *(live[i] for i in keep)),
        by_role=by_role,
        by_line=by_line,
        freed_before=(0, *(-v for v in role_sums[-1])),
        phases=tuple(phases),
        regions=tuple(regions),
        peak_x=peak_x,
        peak_bytes=peak.bytes,
        region_peaks=analysis.region_peaks,
    )
