"""The doctor's machinery on hand-built traces (no torch program runs): the data-flow index, what a
finding needs to be reported, the rules' conditions where the trace decides, the JSON and the
terminal section, and a trace large enough that a quadratic scan would not finish."""

from __future__ import annotations

import pytest
from builder import TraceBuilder

from memtrim.analysis import Edits, analyze
from memtrim.doctor import diagnoses
from memtrim.doctor.diagnosis import MATERIAL, finding
from memtrim.report.json import diagnosis_json, summary
from memtrim.report.terminal import render
from memtrim.trace.model import Phase
from memtrim.units import format_change

MiB = 2**20


def _broadcast(b: TraceBuilder, *, reduce: str = "aten.sum.dim_IntList") -> dict[str, int]:
    """z [64, 12, 64] * W [12, 64, 768] -> product [64, 12, 64, 768] -> reduced [64, 12, 768]."""
    ids = {}
    b.op("aten.randn.default", line=1)
    ids["z"] = b.alloc(64 * 12 * 64 * 4, shape=(64, 12, 64))
    b.op("aten.randn.default", line=2)
    ids["W"] = b.alloc(12 * 64 * 768 * 4, shape=(12, 64, 768))
    b.op("aten.unsqueeze.default", line=3, inputs=(ids["z"],))
    b.op("aten.mul.Tensor", line=3, inputs=(ids["z"], ids["W"]))
    ids["product"] = b.alloc(64 * 12 * 64 * 768 * 4, shape=(64, 12, 64, 768))
    b.op(reduce, line=3, inputs=(ids["product"],))
    ids["reduced"] = b.alloc(64 * 12 * 768 * 4, shape=(64, 12, 768))
    b.free(ids["product"])
    return ids


def test_the_flow_index_gives_producers_outputs_and_readers() -> None:
    b = TraceBuilder()
    ids = _broadcast(b)
    flow = analyze(b.build()).flow
    assert flow.producer[ids["product"]] == 3 and flow.outputs[3] == (ids["product"],)
    assert flow.readers[ids["z"]] == (2, 3)  # the view, then the multiply
    assert flow.readers[ids["product"]] == (4,) and flow.outputs[2] == ()
    assert flow.names[3] == "mul" and flow.recorded
    assert flow.next_in(Phase.BACKWARD) == [5] * 5  # none: len(ops)


@pytest.mark.parametrize(
    ("op", "out"),
    [
        ("aten.mul.out", True),
        ("aten.softmax.int_out", True),
        ("aten.sum.IntList_out", True),
        ("aten.sort.values", True),
        ("aten.max.dim_max", True),
        ("aten.threshold_backward.grad_input", True),
        ("aten.mul.Tensor", False),
        ("aten.view.default", False),
        ("aten.mul_.Tensor", False),
        ("c10d.allreduce_.default", False),
    ],
)
def test_out_overloads_are_told_from_views(op: str, out: bool) -> None:
    from memtrim.analysis.flow import writes_out
    from memtrim.doctor.rules.common import is_view_like
    from memtrim.trace.model import OpRow

    assert writes_out(op) is out
    row = OpRow(0, op, Phase.FORWARD, None, None, None, (0, 1))
    assert is_view_like(row, ()) is (op in ("aten.mul.Tensor", "aten.view.default"))


def test_broadcast_then_reduce_on_a_hand_built_trace() -> None:
    b = TraceBuilder()
    ids = _broadcast(b)
    analysis = analyze(b.build())
    (d,) = diagnoses(analysis)
    assert d.rule == "broadcast-then-reduce" and d.site is not None and d.site.line == 3
    assert d.fix.startswith("torch.einsum('abc,bcd->abd', x, y)")
    assert [a.id for a in d.allocations] == [ids["product"]]
    assert d.peak_after == analysis.peak_without([analysis.allocations[ids["product"]]])


def test_a_product_read_by_something_besides_its_reduction_is_left_alone() -> None:
    b = TraceBuilder()
    ids = _broadcast(b)
    b.op("aten.exp.default", line=4, inputs=(ids["product"],))  # the product is needed
    b.alloc(MiB)
    assert diagnoses(analyze(b.build())) == ()


def test_max_of_a_product_is_not_an_einsum() -> None:
    b = TraceBuilder()
    _broadcast(b, reduce="aten.amax.default")
    assert diagnoses(analyze(b.build())) == ()


