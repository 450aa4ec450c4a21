"""Tracking must not change the program, must survive its failures, and must nest."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from groundtruth import profiler_memory
from torch.utils._python_dispatch import _get_current_dispatch_mode

import memtrim
from memtrim.cases.heads import head_results, head_results_broadcast


def training_step(seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.Dropout(0.5), torch.nn.GELU(), torch.nn.Linear(32, 4)
    )
    out = model(torch.randn(8, 16))
    out.square().mean().backward()
    return out.detach(), [p.grad for p in model.parameters() if p.grad is not None]


def test_tracking_changes_neither_results_nor_rng_state() -> None:
    plain_out, plain_grads = training_step(3)
    plain_rng = torch.get_rng_state()
    with memtrim.track():
        tracked_out, tracked_grads = training_step(3)
    assert torch.equal(plain_out, tracked_out)
    assert all(torch.equal(a, b) for a, b in zip(plain_grads, tracked_grads, strict=True))
    assert torch.equal(plain_rng, torch.get_rng_state())


def test_no_tensor_is_kept_alive_by_the_trace() -> None:
    with memtrim.track() as trace:
        made = torch.randn(1000) * 2
        freed_later = weakref.ref(made)
    del made
    gc.collect()
    assert freed_later() is None
    assert trace.allocations  # the record survives, the tensor does not


def test_an_exception_keeps_the_trace_and_leaves_no_mode_installed() -> None:
    big = None
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"), memtrim.track() as trace:
        big = torch.ones(1000, 1000)
        torch.ones(3, 4) @ torch.ones(5, 6)
    assert _get_current_dispatch_mode() is None
    assert trace.finished and trace.error is not None and "shapes cannot be multiplied" in trace.error
    assert trace.failed_op is not None and trace.failed_op.op == "aten.mm.default"
    assert trace.peak_bytes == 4_000_000 + 12 * 4 + 30 * 4  # big and both operands, alive at the failure
    alive = [a for a in trace.allocations if a.free_tick is None and not a.preexisting]
    assert {a.bytes for a in alive} >= {4_000_000}
    report = trace.report()
    assert "stopped with RuntimeError" in report and "aten.mm.default" in report
    del big


def test_nested_tracks_both_see_the_inner_ops() -> None:
    x = torch.randn(100, 100)
    with memtrim.track() as outer:
        a = x * 2
        with memtrim.track() as inner:
            b = a @ a
            del b
        c = a + 1
        del a, c
    assert inner.peak_bytes == 40_000
    assert outer.peak_bytes == 80_000
    assert [al.op for al in outer.allocations if not al.preexisting] == [
        "aten.mul.Tensor",
        "aten.mm.default",
        "aten.add.Tensor",
    ]


def test_in_place_change_of_a_saved_tensor_still_raises() -> None:
    x = torch.randn(10, requires_grad=True)
    with memtrim.track():
        y = x.exp()
        z = (y * y).sum()
        y.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            z.backward()


def test_double_backward_works_under_tracking() -> None:
    x = torch.randn(5, requires_grad=True)
    (plain,) = torch.autograd.grad((x.exp() * x).sum(), x, create_graph=True)
    (plain2,) = torch.autograd.grad(plain.sum(), x)
    with memtrim.track() as trace:
        (g,) = torch.autograd.grad((x.exp() * x).sum(), x, create_graph=True)
        (g2,) = torch.autograd.grad(g.sum(), x)
    assert torch.equal(g, plain) and torch.equal(g2, plain2)
    assert any(op.phase == "backward" for op in trace.ops)


def test_tracking_works_where_saved_tensor_hooks_are_disabled() -> None:
    x = torch.randn(100, requires_grad=True)
    with torch.autograd.graph.disable_saved_tensors_hooks("no hooks here"), memtrim.track() as trace:
        (x.exp() * 2).sum().backward()
    assert trace.peak_bytes > 0


def _custom_backward_program(n: int) -> None:
    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx: torch.autograd.function.FunctionCtx, a: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(a)
            return a.exp()

        @staticmethod
        def backward(ctx: torch.autograd.function.FunctionCtx, g: torch.Tensor) -> torch.Tensor:
            (a,) = ctx.saved_tensors  # type: ignore[attr-defined]
            return g * a.exp() * 2

    a = torch.randn(n, n, requires_grad=True)
    w = torch.randn(n, n, requires_grad=True)
    (Fn.apply(a) @ w).relu().sum().backward()


def _heads_program(fn: object) -> None:
    z = torch.randn(32, 12, 16, requires_grad=True)
    W_O = torch.randn(12, 16, 64, requires_grad=True)
    fn(z, W_O).square().sum().backward()  # type: ignore[operator]


@pytest.mark.parametrize(
    "program",
    [
        lambda: _heads_program(head_results_broadcast),
        lambda: _heads_program(head_results),
        lambda: _custom_backward_program(64),
    ],
    ids=["heads-broadcast", "heads-einsum", "custom-backward"],
)
def test_fake_peak_equals_real_peak(program: object) -> None:
    with profiler_memory() as truth, memtrim.track() as real:
        program()  # type: ignore[operator]
    with memtrim.track(fake=True) as fake:
        program()  # type: ignore[operator]
    assert fake.fake and not real.fake
    assert real.peak_bytes == truth.peak
    assert fake.peak_bytes == real.peak_bytes
    assert [a.bytes for a in fake.largest_temporaries(5)] == [a.bytes for a in real.largest_temporaries(5)]


def test_fake_mode_measures_a_size_that_would_not_fit() -> None:
    with memtrim.track(fake=True) as trace:
        z = torch.randn(8192, 32, 128)
        W_O = torch.randn(32, 128, 4096)
        head_results_broadcast(z, W_O)
    assert trace.largest_temporaries(1)[0].bytes == 8192 * 32 * 128 * 4096 * 4  # 512 GiB, not allocated


def test_cuda_prediction_rounds_every_block_to_512_bytes() -> None:
    with memtrim.track(fake=True) as trace:
        a = torch.empty(1)  # 4 bytes: CUDA charges a 512-byte block
        b = torch.empty(1000)  # 4000 bytes: 4096 on CUDA
        del a, b
    assert trace.peak_bytes == 4004
    assert trace.peak_bytes_as("cuda") == 512 + 4096


def test_ops_on_a_thread_with_no_python_frames_are_recorded() -> None:
    # CUDA backward runs ops on autograd's device threads, where no Python frame calls them: a thread
    # started on a C function, which pushes the tracker and runs an op, has the same empty stack.
    import _thread
    import itertools
    import operator
    import threading

    from memtrim.capture.recorder import Recorder
    from memtrim.trace.model import TraceLog

    recorder = Recorder(TraceLog())
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    done = threading.Event()
    # map() is C code too: the product goes straight into sum and is freed when sum returns, on the
    # thread, before done.set() runs, so the assertions below do not depend on when the thread ends.
    steps = [
        (torch._C._push_on_torch_dispatch_stack, recorder),
        (list, map(torch.sum, map(torch.mm, [a], [b]))),
        (torch._C._pop_torch_dispatch_stack, None),
        (done.set,),
    ]
    _thread.start_new_thread(list, (itertools.starmap(operator.call, steps),))
    assert done.wait(10), "the op raised on the frameless thread"
    recorder.finish()
    trace = recorder.trace
    assert [(op.op, op.phase) for op in trace.ops] == [
        ("aten.mm.default", "backward"),
        ("aten.sum.default", "backward"),
    ]
    (made,) = [x for x in trace.allocations if x.op == "aten.mm.default"]
    assert made.bytes == 64 * 64 * 4 and made.site is None and made.free_tick is not None
