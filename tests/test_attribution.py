"""Which op, phase, autograd node and source line each allocation is attributed to."""

from __future__ import annotations

import inspect

import pytest
import torch
from groundtruth import profiler_memory
from programs import ScaledDifference

import memtrim
from memtrim.cases.heads import head_results, head_results_broadcast

GPT2 = {"tokens": 512, "heads": 12, "d_head": 64, "d_model": 768}


def line_of(fn: object, text: str) -> int:
    """The line number of the first line of ``fn``'s source containing ``text``."""
    lines, start = inspect.getsourcelines(fn)  # type: ignore[arg-type]
    return start + next(i for i, line in enumerate(lines) if text in line)


def test_broadcast_temporary_is_attributed_to_the_multiply_line_at_gpt2_size() -> None:
    z = torch.randn(GPT2["tokens"], GPT2["heads"], GPT2["d_head"])
    W_O = torch.randn(GPT2["heads"], GPT2["d_head"], GPT2["d_model"])
    with profiler_memory() as truth, memtrim.track() as trace:
        result = head_results_broadcast(z, W_O)
    biggest = trace.largest_temporaries(1)[0]
    assert biggest.bytes == 1_207_959_552 == max(truth.allocated_sizes)
    assert biggest.op == "aten.mul.Tensor"
    assert biggest.phase == "forward"
    assert biggest.file == inspect.getsourcefile(head_results_broadcast)
    assert biggest.line == line_of(head_results_broadcast, "z[..., None] * W_O")
    assert result.nbytes == 18_874_368
    assert trace.peak_bytes == truth.peak == 1_207_959_552 + 18_874_368


def test_einsum_has_no_temporary_above_twice_the_result_at_gpt2_size() -> None:
    z = torch.randn(GPT2["tokens"], GPT2["heads"], GPT2["d_head"])
    W_O = torch.randn(GPT2["heads"], GPT2["d_head"], GPT2["d_model"])
    with profiler_memory() as truth, memtrim.track() as trace:
        head_results(z, W_O)
    assert max(truth.allocated_sizes) <= 2 * 18_874_368
    assert all(t.bytes <= 2 * 18_874_368 for t in trace.largest_temporaries(10))
    assert trace.peak_bytes == truth.peak


def test_backward_temporaries_of_the_broadcast_point_at_the_forward_line() -> None:
    z = torch.randn(64, 12, 64, requires_grad=True)
    W_O = torch.randn(12, 64, 768, requires_grad=True)
    with memtrim.track() as trace:
        head_results_broadcast(z, W_O).sum().backward()
    product = 64 * 12 * 64 * 768 * 4
    backward_temps = [
        t for t in trace.largest_temporaries(10) if t.phase == "backward" and t.bytes == product
    ]
    assert len(backward_temps) == 2  # grad_out * W_O and grad_out * z, both broadcast-sized
    multiply_line = line_of(head_results_broadcast, "z[..., None] * W_O")
    for t in backward_temps:
        assert t.node == "MulBackward0"
        assert (t.file, t.line) == (inspect.getsourcefile(head_results_broadcast), multiply_line)
        assert t.call_site is not None and t.call_site.line != multiply_line  # the .backward() call


def test_custom_backward_temporaries_are_attributed_to_their_own_lines() -> None:
    x = torch.randn(256, 1024, requires_grad=True)
    d = torch.randn(256, 1024)
    with profiler_memory() as truth, memtrim.track() as trace:
        ScaledDifference.apply(x, d).sum().backward()
    in_backward = [
        a for a in trace.allocations if a.function == "backward" and a.node == "ScaledDifferenceBackward"
    ]
    lines = {a.line: a for a in in_backward}
    for text in ("a = g - d", "b = s * a", "c = b * 3.0"):
        alloc = lines[line_of(ScaledDifference.backward, text)]
        assert alloc.bytes == 256 * 1024 * 4
        assert alloc.phase == "backward"
    assert trace.category(lines[line_of(ScaledDifference.backward, "a = g - d")]) == "temporary"
    assert trace.category(lines[line_of(ScaledDifference.backward, "c = b * 3.0")]) == "gradient"
    assert trace.peak_bytes == truth.peak


def test_module_path_names_the_submodule() -> None:
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(16, 4))
    )
    with memtrim.track() as trace:
        model(torch.randn(2, 8)).sum().backward()
    made = {a.module for a in trace.allocations if not a.preexisting}
    assert "Sequential.0" in made and "Sequential.1.1" in made
    relu_grad = [a for a in trace.allocations if a.node == "ReluBackward0"]
    assert relu_grad and all(a.module == "Sequential.1.0" for a in relu_grad)


