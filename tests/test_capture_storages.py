"""Every storage the allocator sees, against torch.profiler's CPU allocation events in the same run:
nested, sparse, meta and subclass tensors, storage resizes, set_, and tensors made below the
dispatcher (checkpoint's RNG state)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from groundtruth import ProfiledMemory, memtrim_deltas, profiler_memory
from torch.testing._internal.two_tensor import TwoTensor

import memtrim

warnings.filterwarnings("ignore", message=".*nested tensors is in prototype.*")
warnings.filterwarnings("ignore", message=".*Sparse CSR tensor support is in beta.*")
warnings.filterwarnings("ignore", message=".*Sparse invariant checks.*")


def measure(program: Callable[[], object]) -> tuple[memtrim.Trace, ProfiledMemory]:
    with profiler_memory() as truth, memtrim.track() as trace:
        program()
    return trace, truth


def nonzero(deltas: list[int]) -> list[int]:
    # a storage of 0 bytes seen as an input is watched (it may grow), so its free is a 0 delta
    return [d for d in deltas if d]


def agrees(program: Callable[[], object], *, ordered: bool = True) -> memtrim.Trace:
    """memtrim's events equal the profiler's (``ordered=False``: as multisets, for ops whose several
    outputs the kernel allocates in another order than it returns them), and so do the peaks."""
    trace, truth = measure(program)
    mine, theirs = nonzero(memtrim_deltas(trace)), truth.deltas
    assert (mine if ordered else sorted(mine)) == (theirs if ordered else sorted(theirs))
    assert trace.peak_bytes == truth.peak
    return trace


def test_strided_nested_tensors_run_and_count_their_buffer_and_metadata() -> None:
    def program() -> None:
        nt = torch.nested.nested_tensor([torch.randn(3, 4), torch.randn(5, 4)])
        y = (nt * 2).relu()
        del nt, y

    trace = agrees(program, ordered=False)
    buffers = [a for a in trace.allocations if a.bytes == (3 + 5) * 4 * 4]
    assert len(buffers) == 3 and all(a.shape == (32,) for a in buffers)  # the flat buffer


def test_jagged_nested_tensors_count_values_once() -> None:
    def program() -> None:
        nt = torch.nested.nested_tensor([torch.randn(300, 40), torch.randn(500, 40)], layout=torch.jagged)
        y = nt * 2
        del nt, y

    trace = agrees(program)
    values = 800 * 40 * 4
    assert sorted(a.bytes for a in trace.allocations if a.bytes == values) == [values, values]


def test_storage_resize_frees_and_allocates_like_fsdp() -> None:
    from torch.distributed.fsdp._fully_shard._fsdp_param import alloc_storage, free_storage

    shard = torch.randn(1 << 18)
    x = torch.randn(8, 512)

    def program() -> None:
        unsharded = torch.empty(1 << 18)  # 1 MiB, the all-gathered parameter
        free_storage(unsharded)
        for _ in range(3):
            alloc_storage(unsharded)  # storage.resize_(n): allocated again
            unsharded.copy_(shard)
            y = x @ unsharded.view(512, 512)
            free_storage(unsharded)  # storage.resize_(0): FSDP2's free
            del y
        del unsharded

    trace = agrees(program)
    resized = [a for a in trace.allocations if a.op == "UntypedStorage.resize_"]
    assert [a.bytes for a in resized] == [1 << 20] * 3
    assert all(a.free_tick is not None and a.phase == "forward" for a in resized)  # grad mode is on
    assert trace.peak_bytes == (1 << 20) + 8 * 512 * 4


def test_parameters_from_before_the_region_are_their_storages() -> None:
    """Parameters first seen as inputs take the recorder's fast path: each is one pre-existing row of
    its storage's bytes; one whose storage was resized to nothing (FSDP2's freed unsharded
    parameter), a zero-size one and a meta one hold no memory and get no row."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import free_storage

    weight = torch.nn.Parameter(torch.randn(64, 32))
    bias = torch.nn.Parameter(torch.randn(64))
    freed = torch.nn.Parameter(torch.randn(256))
    free_storage(freed)
    empty = torch.nn.Parameter(torch.randn(0))
    meta = torch.nn.Parameter(torch.empty(1 << 20, device="meta"))
    x = torch.randn(8, 32)

    def program() -> None:
        y = torch.nn.functional.linear(x, weight, bias)
        z = (freed.view(16, 16), empty.sum(), meta.sum(), y.sum())  # (the freed one is not read)
        del y, z

    trace = agrees(program)
    before = sorted((a.bytes, a.shape) for a in trace.allocations if a.preexisting)
    expected = [(64 * 4, (64,)), (8 * 32 * 4, (8, 32)), (64 * 32 * 4, (64, 32))]
    assert before == sorted(expected)
    roles = {a.shape: a.facts for a in trace.allocations if a.preexisting}
    assert "parameter" in {str(f) for f in roles[(64, 32)]} and "parameter" in {str(f) for f in roles[(64,)]}


