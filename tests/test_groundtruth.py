"""memtrim's live-bytes curve against torch.profiler's CPU allocation events, in the same run."""

from __future__ import annotations

from collections.abc import Callable

import torch
from groundtruth import memtrim_deltas, profiler_memory
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import memtrim
import memtrim.analysis


def measure(program: Callable[[], object]) -> tuple[memtrim.Trace, object]:
    with profiler_memory() as truth, memtrim.track() as trace:
        program()
    return trace, truth


def assert_agrees(program: Callable[[], object]) -> memtrim.Trace:
    trace, truth = measure(program)
    assert memtrim_deltas(trace) == truth.deltas  # type: ignore[attr-defined]
    assert trace.peak_bytes == truth.peak  # type: ignore[attr-defined]
    return trace


def test_views_allocate_nothing_and_share_the_storage() -> None:
    x = torch.randn(64, 32)

    def program() -> None:
        y = x * 2
        v = y.t()[1:, :].unsqueeze(0).expand(3, -1, -1)
        w = v.reshape(3, -1) if v.is_contiguous() else v.sum(0)
        del y, v, w

    trace = assert_agrees(program)
    made = [a for a in trace.allocations if not a.preexisting]
    assert [a.op for a in made] == ["aten.mul.Tensor", "aten.sum.dim_IntList"]


def test_in_place_ops_allocate_nothing() -> None:
    x = torch.randn(1000)

    def program() -> None:
        y = x.clone()
        y.mul_(3).add_(x).relu_()
        y.exp_()

    trace = assert_agrees(program)
    assert [a.bytes for a in trace.allocations if not a.preexisting] == [4000]


def test_resize_counts_the_new_block_and_frees_the_old() -> None:
    def program() -> None:
        y = torch.empty(10)
        y.resize_(1000)
        torch.add(torch.ones(2000), 1, out=y.resize_(0))  # out= resizes too
        del y

    trace = assert_agrees(program)
    assert sorted(a.bytes for a in trace.allocations) == [40, 4000, 8000, 8000]


def test_free_of_a_tensor_from_before_the_region_lowers_the_curve() -> None:
    # The profiler drops frees of blocks allocated before it started, so the old tensor is made
    # inside the profiled block but before the tracked region.
    with profiler_memory() as truth:
        held = [torch.randn(256, 256)]
        with memtrim.track() as trace:
            y = held[0] + 1  # the region sees the old tensor as an input, then drops it
            held.clear()
            z = y * 2
            del z, y
    assert truth.deltas[0] == 256 * 256 * 4  # the old tensor, before the region
    assert memtrim_deltas(trace) == truth.deltas[1:]
    assert trace.peak_bytes == 256 * 256 * 4  # y and z never coexist with the old tensor
    assert trace.analysis.curve("cpu").live[-1] == -256 * 256 * 4  # below the start


def test_training_step_with_backward_and_optimizer() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8)
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(16, 32)

    def program() -> None:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

    trace = assert_agrees(program)
    assert {op.phase for op in trace.ops} == {"forward", "backward", "optimizer"}


# -- random programs -----------------------------------------------------------------------------

UNARY = ["relu", "exp", "neg", "sin", "clone", "t", "unsqueeze", "sum0", "contiguous_t", "narrow", "square"]
BINARY = ["add", "mul", "sub", "broadcast_mul", "cat", "inplace_add", "matmul"]


def apply_unary(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "t":
        return x.t() if x.dim() == 2 else x
    if name == "unsqueeze":
        return x.unsqueeze(0).squeeze(0)
    if name == "sum0":
        return x.sum(0, keepdim=True)
    if name == "contiguous_t":
        return x.t().contiguous() if x.dim() == 2 else x.contiguous()
    if name == "narrow":
        return x.narrow(0, 0, max(1, x.shape[0] // 2))
    if name == "square":
        return x * x
    return getattr(torch, name)(x)


def apply_binary(name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if x.shape != y.shape:
        if name == "cat" and x.shape[1:] == y.shape[1:]:
            return torch.cat([x, y])
        if name == "matmul" and x.shape[-1] == y.shape[0]:
            return x @ y
        return x * y.sum()
    if name == "broadcast_mul":
        return (x[:, :, None] * y[:, None, :]).sum(1)
    if name == "cat":
        return torch.cat([x, y], dim=1)
    if name == "inplace_add":
        out = x.clone()
        out.add_(y)
        return out
    if name == "matmul":
        return x @ y.t()
    return getattr(torch, name)(x, y)


@st.composite
def programs(draw: st.DrawFn) -> tuple[list[tuple[int, int]], list[tuple[str, int, int, bool]], bool]:
    shapes = draw(st.lists(st.tuples(st.integers(1, 12), st.integers(1, 12)), min_size=1, max_size=3))
    steps = draw(
        st.lists(
            st.tuples(st.sampled_from(UNARY + BINARY), st.integers(0, 99), st.integers(0, 99), st.booleans()),
            min_size=1,
            max_size=12,
        )
    )
    return shapes, steps, draw(st.booleans())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_random_programs_agree_with_the_profiler(program: tuple) -> None:
    shapes, steps, backward = program
    inputs = [torch.randn(*shape, requires_grad=backward) for shape in shapes]

    def run() -> None:
        live = list(inputs)
        for name, i, j, drop in steps:
            x, y = live[i % len(live)], live[j % len(live)]
            live.append(apply_unary(name, x) if name in UNARY else apply_binary(name, x, y))
            if drop and len(live) > 1:
                del live[i % (len(live) - 1)]
        if backward:
            torch.stack([t.sum() for t in live]).sum().backward()

    assert_agrees(run)


def test_detach_is_not_recorded_and_changes_nothing() -> None:
    # autograd issues a detach around every saved tensor; memtrim leaves them out of the op log
    x = torch.randn(100, 100, requires_grad=True)

    def program() -> None:
        y = x.exp()
        z = y.detach() * 2  # the multiply is recorded, the detach is not
        (y * z).sum().backward()

    trace = assert_agrees(program)
    assert "aten.detach.default" not in {op.op for op in trace.ops}
    assert "aten.mul.Tensor" in {op.op for op in trace.ops}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_saved_bytes_agree_with_what_autograd_packs(program: tuple) -> None:
    # Ground truth: autograd's own saved-tensor hooks, in a separate untracked run of the same
    # program, name every tensor it saves; memtrim reads the nodes instead. Every result is kept, so
    # no graph (and no saved storage) dies before the end.
    shapes, steps, _ = program
    inputs = [torch.randn(*shape, requires_grad=True) for shape in shapes]
    before = {t.untyped_storage()._cdata for t in inputs}

    def run(keep: list[torch.Tensor]) -> None:
        live = list(inputs)
        for name, i, j, _drop in steps:
            x, y = live[i % len(live)], live[j % len(live)]
            live.append(apply_unary(name, x) if name in UNARY else apply_binary(name, x, y))
        keep.extend(live)

    packed: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in before:
            packed[storage._cdata] = storage.nbytes()
        return t

    oracle_keep: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run(oracle_keep)

    keep: list[torch.Tensor] = []
    with memtrim.track() as trace:
        run(keep)
    saved = [a for a in trace.allocations if a.saved]
    assert sorted(a.bytes for a in saved) == sorted(packed.values())