def test_categories_saved_gradient_output_temporary() -> None:
    x = torch.randn(1000, requires_grad=True)
    with memtrim.track() as trace:
        y = x.exp()  # saved by ExpBackward0 (its output), freed in backward
        t = y * y  # saved by MulBackward0, freed in backward
        out = t.sum()
        out.backward()
        kept = y.detach() + 1  # alive at the end
    by_line = {a.line: trace.category(a) for a in trace.allocations if not a.preexisting and a.bytes == 4000}
    categories = sorted(by_line.values())
    assert "output" in categories and "gradient" in categories
    # autograd saved y, so it is an activation ("saved") even though the user also still holds it
    assert [trace.category(a) for a in trace.allocations if a.op == "aten.exp.default"] == ["saved"]
    assert [
        trace.category(a) for a in trace.allocations if a.op == "aten.add.Tensor" and a.phase == "forward"
    ] == ["output"]
    del kept, y, t
    x.grad = None  # otherwise backward accumulates in place into the existing .grad
    with memtrim.track() as trace:
        loss = (x.exp() * 2).sum()
        loss.backward()
    exp_alloc = next(a for a in trace.allocations if a.op == "aten.exp.default")
    assert exp_alloc.saved and trace.category(exp_alloc) == "saved" and exp_alloc.free_phase == "backward"
    assert any(trace.category(a) == "temporary" and a.phase == "backward" for a in trace.allocations)
    assert any(trace.category(a) == "gradient" for a in trace.allocations)


class DrawsNoise(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        noise = torch.rand(x.shape)  # grad mode is off in here, and rand has no tensor inputs
        return x + noise

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, g: torch.Tensor) -> torch.Tensor:
        return g


def test_phases_forward_inside_custom_functions_optimizer_and_other_under_no_grad() -> None:
    x = torch.randn(100, requires_grad=True)
    opt = torch.optim.SGD([x], lr=0.1, momentum=0.9)
    with memtrim.track() as trace:
        DrawsNoise.apply(x).sum().backward()
        opt.step()
        with torch.no_grad():
            evaluation = x * 2
    phases = {a.op: a.phase for a in trace.allocations if not a.preexisting}
    assert phases["aten.rand.default"] == "forward"
    assert phases["aten.clone.default"] == "optimizer"  # SGD's momentum buffer
    assert [a.phase for a in trace.allocations if a.op == "aten.mul.Tensor"] == ["other"]
    del evaluation


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return self.norm(h) * 2


def test_ops_inside_torch_modules_point_at_the_user_line_that_called_them() -> None:
    block = Block()
    with memtrim.track() as trace:
        block(torch.randn(4, 8)).sum().backward()
    by_op = {(a.op, a.phase): a for a in trace.allocations if not a.preexisting}
    assert by_op[("aten.addmm.default", "forward")].line == line_of(Block.forward, "h = self.proj(x)")
    assert by_op[("aten.gelu.default", "forward")].line == line_of(Block.forward, "h = self.proj(x)")
    assert by_op[("aten.native_layer_norm.default", "forward")].line == line_of(
        Block.forward, "self.norm(h) * 2"
    )
    assert by_op[("aten.native_layer_norm.default", "forward")].module == "Block.norm"
    assert by_op[("aten.gelu_backward.default", "backward")].line == line_of(
        Block.forward, "h = self.proj(x)"
    )
    # an op in the user's own forward, after a submodule returned, is the block's, not the submodule's
    assert by_op[("aten.mul.Tensor", "forward")].module == "Block"