def test_sparse_coo_storages_are_its_indices_and_values() -> None:
    indices = torch.randint(0, 1000, (2, 10_000))
    values = torch.randn(10_000)

    def program() -> None:
        s = torch.sparse_coo_tensor(indices, values, (1000, 1000)).coalesce()
        d = s * 2
        del s, d

    trace = agrees(program, ordered=False)
    assert trace.peak_bytes > 0


def test_sparse_csr_storages_are_its_index_and_value_tensors() -> None:
    dense = torch.randn(300, 300)

    def program() -> None:
        s = dense.relu().to_sparse_csr()
        e = s * 2
        del s, e

    agrees(program, ordered=False)


def test_meta_tensors_are_not_memory() -> None:
    before = torch.empty(1 << 26, device="meta")

    def program() -> None:
        m = torch.empty(1 << 28, device="meta")  # 1 GiB that does not exist
        c = torch.empty(1 << 20)  # 4 MiB that does
        n = (m * 2 + before.sum()).sum()
        m.resize_(1 << 29)
        del m, c, n

    trace = agrees(program)
    assert trace.peak.device == "cpu" and trace.peak_bytes == 4 << 20
    assert {a.device for a in trace.allocations} == {"cpu"}


class _Wrapper(torch.Tensor):
    """A wrapper subclass without __tensor_flatten__: its memory is the wrapped tensor's."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> _Wrapper:
        t = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)
        t.elem = elem
        return t  # type: ignore[no-any-return]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        unwrap = torch.utils._pytree.tree_map_only(_Wrapper, lambda w: w.elem, (args, kwargs or {}))
        out = func(*unwrap[0], **unwrap[1])
        return torch.utils._pytree.tree_map_only(torch.Tensor, _Wrapper, out)


@pytest.mark.parametrize("wrap", [_Wrapper, lambda t: TwoTensor(t, t * 2)], ids=["wrapper", "two-tensor"])
def test_views_of_a_subclass_allocate_nothing(wrap: Callable[[torch.Tensor], torch.Tensor]) -> None:
    def program() -> None:
        w = wrap(torch.randn(1 << 18))
        views = [w.view(-1) for _ in range(16)]
        grown = w + 1  # a new wrapper, and new inner memory
        del views, w, grown

    trace = agrees(program)
    assert not [a for a in trace.allocations if a.op == "aten.view.default"]


def test_set_onto_a_storage_from_before_the_region_is_not_new() -> None:
    base = torch.randn(1 << 22)

    def program() -> None:
        t = torch.empty(0)
        t.set_(base.untyped_storage())
        u = t * 1
        del u, t

    trace = agrees(program)
    assert trace.peak_bytes == 16 << 20  # the product only
    assert not [a for a in trace.allocations if a.op.startswith("aten.set_") and a.bytes]


def test_checkpoint_keeps_an_rng_state_that_is_counted() -> None:
    from torch.utils.checkpoint import checkpoint

    x = torch.randn(1000, requires_grad=True)

    def program() -> None:
        y = checkpoint(lambda t: t.exp().sin(), x, use_reentrant=False)
        y.sum().backward()

    trace = agrees(program)
    state = torch.get_rng_state().numel()  # 5056 bytes on this build
    states = [a for a in trace.allocations if a.op == "torch.get_rng_state"]
    assert [a.bytes for a in states] == [state, state]  # saved in forward, and fork_rng's in backward
    assert [a.phase for a in states] == ["forward", "backward"]
    assert x.grad is not None


def test_an_rng_state_made_just_after_a_free_is_counted() -> None:
    # A storage freed since the last op is ticked at the next event; an RNG state taken before that
    # may get the freed storage's key (the allocator hands the same address back): it is a new
    # allocation all the same (checkpoint's backward takes one right after the engine drops tensors).
    state = torch.get_rng_state().numel()

    def program() -> None:
        for _ in range(20):
            t = torch.ones(state, dtype=torch.uint8) + 1
            del t
            torch.get_rng_state()

    trace = agrees(program)
    assert len([a for a in trace.allocations if a.op == "torch.get_rng_state"]) == 20