def test_finding_needs_a_material_saving_of_something_alive_at_the_peak() -> None:
    b = TraceBuilder()
    b.op("aten.empty.memory_format")
    big = b.alloc(100 * MiB)
    small = b.alloc(MiB // 2)  # alive at the peak, but half a percent of it
    b.free(big, small)
    b.op("aten.empty.memory_format")
    later = b.alloc(MiB)  # made after the peak
    b.op("aten.empty.memory_format")
    gpu = b.alloc(MiB, device="cuda:0")
    analysis = analyze(b.build())
    kw = dict(rule="r", site=None, problem="p", fix="f")
    assert finding(analysis, allocations=(), edits=Edits.removing([big]), **kw) is not None  # type: ignore[arg-type]
    assert MATERIAL * analysis.peak.bytes > MiB // 2
    assert finding(analysis, allocations=(), edits=Edits.removing([small]), **kw) is None  # type: ignore[arg-type]
    assert finding(analysis, allocations=(), edits=Edits.removing([later]), **kw) is None  # type: ignore[arg-type]
    assert finding(analysis, allocations=(), edits=Edits.removing([gpu]), **kw) is None  # type: ignore[arg-type]


def test_kept_output_needs_a_computed_unread_unsaved_result_alive_into_backward() -> None:
    b = TraceBuilder()
    b.op("aten.randn.default", phase=Phase.FORWARD, line=1)
    x = b.alloc(MiB)
    b.op("aten.mm.default", line=2, inputs=(x,))
    logits = b.alloc(8 * MiB)
    b.op("aten.mm.default", line=3, inputs=(x,))
    read_later = b.alloc(8 * MiB)
    b.op("aten.empty.memory_format", line=4)  # a factory's result: a parameter being built, say
    factory = b.alloc(8 * MiB)
    b.op("aten.ones_like.default", phase=Phase.BACKWARD, line=5, inputs=(logits,))
    b.op("aten.mul.Tensor", line=6, inputs=(read_later,))
    b.alloc(MiB)
    analysis = analyze(b.build())
    kept = [d for d in diagnoses(analysis) if d.rule == "kept-output"]
    assert (
        kept == []
    )  # logits is read by the first backward op; read_later in backward; factory made from nothing
    del factory

    b = TraceBuilder()
    b.op("aten.randn.default", phase=Phase.FORWARD, line=1)
    x = b.alloc(MiB)
    b.op("aten.mm.default", line=2, inputs=(x,))
    logits = b.alloc(8 * MiB)
    b.op("aten.log_softmax.int", line=3, inputs=(logits,))
    b.op("aten.mul.Tensor", phase=Phase.BACKWARD, line=5, inputs=(x,))
    b.alloc(4 * MiB)
    analysis = analyze(b.build())
    (d,) = [d for d in diagnoses(analysis) if d.rule == "kept-output"]
    assert d.site is not None and d.site.line == 2
    assert d.edits.free_at[logits] < analysis.log.ops.rows[3].tick  # freed before backward starts


def test_a_chain_stops_at_a_saved_result_and_at_a_later_read() -> None:
    def removed(*, saved_middle: bool = False, read_later: bool = False) -> list[list[int]]:
        b = TraceBuilder()
        b.op("aten.randn.default", phase=Phase.OTHER, line=1)
        x = b.alloc(4 * MiB, shape=(MiB,))
        b.op("aten.mul.Tensor", line=2, inputs=(x,))
        y = b.alloc(4 * MiB, shape=(MiB,), saved=saved_middle)
        b.op("aten.add.Tensor", line=3, inputs=(y,))
        z = b.alloc(4 * MiB, shape=(MiB,))
        if read_later:
            b.op("aten.sum.default", line=4, inputs=(x,))
            b.alloc(4)
        b.free(x, y, z)
        analysis = analyze(b.build())
        return [[a.id for a in d.allocations] for d in diagnoses(analysis) if d.rule == "out-of-place-chain"]

    assert removed() == [[1, 2]]  # x -> y -> z: y and z are written into x
    assert removed(saved_middle=True) == [[1]]  # y is saved: nothing may be written into it
    assert removed(read_later=True) == [[2]]  # x is read after y is made: y -> z only


def test_diagnosis_json_has_every_field_the_issue_lists() -> None:
    b = TraceBuilder()
    _broadcast(b)
    analysis = analyze(b.build())
    (d,) = diagnoses(analysis)
    data = diagnosis_json(d)
    for key in ("rule", "file", "line", "function", "module", "problem", "fix", "bytes_at_stake"):
        assert key in data
    assert data["peak_before"] == analysis.peak.bytes and data["peak_after"] < data["peak_before"]
    assert data["safe_because"] and data["verify_mode"] == "reference"
    assert data["bytes_at_stake"] == 64 * 12 * 64 * 768 * 4
    assert summary(analysis)["diagnoses"] == [data]


def test_the_terminal_section_is_a_few_lines_per_finding_and_its_code_runs_as_printed() -> None:
    b = TraceBuilder()
    _broadcast(b)
    analysis = analyze(b.build())
    text = render(analysis)
    lines = text[text.index("How to cut it (largest saving first):") :].splitlines()
    assert max(len(line) for line in lines) <= 100  # wrapped under each item's own indent
    section = lines[:1]
    for line in lines[1:]:
        if line.startswith(("  - ", "    write: ", "    peak after: ", "    keeps: ")):
            section.append(line)
        else:  # a continuation, indented under its item
            assert line.startswith("    ")
            section[-1] += "\n" + line
    assert len(section) == 5
    assert section[1].startswith("  - prog.py:3 in <module>: [64, 12, 64, 768] float32 broadcast product")
    assert section[2].startswith("    write: torch.einsum('abc,bcd->abd', x, y)")
    (d,) = diagnoses(analysis)
    assert section[3] == (
        f"    peak after: {format_change(d.peak_before, d.peak_after)} [broadcast-then-reduce]"
    )
    head, *code = section[4].split("\n")
    assert head == "    keeps: no less accurate than before; prove it:"
    assert len(code) == 3 and all(line.startswith("      ") for line in code)
    assert code[0].startswith("      # with original, rewrite, inputs: ")  # what the proof needs bound
    # the hint runs as printed, with the names it names bound to the program's code before and after
    import torch

    namespace = {
        "original": lambda x, y: (x[..., None] * y).sum(-2),
        "rewrite": lambda x, y: torch.einsum("abc,bcd->abd", x, y),
        "inputs": (torch.randn(2, 3, 4, requires_grad=True), torch.randn(3, 4, 5, requires_grad=True)),
    }
    exec("\n".join(line[6:] for line in code), namespace)


def test_a_large_trace_is_diagnosed_in_linear_passes() -> None:
    # 12,500 ops of one 5-op step: a scan over the ops per allocation would not finish here
    b = TraceBuilder()
    for step in range(2500):
        b.op("aten.randn.default", phase=Phase.FORWARD, line=1)
        x = b.alloc(4096, shape=(1024,))
        b.op("aten.mul.Tensor", line=2, inputs=(x,))
        y = b.alloc(4096, shape=(1024,))
        b.op("aten.add.Tensor", line=3, inputs=(y,))
        z = b.alloc(4096, shape=(1024,), saved=True)
        if step == 1250:  # the peak: x, y and z alive together, with a scratch buffer
            b.op("aten.empty.memory_format", line=5)
            b.free(b.alloc(16384))
        b.free(x, y)
        b.op("aten.mm.default", line=4, inputs=(z,))
        w = b.alloc(4096)
        b.op("aten.mul.Tensor", phase=Phase.BACKWARD, line=4, node="MmBackward0", inputs=(z, w))
        b.free(z, w)
    analysis = analyze(b.build())
    assert len(analysis.log.ops) == 12_501
    (d,) = diagnoses(analysis)
    # x comes from a factory under grad mode (it may be a leaf that requires grad): the chain is y -> z
    assert d.rule == "out-of-place-chain" and len(d.allocations) == 2500


def test_every_module_expression_runs_as_printed_and_names_its_module() -> None:
    """The expressions fixes print for a recorded module path resolve, with ``eval``, to that module of
    the object the user holds: attribute names, ModuleList indices, ModuleDict keys that are digits or
    not identifiers, keywords."""
    from torch import nn

    from memtrim.doctor.rules.common import module_expression

    model = nn.Module()
    model.layers = nn.ModuleList([nn.Sequential(nn.Linear(2, 2), nn.ReLU()) for _ in range(2)])
    model.heads = nn.ModuleDict({"0": nn.Linear(2, 2), "a-b": nn.Linear(2, 2), "lambda": nn.Linear(2, 2)})
    model.lm_head = nn.Linear(2, 3)
    for name, module in model.named_modules():
        expression = module_expression(f"Model.{name}" if name else "Model")
        assert expression is not None
        assert eval(expression, {"model": model}) is module, expression
        if name and module_expression(f"Model.{name}", "weight") is not None and hasattr(module, "weight"):
            weight = module_expression(f"Model.{name}", "weight")
            assert weight is not None and eval(weight, {"model": model}) is module.weight
    assert module_expression("Model.lm_head", "weight") == "model.lm_head.weight"
    assert module_expression("Model.layers.0") == "model.get_submodule('layers.0')"
