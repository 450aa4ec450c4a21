"""The data flow of a trace, indexed once: which op made each allocation, which ops read it.

The recorder gives every op the allocation ids of the storages it was handed (``OpCall.inputs``, in
argument order: a view's reads count for the storage it views) and every allocation the op that made
it. Diagnosis rules follow these edges; building the index is one pass over the ops and one over the
allocations, so no rule needs to scan the trace per allocation.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import overload

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


OUT_OVERLOADS = frozenset({"out", "values", "grad_input", "dim_max", "dim_min", "dim_values", "output"})
"""aten's names for the ``out=`` overloads that are not ``out`` or ``*_out`` (``max.dim_max``,
``sort.values``, ``*_backward.grad_input``)."""


def writes_out(op: str) -> bool:
    """``aten.mul.out``, ``aten.softmax.int_out``, ``aten.sort.values``: an ``out=`` overload, which
    writes a tensor it was handed (recorded among its inputs) and makes no storage of its own."""
    overload = op.rsplit(".", 1)[-1] if op.count(".") >= 2 else ""
    return overload in OUT_OVERLOADS or overload.endswith("_out")


class Ragged(Sequence[tuple[int, ...]]):
    """Rows of ints of varying length, stored flat (``flat[start[i]:start[i + 1]]`` is row ``i``): a
    few long lists instead of one container per row, so indexing a large trace does not give the
    garbage collector hundreds of thousands of objects to walk."""

    __slots__ = ("flat", "start")

    def __init__(self, flat: list[int], start: list[int]) -> None:
        self.flat, self.start = flat, start

    @classmethod
    def of(cls, rows: Sequence[Sequence[int]]) -> Ragged:
        flat: list[int] = []
        start = [0]
        for row in rows:
            flat.extend(row)
            start.append(len(flat))
        return cls(flat, start)

    def __len__(self) -> int:
        return len(self.start) - 1

    @overload
    def __getitem__(self, index: int) -> tuple[int, ...]: ...
    @overload
    def __getitem__(self, index: slice) -> list[tuple[int, ...]]: ...
    def __getitem__(self, index: int | slice) -> tuple[int, ...] | list[tuple[int, ...]]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        start = self.start
        return tuple(self.flat[start[index] : start[index + 1]])

    def last(self, index: int) -> int | None:
        """The last number of row ``index``, or None when it is empty."""
        end = self.start[index + 1]
        return self.flat[end - 1] if end > self.start[index] else None


@dataclass(frozen=True)
class Flow:
    """Producer and readers of every allocation, by id; outputs of every op, by op number."""

    ops: Sequence[OpRow]
    op_ticks: list[int]
    producer: list[int]
    """Allocation id -> the number of the op that made it (-1: from before the region)."""
    outputs: Ragged
    """Op number -> the ids of the allocations it made (empty for views and in-place ops)."""
    readers: Ragged
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
        return self.readers.last(a.id)

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
    count = len(allocations)
    producer = [_NO_OP] * count
    made = [0] * (len(ops) + 1)  # allocations made per op, then offsets
    for a in allocations:
        if not a.preexisting:
            seq = bisect.bisect_right(op_ticks, a.alloc_tick) - 1
            if seq >= 0:
                producer[a.id] = seq
                made[seq + 1] += 1
    out_start = list(itertools.accumulate(made))
    out_flat = [0] * out_start[-1]
    fill = out_start[:-1]
    for ident, seq in enumerate(producer):  # ids ascending: each op's outputs in the order made
        if seq >= 0:
            out_flat[fill[seq]] = ident
            fill[seq] += 1
    # the readers: (allocation, op) pairs in op order, then a stable counting sort by allocation
    pairs_a: list[int] = []
    pairs_op: list[int] = []
    for seq, row in enumerate(ops):
        last = -1
        for ident in row.inputs:
            if ident != last and 0 <= ident < count:  # an op handed one storage twice reads it once
                pairs_a.append(ident)
                pairs_op.append(seq)
            last = ident
    read = [0] * (count + 1)
    for ident in pairs_a:
        read[ident + 1] += 1
    read_start = list(itertools.accumulate(read))
    read_flat = [0] * read_start[-1]
    fill = read_start[:-1]
    previous = [-1] * count
    for ident, seq in zip(pairs_a, pairs_op, strict=True):
        if previous[ident] != seq:  # one op handing the same storage twice, not adjacent
            read_flat[fill[ident]] = seq
            fill[ident] += 1
            previous[ident] = seq
    if fill != read_start[1:]:  # duplicates dropped: close the gaps
        rows = [read_flat[read_start[i] : fill[i]] for i in range(count)]
        readers = Ragged.of(rows)
    else:
        readers = Ragged(read_flat, read_start)
    return Flow(
        ops=ops,
        op_ticks=op_ticks,
        producer=producer,
        outputs=Ragged(out_flat, out_start),
        readers=readers,
        names=_base_names_of(ops),
    )


def _base_names_of(ops: Sequence[OpRow]) -> list[str]:
    # a long trace repeats a few hundred op names: each is cut once
    full = [row.op for row in ops]
    cut = {op: base_name(op) for op in set(full)}
    return list(map(cut.__getitem__, full))
