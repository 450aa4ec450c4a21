"""The per-rank report (memtrim show on several rank traces) on hand-built traces: a column per rank
when the ranks fit in 100 columns, a row per rank with the largest roles that fit when they do not."""

from __future__ import annotations

from builder import TraceBuilder

from memtrim.analysis import analyze
from memtrim.report.ranks import render
from memtrim.trace.model import Phase
from memtrim.units import format_bytes


def _rank(rank: int, activation: int, temporary: int) -> object:
    b = TraceBuilder()
    b.op("aten.mm.default", phase=Phase.FORWARD)
    saved = b.alloc(activation, saved=True)
    b.op("aten.mul.Tensor", phase=Phase.BACKWARD)
    tmp = b.alloc(temporary)
    b.free(tmp, saved)
    return analyze(b.build(metadata={"distributed": {"rank": rank, "world_size": 0}}))


def test_few_ranks_get_a_column_each_in_rank_order() -> None:
    analyses = [_rank(1, 4096, 8192), _rank(0, 4096, 1024)]
    lines = render(analyses).splitlines()  # type: ignore[arg-type]
    assert lines[1].split() == ["rank", "0", "rank", "1"]
    assert lines[2].split() == ["peak", *format_bytes(5120).split(), *format_bytes(12288).split()]
    assert lines[3].split() == ["phase", "backward", "backward"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[4:6]}
    assert rows == {"temporary": ["1", "KiB", "8", "KiB"], "activation": ["4", "KiB", "4", "KiB"]}
    assert "  temporary: 1 KiB to 8 KiB (most on rank 1)" in lines
    assert "Rank 1 peaks highest; its report:" in lines


def test_many_ranks_get_a_row_each_and_fit_the_width() -> None:
    analyses = [_rank(r, 4096 * (r + 1), 1024 * (16 - r)) for r in range(16)]
    lines = render(analyses).splitlines()  # type: ignore[arg-type]
    assert lines[1].split()[:3] == ["rank", "peak", "phase"]
    assert [line.split()[0] for line in lines[2:18]] == [str(r) for r in range(16)]
    assert max(len(line) for line in lines[:18]) <= 100
    assert "Rank 15 peaks highest; its report:" in lines
