"""A committed memtrim.trace/1 file (tests/data/golden.trace1.json, recorded from
tests/data/golden_program.py by the first schema's writer) still loads, with every figure the program's
own tensor sizes fix, and reports as pinned in tests/data/golden.trace1.report.txt."""

from __future__ import annotations

import json
from pathlib import Path

import memtrim
from memtrim.trace.model import Phase

DATA = Path(__file__).parent / "data"
GOLDEN = DATA / "golden.trace1.json"
F32 = 4


def test_the_first_schema_still_loads() -> None:
    assert json.loads(GOLDEN.read_text())["schema"] == "memtrim.trace/1"
    trace = memtrim.load(str(GOLDEN))
    sizes = {(a.op, a.shape, a.phase): a.bytes for a in trace.allocations}
    # the program's tensors: x [64, 32] from before the region, w [16, 32, 8], the broadcast product
    # [64, 16, 32, 8] and its reduction [64, 16, 8]; backward remakes the product once
    assert sizes[("(before the region)", (64, 32), Phase.OTHER)] == 64 * 32 * F32
    assert sizes[("aten.ones.default", (16, 32, 8), Phase.FORWARD)] == 16 * 32 * 8 * F32
    assert sizes[("aten.mul.Tensor", (64, 16, 32, 8), Phase.FORWARD)] == 64 * 16 * 32 * 8 * F32
    assert sizes[("aten.mul.Tensor", (64, 16, 32, 8), Phase.BACKWARD)] == 64 * 16 * 32 * 8 * F32
    assert sizes[("aten.sum.dim_IntList", (64, 16, 8), Phase.FORWARD)] == 64 * 16 * 8 * F32
    (x,) = [a for a in trace.allocations if a.preexisting]
    assert trace.role(x) == "input" and x.facts == frozenset()
    # the custom Function saved its input (pre-region, so not counted) and the broadcast saved w's copy
    assert [a.op for a in trace.allocations if a.saved] == ["aten.ones.default"]


def test_the_first_schema_reports_as_pinned() -> None:
    trace = memtrim.load(str(GOLDEN))
    assert trace.report(top=5) + "\n" == (DATA / "golden.trace1.report.txt").read_text()


def test_a_loaded_first_schema_trace_saves_as_the_current_schema(tmp_path: Path) -> None:
    trace = memtrim.load(str(GOLDEN))
    path = tmp_path / "again.json"
    trace.save(str(path))
    assert json.loads(path.read_text())["schema"] == "memtrim.trace/3"
    again = memtrim.load(str(path))
    assert again.report() == trace.report() and again.allocations == trace.allocations
