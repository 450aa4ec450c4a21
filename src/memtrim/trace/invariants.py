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
