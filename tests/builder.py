"""Hand-built trace logs for unit tests of the analysis and report stages (no torch program runs).

``TraceBuilder`` appends rows exactly as the recorder does (one clock for ops, allocations and frees),
and the log is read through the same ``AllocationLog.materialize`` the recorder's logs go through.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from memtrim.trace.model import AllocationLog, AllocRow, Fact, FreeRow, OpLog, OpRow, Phase, Site, TraceLog


class TraceBuilder:
    def __init__(self) -> None:
        self.clock = itertools.count()
        self.ops = OpLog()
        self.recorded = AllocationLog()
        self.phase = Phase.FORWARD

    def op(
        self,
        name: str = "aten.mul.Tensor",
        *,
        phase: Phase | None = None,
        line: int | None = 1,
        file: str = "prog.py",
        function: str = "<module>",
        node: str | None = None,
        module: str | None = None,
        inputs: tuple[int, ...] = (),
    ) -> int:
        """Start an op (its number is returned) handed the allocations ``inputs``; allocations made
        next belong to it."""
        if phase is not None:
            self.phase = phase
        site = None if line is None else Site(file, line, function)
        self.ops.rows.append(OpRow(next(self.clock), name, self.phase, site, node, module, inputs))
        return len(self.ops.rows) - 1

    def alloc(
        self,
        nbytes: int,
        *,
        shape: tuple[int, ...] | None = None,
        dtype: str = "float32",
        device: str = "cpu",
        saved: bool = False,
        facts: Iterable[Fact] = (),
        preexisting: bool = False,
    ) -> int:
        """An allocation made by the latest op (or, ``preexisting``, one from before the region)."""
        if not preexisting and not self.ops.rows:
            self.op()
        seq = -1 if preexisting else len(self.ops.rows) - 1
        tick = -1 if preexisting else next(self.clock)
        rows = self.recorded.rows
        rows.append(AllocRow(seq, nbytes, dtype, shape or (nbytes // 4,), device, tick, None))
        index = len(rows) - 1
        if saved:
            self.recorded.saved.add(index)
        for fact in facts:
            self.recorded.add_fact(index, fact)
        return index

    def free(self, *ids: int) -> None:
        for index in ids:
            self.recorded.frees[index] = FreeRow(next(self.clock), self.phase)

    def build(self, **fields: object) -> TraceLog:
        log = TraceLog(ops=self.ops, end_tick=next(self.clock), **fields)  # type: ignore[arg-type]
        log.recorded = self.recorded
        log.finished = True
        return log
