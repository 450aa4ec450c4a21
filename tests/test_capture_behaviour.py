"""A tracked program behaves as it would untracked: Ctrl-C, forks and DataLoader workers, saved-tensor
pack hooks; and the one change memtrim cannot avoid (gradient sums go out of place), measured."""

from __future__ import annotations

import _thread
import contextlib
import itertools
import json
import operator
import os
import signal

import pytest
import torch
from groundtruth import memtrim_deltas, profiler_memory
from torch.utils._python_dispatch import TorchDispatchMode

import memtrim
from memtrim.capture import recorded_here


def test_ctrl_c_during_a_free_is_raised_every_time() -> None:
    # A SIGINT pending when a watched storage is freed: _thread.interrupt_main trips the interpreter's
    # signal flag as the real signal's C handler does, and the free runs from C (list.clear via
    # starmap), so the next Python code to run is whatever the free calls. That used to be memtrim's
    # weakref callback, where the KeyboardInterrupt was printed as "Exception ignored" and lost.
    raised = 0
    # Python's own SIGINT handler, whatever this process inherited: a run started in the background by a
    # shell without job control inherits SIGINT ignored, and interrupt_main then does nothing
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    with contextlib.ExitStack() as restore, memtrim.track() as trace:
        restore.callback(signal.signal, signal.SIGINT, previous)
        for _ in range(50):
            holder = [torch.ones(1000) * 2]  # made in the region: memtrim watches its free
            try:
                list(itertools.starmap(operator.call, [(_thread.interrupt_main,), (holder.clear,)]))
            except KeyboardInterrupt:
                raised += 1
    assert raised == 50
    products = [a for a in trace.allocations if a.op == "aten.mul.Tensor"]
    assert len(products) == 50 and all(a.free_tick is not None for a in products)  # no free lost


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_stops_recording_and_does_not_own_the_trace() -> None:
    # (small tensors: a forked child must not use the parent's OpenMP threads, tracked or not)
    x = torch.randn(64, 64)
    read, write = os.pipe()
    with memtrim.track() as trace:
        y = x * 2
        pid = os.fork()
        if pid == 0:
            ops_at_fork = len(trace.ops)
            z = x + 1  # runs untracked
            stack_in_region = torch._C._len_torch_dispatch_stack()
    # both processes leave the region here
    if pid == 0:
        try:
            report = {
                "stack": [stack_in_region, torch._C._len_torch_dispatch_stack()],
                "new ops": len(trace.ops) - ops_at_fork,
                "recorded here": recorded_here(trace.log),
                "wrappers given back": not hasattr(torch.get_rng_state, "__wrapped__"),
                "z": float(z.sum()),
            }
            os.write(write, json.dumps(report).encode())
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    child = json.loads(os.read(read, 10_000))
    os.close(read)
    os.close(write)
    assert status == 0
    assert child == {
        "stack": [0, 0],
        "new ops": 0,
        "recorded here": False,
        "wrappers given back": True,
        "z": pytest.approx(float((x + 1).sum())),
    }
    assert recorded_here(trace.log) and trace.finished
    assert [op.op for op in trace.ops] == ["aten.mul.Tensor"]
    assert trace.peak_bytes == y.numel() * y.element_size()


class _DispatchDepth(torch.utils.data.Dataset[torch.Tensor]):
    """Each item is the number of dispatch modes active where it is loaded."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([torch._C._len_torch_dispatch_stack(), i])


def test_forked_dataloader_workers_run_without_the_recorder() -> None:
    loader = torch.utils.data.DataLoader(
        _DispatchDepth(), batch_size=2, num_workers=2, multiprocessing_context="fork"
    )
    with memtrim.track() as trace:
        loaded = list(loader)
        in_region = torch._C._len_torch_dispatch_stack()
    assert in_region == 1  # the recorder, in this process
    assert sorted(int(i) for batch in loaded for i in batch[:, 1]) == [0, 1, 2, 3]
    assert [int(depth) for batch in loaded for depth in batch[:, 0]] == [0, 0, 0, 0]
    assert not [op for op in trace.ops if op.op == "aten.lift_fresh.default"]  # the workers' torch.tensor


def test_what_a_pack_hook_makes_is_saved() -> None:
    x = torch.randn(1000, requires_grad=True)
    packed: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        copy = t.clone()  # what an offloading or compressing hook makes
        packed.append(copy.untyped_storage().nbytes())
        return copy

    with profiler_memory() as truth, memtrim.track() as trace:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = x.exp().sin().sum()
        loss.backward()
    clones = [a for a in trace.allocations if a.op == "aten.clone.default"]
    assert sorted(a.bytes for a in clones) == sorted(packed) == [4000, 4000]
    assert [trace.category(a) for a in clones] == ["saved", "saved"]
    assert all(a.phase == "forward" and a.free_phase == "backward" for a in clones)
    assert memtrim_deltas(trace) == truth.deltas and trace.peak_bytes == truth.peak


class _Empty(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


def test_a_gradient_summed_from_two_uses_costs_one_buffer_more_under_any_dispatch_mode() -> None:
    # The limit memtrim states (README, Limits): with any dispatch mode active, autograd sums the
    # gradients of a tensor used twice out of place (InputBuffer::accumulate asks isTensorSubclassLike,
    # true under every mode), where it sums in place untracked. memtrim's figures are the tracked
    # program's, which the profiler confirms in the same run.
    x = torch.randn(1 << 16, requires_grad=True)

    def step() -> None:
        y = x.exp()
        ((y * 2).sum() + (y * 3).sum()).backward()  # y's gradient is the sum of two, at the peak
        x.grad = None

    step()
    with profiler_memory() as untracked:
        step()
    with profiler_memory() as empty_mode, _Empty():
        step()
    with profiler_memory() as tracked, memtrim.track() as trace:
        step()
    one_gradient = x.numel() * x.element_size()
    assert empty_mode.peak == tracked.peak == untracked.peak + one_gradient
    assert trace.peak_bytes == tracked.peak
    assert memtrim_deltas(trace) == tracked.deltas
