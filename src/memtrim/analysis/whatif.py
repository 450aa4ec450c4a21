"""What-if: the peak a recorded timeline would have had with some of its allocations changed.

A fix is a set of edits to the recorded allocations — removed, shrunk or grown, made later or freed
earlier — plus allocations it adds (a recompute's transient, a chunk's buffer). The replay reuses the
device's one :class:`~memtrim.analysis.timeline.LiveCurve`: untouched events keep their place, the
edited and added ones are merged in, and the peak is read off in one pass. Nothing is re-sorted.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator, Mapping
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
    first_tick: dict[int, float] = {}
    last_tick: dict[int, float | None] = {}
    touched = edits.touched() - edits.remove
    for tick, delta, ident in zip(curve.ticks, curve.deltas, curve.ids, strict=True):
        if ident in touched:
            if delta > 0:
                first_tick[ident] = tick
            else:
                last_tick[ident] = tick
    events: list[tuple[float, int]] = []
    for ident in touched:
        if ident not in curve.charged:
            raise KeyError(f"allocation {ident} is not on {curve.device}")
        nbytes = edits.resize.get(ident, curve.charged[ident])
        start = edits.alloc_at.get(ident, first_tick.get(ident))
        end = edits.free_at[ident] if ident in edits.free_at else last_tick.get(ident)
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


def replay(curve: LiveCurve, edits: Edits) -> int:
    """The peak live bytes of ``curve`` with ``edits`` applied."""
    skip = edits.touched()
    base: Iterator[tuple[float, int]] = (
        (tick, delta)
        for tick, delta, ident in zip(curve.ticks, curve.deltas, curve.ids, strict=True)
        if ident not in skip
    )
    live = best = 0
    for _, delta in heapq.merge(base, _edited_events(curve, edits), key=lambda e: (e[0], e[1] < 0)):
        live += delta
        if live > best:
            best = live
    return best


def peak_without(curve: LiveCurve, removed: Iterable[int]) -> int:
    """The peak of ``curve`` if the allocations with ids ``removed`` had never been made."""
    return replay(curve, Edits.removing(removed))