class TracksInside(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(8, 8)
        self.traces: list[memtrim.Trace] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with memtrim.track() as trace:
            y = self.inner(x).relu()
        self.traces.append(trace)
        return y


def test_module_path_of_a_region_opened_inside_a_forward() -> None:
    outer = torch.nn.Sequential(torch.nn.Identity(), TracksInside())
    outer(torch.randn(2, 8))
    (trace,) = outer[1].traces
    modules = {a.op: a.module for a in trace.allocations if not a.preexisting}
    assert modules == {"aten.addmm.default": "Sequential.1.inner", "aten.relu.default": "Sequential.1"}


def test_module_path_with_the_users_own_module_hooks() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    seen: list[str] = []
    handle = model[0].register_forward_hook(lambda m, args, out: seen.append(type(m).__name__))
    x = torch.randn(2, 8)
    try:
        with memtrim.track() as trace:
            model(x)
    finally:
        handle.remove()
    assert seen == ["Linear"]
    modules = {a.op: a.module for a in trace.allocations if not a.preexisting}
    assert modules == {"aten.addmm.default": "Sequential.0", "aten.relu.default": "Sequential.1"}


def test_a_shared_module_keeps_the_path_it_was_first_seen_with() -> None:
    act = torch.nn.Tanh()
    first, second = torch.nn.Sequential(act), torch.nn.Sequential(torch.nn.Identity(), act)
    with memtrim.track() as trace:
        first(torch.randn(4))
        second(torch.randn(4))
    assert [a.module for a in trace.allocations if a.op == "aten.tanh.default"] == ["Sequential.0"] * 2


def test_saved_is_read_from_the_autograd_nodes() -> None:
    x = torch.randn(1000, requires_grad=True)
    with memtrim.track() as trace:
        loss = (x.exp() * 2).sum()
        loss.backward()
    exp_alloc = next(a for a in trace.allocations if a.op == "aten.exp.default")
    assert trace.category(exp_alloc) == "saved" and exp_alloc.free_phase == "backward"
    mul_alloc = next(a for a in trace.allocations if a.op == "aten.mul.Tensor" and a.phase == "forward")
    assert not mul_alloc.saved  # (exp * 2).sum() saves nothing of the product
    made_in_backward = [a for a in trace.allocations if a.phase == "backward"]
    assert made_in_backward and not any(a.saved for a in made_in_backward)


def test_saved_is_known_before_backward_runs() -> None:
    # what a user needs after an out-of-memory error in forward: what autograd was holding
    x = torch.randn(1000, requires_grad=True)
    with pytest.raises(RuntimeError, match="boom"), memtrim.track() as trace:
        h = x.sigmoid()  # saves its result
        g = h.tanh()  # saves its result
        dropped = g.exp()  # saves its result, but the graph that holds it is dropped at once
        del dropped
        raise RuntimeError("boom")
    saved = {a.op for a in trace.allocations if a.saved}
    assert saved == {"aten.sigmoid.default", "aten.tanh.default"}
    assert h.grad_fn is not None and g.grad_fn is not None


class _SavesInputAndIntermediate(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, a: torch.Tensor) -> torch.Tensor:
        b = a.exp()  # saved, never returned
        c = a.sin()  # neither saved nor returned
        ctx.save_for_backward(a, b)
        return b * c

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, g: torch.Tensor) -> torch.Tensor:
        _, b = ctx.saved_tensors  # type: ignore[attr-defined]
        return g * b


def test_saved_by_a_custom_function() -> None:
    a = torch.randn(1000, requires_grad=True)
    with memtrim.track() as trace:
        # the input is made in the region (neg saves nothing), so that saving it is visible
        _SavesInputAndIntermediate.apply(a.neg()).sum().backward()
    by_op = {x.op: x for x in trace.allocations if x.phase == "forward" and not x.preexisting}
    assert by_op["aten.neg.default"].saved
    assert by_op["aten.exp.default"].saved
    assert not by_op["aten.sin.default"].saved
    assert not by_op["aten.mul.Tensor"].saved  # the Function's output


def test_user_saved_tensor_hooks_are_not_run_by_memtrim() -> None:
    def run() -> list[dict[str, int]]:
        calls = {"pack": 0, "unpack": 0}

        def pack(t: torch.Tensor) -> torch.Tensor:
            calls["pack"] += 1
            return t

        def unpack(t: torch.Tensor) -> torch.Tensor:
            calls["unpack"] += 1
            return t

        x = torch.randn(1000, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            loss = x.exp().sin().sum()
        after_forward = dict(calls)
        loss.backward()
        return [after_forward, calls]

    untracked = run()
    with memtrim.track() as trace:
        tracked = run()
    assert tracked == untracked and untracked[0]["unpack"] == 0 and untracked[1]["unpack"] > 0
    # the nodes were not read; lifetime says what was saved
    exp_alloc = next(a for a in trace.allocations if a.op == "aten.exp.default")
    assert exp_alloc.saved and exp_alloc.free_phase == "backward"


def test_checkpointed_region_is_recomputed_only_by_backward() -> None:
    from torch.utils.checkpoint import checkpoint

    runs = []

    def block(t: torch.Tensor) -> torch.Tensor:
        runs.append(1)
        return t.exp().sin()

    x = torch.randn(1000, requires_grad=True)
    with memtrim.track() as trace:
        y = checkpoint(block, x, use_reentrant=False)
        assert len(runs) == 1
        y.sum().backward()
    assert len(runs) == 2
    forward_made = [a for a in trace.allocations if a.phase == "forward" and not a.preexisting]
    assert forward_made and not any(a.saved for a in forward_made if a.free_phase == "forward")


class _ReturnsAView(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, a: torch.Tensor) -> torch.Tensor:
        b = a.exp()
        ctx.save_for_backward(b)
        return (b * 2).view(-1)  # the last op, whose output gets the Function's node, is a view

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, g: torch.Tensor) -> torch.Tensor:
        (b,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return (g * 2).view_as(b) * b


def test_saved_by_a_custom_function_that_returns_a_view() -> None:
    a = torch.randn(10, 100, requires_grad=True)
    with memtrim.track() as trace:
        _ReturnsAView.apply(a).sum().backward()
    exp_alloc = next(x for x in trace.allocations if x.op == "aten.exp.default")
    assert exp_alloc.saved
