"""One :class:`Analysis` per trace: every derived figure, computed once.

``analyze(log)`` sweeps each device's allocation events once (:mod:`~memtrim.analysis.timeline`),
decides every allocation's category once (:mod:`~memtrim.analysis.categories`), and answers the rest
from those: peaks, per-phase peaks, the live set at the peak, temporaries. Reporters and the public
``Trace`` read from it; nothing here calls back into the trace's objects for derived facts. Stages above
(the doctor's diagnoses) keep what they derive from it in :meth:`Analysis.memo`, computed once too.
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from memtrim.analysis.categories import Category, categorize_all
from memtrim.analysis.failure import requested_bytes
from memtrim.analysis.flow import Flow, build_flow
from memtrim.analysis.roles import Role, roles_of
from memtrim.analysis.timeline import LiveCurve, Peak, alive_at, headline, peak_of, peaks_by_phase, sweep
from memtrim.analysis.whatif import Edits, replay
from memtrim.trace.collector import collector_paused
from memtrim.trace.model import Allocation, OpCall, Phase, Site, TraceLog

T = TypeVar("T")


@dataclass(frozen=True)
class LineGroup:
    """Bytes alive at one moment that one source line made."""

    site: Site | None
    bytes: int
    count: int
    categories: Mapping[Category, int]
    """Bytes per category (what their lifetimes say), largest first."""
    ops: Mapping[str, int]
    """Bytes per op, largest first."""
    roles: Mapping[Role, int] = field(default_factory=dict)
    """Bytes per role (what they are for), largest first."""
    kept_after_forward: int = 0
    """Of the ``activation`` bytes, those autograd did not save: forward results the program kept."""


def group_by_line(
    allocations: Iterable[Allocation], categories: tuple[Category, ...], roles: tuple[Role, ...] = ()
) -> list[LineGroup]:
    """``allocations`` grouped by the line that made them, largest first (``roles`` indexed by
    allocation id, as ``categories``; without them a group's ``roles`` is empty)."""
    members: dict[Site | None, list[Allocation]] = {}
    for a in allocations:
        members.setdefault(a.site, []).append(a)
    groups = []
    for site, allocs in members.items():
        by_category: dict[Category, int] = {}
        by_op: dict[str, int] = {}
        by_role: dict[Role, int] = {}
        kept = 0
        for a in allocs:
            by_category[categories[a.id]] = by_category.get(categories[a.id], 0) + a.bytes
            by_op[a.op] = by_op.get(a.op, 0) + a.bytes
            if roles:
                by_role[roles[a.id]] = by_role.get(roles[a.id], 0) + a.bytes
                if roles[a.id] is Role.ACTIVATION and categories[a.id] is Category.KEPT:
                    kept += a.bytes
        groups.append(
            LineGroup(
                site,
                sum(a.bytes for a in allocs),
                len(allocs),
                dict(sorted(by_category.items(), key=lambda kv: -kv[1])),
                dict(sorted(by_op.items(), key=lambda kv: -kv[1])),
                dict(sorted(by_role.items(), key=lambda kv: -kv[1])),
                kept,
            )
        )
    return sorted(groups, key=lambda g: g.bytes, reverse=True)


@dataclass(frozen=True)
class Breakdown:
    """Bytes by role alive at one moment on one device.

    ``made`` counts what the region allocated; ``preexisting`` what existed before it and was still
    alive (a model built before ``track()``: its weights are ``parameter`` bytes here);
    ``preexisting_freed`` the pre-region bytes freed inside the region by then. The live curve above
    the region's start at that moment is ``sum(made) - preexisting_freed``.
    """

    tick: int | None
    device: str | None
    made: Mapping[Role, int]
    preexisting: Mapping[Role, int]
    preexisting_freed: int

    @property
    def above_start(self) -> int:
        return sum(self.made.values()) - self.preexisting_freed

    def total(self, role: Role) -> int:
        """Bytes of ``role`` alive then, made in the region or before it."""
        return self.made.get(role, 0) + self.preexisting.get(role, 0)


@dataclass(frozen=True)
class Failure:
    """Where a region that ended with an exception stopped, and what was alive then."""

    error: str
    tick: int
    """Just before the failing op's outputs (or the region's end when no op failed)."""
    op: OpCall | None
    requested_bytes: int | None
    """What the failed allocation asked for, when the error message says so."""
    live_bytes: int
    """Live bytes above the region's start on the peak's device at that moment."""
    lines: tuple[LineGroup, ...]
    breakdown: Breakdown


@dataclass(frozen=True)
class Analysis:
    """Everything memtrim derives from one finished trace log. Build it with :func:`analyze`."""

    log: TraceLog
    categories: tuple[Category, ...]
    """Indexed by allocation id."""
    roles: tuple[Role, ...]
    """Indexed by allocation id."""
    curves: Mapping[str, LiveCurve]
    """Per device, the one sweep every figure below is read from."""
    peaks: Mapping[str, Peak]
    """Per device."""
    peak: Peak
    """The headline: the peak of the device whose peak is largest."""
    peak_by_phase: Mapping[Phase, int]
    """On the headline device: the highest live bytes while each phase ran."""
    live_at_peak: tuple[Allocation, ...]
    """Made inside the region and alive at the headline peak, on its device."""
    lines_at_peak: tuple[LineGroup, ...]
    temporaries: tuple[Allocation, ...]
    """Made and freed in the same phase, largest first."""
    _charged_peaks: dict[str, Peak] = field(default_factory=dict, repr=False, compare=False)
    _memo: dict[str, object] = field(default_factory=dict, repr=False, compare=False)

    @property
    def allocations(self) -> list[Allocation]:
        return self.log.allocations

    def category(self, allocation: Allocation) -> Category:
        return self.categories[allocation.id]

    def role(self, allocation: Allocation) -> Role:
        return self.roles[allocation.id]

    def breakdown_at(self, tick: int, device: str | None = None) -> Breakdown:
        """Bytes by role alive just after ``tick`` on ``device`` (default: the headline peak's)."""
        device = device or self.peak.device
        made: dict[Role, int] = {}
        before: dict[Role, int] = {}
        freed = 0
        for a in self.log.allocations:
            if a.device != device:
                continue
            gone = a.free_tick is not None and a.free_tick <= tick
            if a.preexisting:
                if gone:
                    freed += a.bytes
                else:
                    role = self.roles[a.id]
                    before[role] = before.get(role, 0) + a.bytes
            elif a.alloc_tick <= tick and not gone:
                role = self.roles[a.id]
                made[role] = made.get(role, 0) + a.bytes
        order = {role: i for i, role in enumerate(Role)}
        return Breakdown(
            tick,
            device,
            dict(sorted(made.items(), key=lambda kv: order[kv[0]])),
            dict(sorted(before.items(), key=lambda kv: order[kv[0]])),
            freed,
        )

    @functools.cached_property
    def breakdown_at_peak(self) -> Breakdown:
        if self.peak.tick is None:
            return Breakdown(None, self.peak.device, {}, {}, 0)
        return self.breakdown_at(self.peak.tick)

    @functools.cached_property
    def failure(self) -> Failure | None:
        """The post-mortem, when the region ended with an exception."""
        log = self.log
        if not log.error:
            return None
        op = log.failed_op
        tick = op.tick if op is not None else log.end_tick - 1
        device = self.peak.device
        return Failure(
            error=log.error,
            tick=tick,
            op=op,
            requested_bytes=requested_bytes(log.error),
            live_bytes=self.curve(device).live_after(tick),
            lines=tuple(self.lines_alive_at(tick, device)),
            breakdown=self.breakdown_at(tick, device),
        )

    @functools.cached_property
    def phase_ends(self) -> dict[Phase, int]:
        """For each phase that ran: the last tick before the first op that followed its last op (the
        region's end if none did). Frees between its last op and the next op belong to it."""
        rows = self.log.ops.rows
        last: dict[Phase, int] = {}
        for i, row in enumerate(rows):
            last[row.phase] = i
        ends = {}
        for phase, i in last.items():
            following = next((r.tick for r in rows[i + 1 :] if r.phase is not phase), None)
            ends[phase] = (following if following is not None else self.log.end_tick) - 1
        return {phase: ends[phase] for phase in Phase if phase in ends}

    @functools.cached_property
    def region_peaks(self) -> tuple[tuple[str, int], ...]:
        """For each ``memtrim.region`` entry, in order: its name and the highest live bytes above the
        start while it was open, on the headline peak's device."""
        curve = self.curve()
        out = []
        for r in self.log.regions:
            end_tick = r.end_tick if r.end_tick is not None else self.log.end_tick
            lo = bisect.bisect_left(curve.ticks, r.start_tick)
            hi = bisect.bisect_right(curve.ticks, end_tick)
            carried = curve.live[lo - 1] if lo > 0 else 0
            out.append((r.name, max([carried, *curve.live[lo:hi]])))
        return tuple(out)

    @functools.cached_property
    def known_at_start(self) -> dict[str, int]:
        """Per device, the bytes alive when the region started that memtrim knows of: tensors from
        before it that an op inside read, and the parameters, gradients, optimizer state and buffers
        it was told of (what the program holds and the region never touches is not counted)."""
        known: dict[str, int] = {}
        for a in self.log.allocations:
            if a.preexisting:
                known[a.device] = known.get(a.device, 0) + a.bytes
        return known

    @property
    def absolute_peak_bytes(self) -> int:
        """The headline peak with what was alive before the region added back (:attr:`known_at_start`
        on its device): how the entries of a region entered several times compare — a training loop's
        later steps start with the optimizer state the first step made."""
        return self.peak.bytes + self.known_at_start.get(self.peak.device or "", 0)

    def made_bytes(self, role: Role) -> int:
        """Bytes of ``role`` the region allocated (alive or not at the end)."""
        return sum(a.bytes for a in self.log.allocations if not a.preexisting and self.roles[a.id] is role)

    @functools.cached_property
    def breakdown_at_phase_end(self) -> dict[Phase, Breakdown]:
        return {phase: self.breakdown_at(tick) for phase, tick in self.phase_ends.items()}

    def largest_temporaries(self, n: int = 10) -> list[Allocation]:
        """The ``n`` largest temporaries by role: made and freed in one phase, and not a parameter,
        gradient or optimizer state made and freed with it (AdamW's state created in a first step and
        dropped with the optimizer inside the region is state, whatever its lifetime)."""
        roles = self.roles
        found = (a for a in self.temporaries if roles[a.id] is Role.TEMPORARY)
        return list(itertools.islice(found, max(n, 0)))

    def curve(self, device: str | None = None) -> LiveCurve:
        """The live curve of ``device`` (default: the headline peak's)."""
        device = device or self.peak.device
        if device is None or device not in self.curves:
            return LiveCurve(device or "cpu")
        return self.curves[device]

    def alive_at(self, tick: int, device: str | None = None) -> list[Allocation]:
        """Allocations made inside the region and alive just after ``tick`` (on ``device``, or all)."""
        return alive_at(self.log.allocations, tick, device)

    def lines_alive_at(self, tick: int, device: str | None = None) -> list[LineGroup]:
        return group_by_line(self.alive_at(tick, device), self.categories, self.roles)

    def peak_with(self, edits: Edits, device: str | None = None) -> int:
        """The peak on ``device`` (default: the headline's) had the recorded timeline been ``edits``."""
        return replay(self.curve(device), edits)

    def peak_without(self, removed: Iterable[Allocation], device: str | None = None) -> int:
        """The peak on ``device`` (default: the headline's) had ``removed`` never been allocated."""
        return replay(self.curve(device), Edits.removing(a.id for a in removed))

    def peak_as(self, allocator: str) -> Peak:
        """The headline peak if every block were charged by ``allocator``'s rule (``"cuda"``: 512-byte
        blocks): a GPU prediction from a trace recorded on the CPU or with fake tensors."""
        if allocator not in self._charged_peaks:
            allocations = self.log.allocations
            peaks = [
                peak_of(sweep(allocations, d, allocator), allocations, self.log.ops) for d in self.curves
            ]
            self._charged_peaks[allocator] = headline(peaks)
        return self._charged_peaks[allocator]

    @functools.cached_property
    def flow(self) -> Flow:
        """The data flow, indexed once: producer and readers of every allocation (diagnoses read it)."""
        with collector_paused():
            return build_flow(self.log)

    @functools.cached_property
    def alive_ids_at_peak(self) -> frozenset[int]:
        """Ids of the allocations alive at the headline peak on its device, made in the region or not
        (what a fix must touch to lower that peak)."""
        tick = self.peak.tick
        if tick is None:
            return frozenset()
        before = (
            a.id
            for a in self.log.allocations
            if a.preexisting and a.device == self.peak.device and (a.free_tick is None or a.free_tick > tick)
        )
        return frozenset((*(a.id for a in self.live_at_peak), *before))

    def memo(self, key: str, compute: Callable[[], T]) -> T:
        """``compute()``, made once per analysis and kept under ``key``: how a stage above (the doctor)
        caches what it derives from this analysis without the analysis importing it."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]  # type: ignore[return-value]


def analyze(log: TraceLog) -> Analysis:
    """Compute every derived figure of ``log`` once."""
    with collector_paused():
        return _analyze(log)


def _analyze(log: TraceLog) -> Analysis:
    allocations = log.allocations
    categories = categorize_all(allocations)
    roles = roles_of(allocations, categories)
    devices = sorted({a.device for a in allocations})
    curves = {device: sweep(allocations, device) for device in devices}
    peaks = {device: peak_of(curve, allocations, log.ops) for device, curve in curves.items()}
    peak = headline(peaks.values())
    if peak.tick is not None and peak.device is not None:
        live = tuple(alive_at(allocations, peak.tick, peak.device))
        by_phase = peaks_by_phase(curves[peak.device])
    else:
        live, by_phase = (), dict.fromkeys(Phase, 0)
    temporaries = sorted(
        (a for a in allocations if categories[a.id] is Category.TEMPORARY),
        key=lambda a: (-a.bytes, a.alloc_tick),
    )
    return Analysis(
        log=log,
        categories=categories,
        roles=roles,
        curves=curves,
        peaks=peaks,
        peak=peak,
        peak_by_phase=by_phase,
        live_at_peak=live,
        lines_at_peak=tuple(group_by_line(live, categories, roles)),
        temporaries=tuple(temporaries),
    )
