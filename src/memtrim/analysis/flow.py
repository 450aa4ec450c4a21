"""The data flow of a trace, indexed once: which op made each allocation, which ops read it.

The recorder gives every op the allocation ids of the storages it was handed (``OpCall.inputs``, in
argument order: a view's reads count for the storage it views) and every allocation the op that made
it. Diagnosis rules follow these edges; building the index is one pass over the ops and one over the
allocations, so no rule needs to scan the trace per allocation.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

from memtrim.trace.model import Allocation, OpRow, Phase, TraceLog

_NO_OP = -1


_base_names: dict[str, str] = {}


def base_name(op: str) -> str:
    """``aten.mul_.Tensor`` -> ``mul_``: the op without its namespace and overload."""
    name = _base_names.get(op)
    if name is None:
        parts = op.split(".")
        name = _base_names[op] = parts[1] if len(parts) > 2 else parts[-1]
    return name


def writes_in_place(op: str) -> bool:
    """``aten.mul_.Tensor``, ``aten.zero_.default``: an op that writes its first argument."""
    name = base_name(op)
    return name.endswith("_") and not name.startswith("_")


@dataclass(frozen=True)
class Flow:
    """Producer and readers of every allocation, by id; outputs of every op, by op number."""

    ops: Sequence[OpRow]
    op_ticks: list[int]
    producer: list[int]
    """Allocation id -> the number of the op that made it (-1: from before the region)."""
    outputs: list[tuple[int, ...]]
    """Op number -> the ids of the allocations it made (empty for views and in-place ops)."""
    readers: list[tuple[int, ...]]
    """Allocation id -> the numbers of the ops that were handed it, ascending."""
    names: list[str]
    """Op number -> its base name (``mul`` for ``aten.mul.Tensor``)."""
    _next: dict[Phase, list[int]] = field(default_factory=dict, repr=False, compare=False)

    def next_in(self, phase: Phase) -> list[int]:
        """For each op number, the number of the first op of ``phase`` after it (``len(ops)``: none)."""
        found = self._next.get(phase)
        if found is None:
            ops = self.ops
            found = [len(ops)] * len(ops)
            upcoming = len(ops)
            for seq in range(len(ops) - 1, -1, -1):
                found[seq] = upcoming
                if ops[seq].phase is phase:
                    upcoming = seq
            self._next[phase] = found
        return found

    @property
    def recorded(self) -> bool:
        """Whether the trace holds the data flow (traces of schema memtrim.trace/1 have no op inputs)."""
        return any(row.inputs for row in self.ops)

    def op_at(self, tick: float) -> int:
        """The number of the last op started at or before ``tick`` (-1 before the first)."""
        return bisect.bisect_right(self.op_ticks, tick) - 1

    def made_by(self, a: Allocation) -> OpRow | None:
        seq = self.producer[a.id]
        return self.ops[seq] if seq >= 0 else None

    def inputs_of(self, a: Allocation) -> tuple[int, ...]:
        """The allocation ids the op that made ``a`` was handed."""
        row = self.made_by(a)
        return row.inputs if row is not None else ()

    def readers_of(self, a: Allocation) -> tuple[int, ...]:
        return self.readers[a.id]

    def last_read(self, a: Allocation) -> int | None:
        """The number of the last op handed ``a``, if any."""
        readers = self.readers[a.id]
        return readers[-1] if readers else None

    def read_in(self, a: Allocation, phase: Phase) -> bool:
        ops = self.ops
        return any(ops[seq].phase is phase for seq in self.readers[a.id])

    def reads_after(self, a: Allocation, tick: float) -> list[int]:
        """The ops handed ``a`` that started after ``tick``."""
        readers, ticks = self.readers[a.id], self.op_ticks
        i = bisect.bisect_right(readers, tick, key=lambda seq: ticks[seq])
        return list(readers[i:])


def build_flow(log: TraceLog) -> Flow:
    ops = log.ops.rows
    op_ticks = [row.tick for row in ops]
    allocations = log.allocations
    producer = [_NO_OP] * len(allocations)
    outputs: list[list[int]] = [[] for _ in ops]
    for a in allocations:
        if a.preexisting:
            continue
        seq = bisect.bisect_right(op_ticks, a.alloc_tick) - 1
        if seq >= 0:
            producer[a.id] = seq
            outputs[seq].append(a.id)
    readers: list[list[int]] = [[] for _ in allocations]
    count = len(allocations)
    for seq, row in enumerate(ops):
        last = -1
        for ident in row.inputs:
            if ident != last and 0 <= ident < count:  # an op handed one storage twice reads it once
                got = readers[ident]
                if not got or got[-1] != seq:
                    got.append(seq)
            last = ident
    return Flow(
        ops=ops,
        op_ticks=op_ticks,
        producer=producer,
        outputs=[tuple(o) for o in outputs],
        readers=[tuple(r) for r in readers],
        names=[base_name(row.op) for row in ops],
    )
