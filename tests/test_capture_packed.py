"""A long recording packs its older rows (memtrim.trace.packed): what is read back is what was written,
the same program recorded without packing gives the same trace and torch.profiler's events, and the
recording holds few bytes per op (tracemalloc)."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from groundtruth import memtrim_deltas, profiler_memory
from hypothesis import given, settings
from hypothesis import strategies as st

import memtrim
from memtrim.capture import recorder
from memtrim.capture.source import SOURCE_LINES
from memtrim.trace.model import AllocationLog, AllocRow, Fact, FreeRow, OpLog, OpRow, Phase, Site


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class _EncoderDecoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU())
        self.decoder = torch.nn.Linear(16, 4)


def _training() -> Callable[[], None]:
    """One step of a program with every kind of row: parameters from before the region, gradients made by
    accumulation, Adam state, a custom Function, frees in each phase and, calling the encoder and the
    decoder by path, module paths renamed when the region ends."""
    torch.manual_seed(0)
    model = _EncoderDecoder()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(3, 8)

    def step() -> None:
        h = _Square.apply(model.encoder(x))
        model.decoder(h).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    return step


@contextmanager
def _sealing(monkeypatch: pytest.MonkeyPatch, every: int, keep: int) -> Iterator[None]:
    with monkeypatch.context() as patch:
        patch.setattr(recorder, "SEAL_EVERY", every)
        patch.setattr(recorder, "KEEP_RECENT", keep)
        yield


@contextmanager
def _no_gc() -> Iterator[None]:
    # the two recordings must free at the same moments: no collection of cycles in between
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _six_steps_unpacked() -> memtrim.Trace:
    with memtrim.track() as plain:
        step = _training()  # (alive at the region's end: its modules' paths are renamed)
        for _ in range(6):
            step()
    return plain


def test_a_packed_recording_reads_back_as_recorded_unpacked(monkeypatch: pytest.MonkeyPatch) -> None:
    with _no_gc():
        plain = _six_steps_unpacked()
        with _sealing(monkeypatch, every=5, keep=2), profiler_memory() as truth, memtrim.track() as packed:
            step = _training()
            for _ in range(6):
                step()
            sealed = packed.log.ops.writing_rows().count(None)
    assert sealed > 100  # (the recording really was packed)
    # the region's end leaves it packed, and still finds the text of every line the ops name
    assert None in packed.log.ops.writing_rows()
    assert packed.log.metadata[SOURCE_LINES] == plain.log.metadata[SOURCE_LINES]
    assert packed.log.ops.rows == plain.log.ops.rows
    assert packed.log.allocations == plain.log.allocations
    assert {a.module for a in packed.allocations} >= {"_EncoderDecoder.encoder.0", "_EncoderDecoder.decoder"}
    assert any(Fact.GRADIENT in a.facts for a in packed.allocations)
    assert any(Fact.OPTIMIZER_STATE in a.facts for a in packed.allocations)
    assert [d for d in memtrim_deltas(packed) if d] == truth.deltas
    assert packed.peak_bytes == truth.peak


def test_reading_while_recording_unpacks_and_recording_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    with _no_gc():
        plain = _six_steps_unpacked()
        with _sealing(monkeypatch, every=5, keep=2), memtrim.track() as packed:
            step = _training()
            for _ in range(3):
                step()
            assert len(packed.log.allocations) > 0  # a snapshot: everything unpacked
            assert None not in packed.log.ops.writing_rows()
            for _ in range(3):
                step()
    assert packed.log.ops.rows == plain.log.ops.rows
    assert packed.log.allocations == plain.log.allocations


def test_a_long_recording_holds_few_bytes_per_op(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 16)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        with _sealing(monkeypatch, every=1024, keep=128), memtrim.track() as trace:
            for _ in range(500):
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
            gc.collect()
            held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    ops = len(trace.log.ops)
    assert ops > 15_000
    # unpacked, the rows, frees and facts of this loop hold about 400 B per op
    assert held / ops < 120


_SITES = [Site("a.py", 1, "f"), Site("a.py", 1, "f"), Site("b.py", 2, "g"), None]  # two equal, not one
_rows = st.lists(
    st.tuples(
        st.sampled_from(["aten.mm.default", "aten.add.Tensor"]),
        st.sampled_from(list(Phase)),
        st.sampled_from(range(len(_SITES))),
        st.sampled_from([None, "MmBackward0"]),
        st.sampled_from([None, "m.0", "m.1"]),
        st.lists(st.integers(0, 2**40), max_size=4),
        st.sampled_from([(), (3,), (2, 5)]),
        st.sets(st.sampled_from(list(Fact)), max_size=3),
        st.booleans(),
    ),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(_rows, st.lists(st.integers(0, 60), max_size=5))
def test_packed_logs_give_back_each_row_and_object(rows: list, seal_points: list[int]) -> None:  # type: ignore[type-arg]
    ops, allocations = OpLog(), AllocationLog()
    op_rows, alloc_rows, frees, _ = ops.writing_rows(), *allocations.writing()
    written_ops, written_allocations, written_frees = [], [], {}
    for i, (op, phase, site, node, module, inputs, shape, found, freed) in enumerate(rows):
        if i in seal_points:
            ops.seal(i - 1)
            allocations.seal(i - 1)
        row = OpRow(i, op, phase, _SITES[site], node, module, tuple(inputs))
        op_rows.append(row)
        written_ops.append(row)
        alloc = AllocRow(i - 1, 4 * (i + 1), torch.float32, shape, torch.device("cpu"), 2 * i, _SITES[-site])
        alloc_rows.append(alloc)
        written_allocations.append(alloc)
        for fact in found:
            allocations.add_fact(i, fact)
        if freed and i:
            frees[i - 1] = written_frees[i - 1] = FreeRow(2 * i + 1, phase)
    for index, row in enumerate(written_ops):
        got = ops.row(index)
        assert got == row and got.site is row.site
        got_alloc = allocations.row(index)
        assert (
            got_alloc == written_allocations[index]
            and got_alloc.call_site is written_allocations[index].call_site
        )
    assert list(allocations.seqs()) == [a.seq for a in written_allocations]
    assert all(
        a is b
        for row, got in zip(written_ops, ops.rows, strict=True)
        for a, b in zip(row, got, strict=True)
        if isinstance(a, Site)
    )
    assert ops.rows == written_ops
    assert allocations.rows == written_allocations
    assert allocations.frees == written_frees
    assert {i: f for i, f in allocations.facts.items() if f} == {
        i: set(r[7]) for i, r in enumerate(rows) if r[7]
    }
