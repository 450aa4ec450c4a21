"""What-if: the peak a recorded timeline would have had with some of its allocations changed.

A fix is a set of edits to the recorded allocations — removed, shrunk or grown, made later or freed
earlier — plus allocations it adds (a recompute's transient, a chunk's buffer). The replay reuses the
device's one :class:`~memtrim.analysis.timeline.LiveCurve`: untouched events keep their place, the
edited and added ones are merged in, and the peak is read off in one pass. Nothing is re-sorted.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from memtrim.analysis.timeline import LiveCurve


@dataclass(frozen=True)
class Added:
    """An allocation a fix would make: ``bytes`` from ``alloc_tick`` to ``free_tick`` (None: to the end).

    Ticks may be fractional, to place an event between two recorded ones.
    """

    bytes: int
    alloc_tick: float
    free_tick: float | None = None


@dataclass(frozen=True)
class Edits:
    """Changes to a recorded timeline, by allocation id."""

    remove: frozenset[int] = frozenset()
    resize: Mapping[int, int] = field(default_factory=dict)
    """id -> the bytes it would have."""
    alloc_at: Mapping[int, float] = field(default_factory=dict)
    """id -> the tick it would be made at."""
    free_at: Mapping[int, float | None] = field(default_factory=dict)
    """id -> the tick it would be freed at (None: never)."""
    add: tuple[Added, ...] = ()

    @classmethod
    def removing(cls, ids: Iterable[int]) -> Edits:
        return cls(remove=frozenset(ids))

    def touched(self) -> set[int]:
        return set(self.remove) | set(self.resize) | set(self.alloc_at) | set(self.free_at)


def _edited_events(curve: LiveCurve, edits: Edits) -> list[tuple[float, int]]:
    """(tick, delta) for each edited (not removed) allocation and each added one."""
    events: list[tuple[float, int]] = []
    for ident in edits.touched() - edits.remove:
        if ident not in curve.charged:
            raise KeyError(f"allocation {ident} is not on {curve.device}")
        first_tick: float | None = None
        last_tick: float | None = None
        for i in curve.events_of(ident):
            if curve.deltas[i] > 0:
                first_tick = curve.ticks[i]
            else:
                last_tick = curve.ticks[i]
        nbytes = edits.resize.get(ident, curve.charged[ident])
        start = edits.alloc_at.get(ident, first_tick)
        end = edits.free_at.get(ident, last_tick)
        if start is not None:
            events.append((start, nbytes))
        if end is not None:
            events.append((end, -nbytes))
    for added in edits.add:
        events.append((added.alloc_tick, added.bytes))
        if added.free_tick is not None:
            events.append((added.free_tick, -added.bytes))
    # at equal ticks allocations come before frees: the replay never under-states a peak
    events.sort(key=lambda e: (e[0], e[1] < 0))
    return events


def _position(curve: LiveCurve, tick: float, frees: bool) -> int:
    """How many recorded events come before an edited one at ``tick`` (allocations before frees at
    one tick; a recorded event before an edited one of the same kind)."""
    i = bisect.bisect_left(curve.ticks, tick)
    ticks, deltas = curve.ticks, curve.deltas
    while i < len(ticks) and ticks[i] == tick and (deltas[i] < 0) <= frees:
        i += 1
    return i


def replay(curve: LiveCurve, edits: Edits) -> int:
    """The peak live bytes of ``curve`` with ``edits`` applied.

    The edited timeline is the recorded one plus a correction that changes only where a touched
    allocation's recorded event was (it no longer counts) and where an edited or added event is: so the
    peak is the largest recorded value of each stretch between those points plus that stretch's
    correction (``max`` of a slice, in C), and the value at each edited event.
    """
    live = curve.live
    # (position among the recorded events, order, delta): a recorded event dropped at its position,
    # an edited one inserted before the recorded event at its position
    changes: list[tuple[int, int, int]] = []
    for ident in edits.touched():
        for i in curve.events_of(ident):
            changes.append((i, 1, -curve.deltas[i]))
    for tick, delta in _edited_events(curve, edits):
        changes.append((_position(curve, tick, delta < 0), 0, delta))
    changes.sort(key=lambda c: (c[0], c[1]))
    best = correction = 0
    start = 0  # first recorded event of the current stretch
    for position, kind, delta in changes:
        if position > start:
            best = max(best, max(live[start:position]) + correction)
        if kind == 0:  # inserted before recorded event `position`
            correction += delta
            before = live[position - 1] if position > 0 else 0
            best = max(best, before + correction)
            start = max(start, position)
        else:  # the recorded event at `position` no longer happens
            correction += delta
            start = position + 1
    if start < len(live):
        best = max(best, max(live[start:]) + correction)
    return best


def peak_without(curve: LiveCurve, removed: Iterable[int]) -> int:
    """The peak of ``curve`` if the allocations with ids ``removed`` had never been made."""
    return replay(curve, Edits.removing(removed))
