"""The cross-field facts the analysis relies on, checked when a trace is read from a file.

Field checks (``serialize``) make each value the right type and range; these make the values agree with
each other, so a tampered or corrupted file is one clear error instead of a wrong peak. The timeline and
the flow look ops up by tick with ``bisect`` (ops must run in tick order), replay allocations and frees in
tick order (nothing is freed before it is made, nothing happens after the trace's end), and read an op's
inputs as allocation ids.

Not checked, on purpose: ``shape`` x itemsize against ``bytes``. ``shape`` is the shape of the tensor whose
op made the storage, and real storages differ from it both ways (``empty_strided`` with zero strides is
smaller, a strided or ``resize_``d result larger), so no rule would hold for every recorded program.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import chain, compress, islice, repeat
from operator import attrgetter, eq, is_not, itemgetter, lt

from memtrim.trace.model import Allocation, OpCall, OpLog, Region

Fail = Callable[[str, str, object], Exception]


def check_invariants(
    ops: OpLog,
    allocations: Sequence[Allocation],
    regions: Sequence[Region],
    end_tick: int,
    failed_op: OpCall | None,
    fail: Fail,
) -> None:
    """Raise ``fail(where, expected, value)`` at the first fact that contradicts another."""
    if _all_hold(ops, allocations, end_tick):
        ops, allocations = OpLog(), ()  # nothing there to find: only the failed op and regions are left
    last = -1
    for seq, row in enumerate(ops.rows):
        tick = row.tick
        if not last < tick < end_tick:
            raise fail(
                f"ops[{seq}] tick",
                f"after the previous op's tick {last} and before end_tick {end_tick}",
                tick,
            )
        last = tick
        for j, input_id in enumerate(row.inputs):
            if input_id >= len(allocations):
                raise fail(f"ops[{seq}] inputs[{j}]", f"an allocation id below {len(allocations)}", input_id)
    if failed_op is not None and not failed_op.tick < end_tick:
        raise fail("failed_op tick", f"before end_tick {end_tick}", failed_op.tick)
    for a in allocations:
        where = f"allocations[{a.id}]"
        if a.preexisting != (a.alloc_tick == -1):
            raise fail(where + ".alloc_tick", "-1 exactly when preexisting is true", a.alloc_tick)
        if not a.alloc_tick < end_tick:
            raise fail(where + ".alloc_tick", f"before the trace's end_tick {end_tick}", a.alloc_tick)
        if a.free_tick is not None and not a.alloc_tick < a.free_tick <= end_tick:
            raise fail(
                where + ".free_tick",
                f"after its alloc_tick {a.alloc_tick}, at most end_tick {end_tick}",
                a.free_tick,
            )
    for i, r in enumerate(regions):
        if not r.start_tick <= end_tick:
            raise fail(f"regions[{i}] start_tick", f"at most end_tick {end_tick}", r.start_tick)
        if r.end_tick is not None and not r.start_tick <= r.end_tick <= end_tick:
            raise fail(
                f"regions[{i}] end_tick",
                f"from its start_tick {r.start_tick} to end_tick {end_tick}",
                r.end_tick,
            )


def _all_hold(ops: OpLog, allocations: Sequence[Allocation], end_tick: int) -> bool:
    """Whether the op and allocation checks of :func:`check_invariants` all pass, checked a column at a
    time (C-level ``map``, ``min``, ``max``); when not, the loops find the first contradiction."""
    rows = ops.rows
    ticks = list(map(itemgetter(0), rows))
    if ticks and not (ticks[0] > -1 and ticks[-1] < end_tick and all(map(lt, ticks, islice(ticks, 1, None)))):
        return False
    inputs = list(chain.from_iterable(map(itemgetter(6), rows)))
    if inputs and max(inputs) >= len(allocations):
        return False
    if not allocations:
        return True
    alloc_ticks = list(map(attrgetter("alloc_tick"), allocations))
    preexisting = list(map(attrgetter("preexisting"), allocations))
    if preexisting != list(map(eq, alloc_ticks, repeat(-1))) or max(alloc_ticks) >= end_tick:
        return False
    free_ticks = list(map(attrgetter("free_tick"), allocations))
    freed = list(map(is_not, free_ticks, repeat(None)))
    frees = list(compress(free_ticks, freed))
    return not frees or (max(frees) <= end_tick and all(map(lt, compress(alloc_ticks, freed), frees)))
