"""Live bytes over time: the one sweep over a device's allocation events, and the peaks read from it.

Every other question about "how much was alive when" (the peak, per-phase peaks, what-if replays)
reads the :class:`LiveCurve` this module builds once per device.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, compress
from operator import is_not, itemgetter

from memtrim.analysis.allocator import charge_rule
from memtrim.trace.model import Allocation, OpCall, OpLog, OpRow, Phase, Site


@dataclass(frozen=True)
class LiveCurve:
    """Allocation events on one device, in tick order, and the live bytes after each.

    ``deltas[i]`` is what event ``i`` adds (an allocation, charged as the device's allocator does) or
    removes (a free) at ``ticks[i]``; ``ids[i]`` is the allocation's id; ``phases[i]`` the phase the
    event happened in. Storages from before the region only appear when they are freed.
    """

    device: str
    ticks: list[int] = field(default_factory=list)
    deltas: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    phases: list[Phase] = field(default_factory=list)
    live: list[int] = field(default_factory=list)
    charged: dict[int, int] = field(default_factory=dict)
    """Allocation id -> bytes charged for it."""
    _first: dict[int, int] = field(default_factory=dict, repr=False, compare=False)
    _second: dict[int, int] = field(default_factory=dict, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.ticks)

    def events_of(self, ident: int) -> list[int]:
        """Indexes of allocation ``ident``'s events (its allocation and its free), indexed on first use
        (two dicts of ints: no container per allocation for the garbage collector to walk)."""
        first, second = self._first, self._second
        if not first and self.ids:
            for i, other in enumerate(self.ids):
                if other in first:
                    second[other] = i
                else:
                    first[other] = i
        if ident not in first:
            return []
        return [first[ident], second[ident]] if ident in second else [first[ident]]

    def live_after(self, tick: int) -> int:
        """Live bytes just after ``tick`` (0 before the first event)."""
        i = bisect.bisect_right(self.ticks, tick) - 1
        return self.live[i] if i >= 0 else 0

    def peak_index(self) -> int | None:
        """The first event at which the curve is highest, or None when it never rises above 0."""
        best = max(self.live, default=0)
        return self.live.index(best) if best > 0 else None


def sweep(allocations: Iterable[Allocation], device: str, charge_as: str | None = None) -> LiveCurve:
    """The live curve of ``device``. Bytes are what its allocator charges, or ``charge_as``'s (e.g.
    ``"cuda"`` to predict a GPU peak from a trace recorded on the CPU or with fake tensors)."""
    rule = charge_rule(charge_as or device)
    events: list[tuple[int, int, int, Phase]] = []
    charged: dict[int, int] = {}
    for a in allocations:
        if a.device != device:
            continue
        charge = charged[a.id] = a.bytes if rule is None else rule(a.bytes)
        if not a.preexisting:
            events.append((a.alloc_tick, charge, a.id, a.phase))
        if a.free_tick is not None:
            events.append((a.free_tick, -charge, a.id, a.free_phase or a.phase))
    events.sort(key=itemgetter(0))  # stable: events of one tick keep the order they were made in
    curve = LiveCurve(device, charged=charged)
    if events:
        ticks, deltas, ids, phases = zip(*events, strict=True)
        curve.ticks.extend(ticks)
        curve.deltas.extend(deltas)
        curve.ids.extend(ids)
        curve.phases.extend(phases)
        curve.live.extend(accumulate(deltas))
    return curve


@dataclass(frozen=True)
class Peak:
    """The moment of highest live bytes (above the region's start) on one device."""

    bytes: int
    device: str | None = None
    tick: int | None = None
    allocation: Allocation | None = None
    """The allocation whose arrival reached the peak."""
    op: OpCall | None = None
    """The op running at the peak."""

    @property
    def phase(self) -> Phase | None:
        return self.allocation.phase if self.allocation else None

    @property
    def site(self) -> Site | None:
        return self.allocation.site if self.allocation else None


def peak_of(curve: LiveCurve, allocations: Sequence[Allocation], ops: OpLog) -> Peak:
    index = curve.peak_index()
    if index is None:
        return Peak(bytes=0, device=curve.device)
    tick = curve.ticks[index]
    return Peak(curve.live[index], curve.device, tick, allocations[curve.ids[index]], op_at(ops, tick))


def headline(peaks: Iterable[Peak]) -> Peak:
    """The peak of the device whose peak is largest (an accelerator wins a tie with the CPU)."""
    return max(peaks, key=lambda p: (p.bytes, p.device != "cpu"), default=Peak(bytes=0))


def _tick_of(row: OpRow) -> int:
    return row.tick


def op_at(ops: OpLog, tick: int) -> OpCall | None:
    """The op that was running at ``tick`` (the last one started at or before it)."""
    index = bisect.bisect_right(ops.rows, tick, key=_tick_of) - 1
    return ops[index] if index >= 0 else None


def peaks_by_phase(curve: LiveCurve) -> dict[Phase, int]:
    """The highest live bytes while each phase ran, on one device: the most after any event of the
    phase, or carried into it from before its first event."""
    best = dict.fromkeys(Phase, 0)
    phases, live = curve.phases, curve.live
    # the runs of events of one phase, found and maxed at C speed (a million events on long traces)
    starts = [0, *compress(range(1, len(phases)), map(is_not, phases[1:], phases[:-1]))]
    ends = [*starts[1:], len(phases)]
    carried = 0
    for start, end in zip(starts, ends, strict=True):
        if start == end:
            break  # no events at all
        phase = phases[start]
        best[phase] = max(best[phase], carried, max(live[start:end]))
        carried = live[end - 1]
    return best


def alive_at(allocations: Iterable[Allocation], tick: int, device: str | None = None) -> list[Allocation]:
    """Allocations made inside the region and alive just after ``tick``."""
    return [a for a in allocations if (device is None or a.device == device) and a.alive_at(tick)]
