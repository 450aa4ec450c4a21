"""What memtrim.verify itself holds in memory, in bytes, against torch.profiler's CPU allocation events
(tests/groundtruth.py) and the sizes of the program's own tensors."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from groundtruth import ProfiledMemory, profiler_memory

from memtrim.verify.budget import rounding_for
from memtrim.verify.cases import Case, build_inputs
from memtrim.verify.chunks import CHUNK_ELEMENTS
from memtrim.verify.compare import BudgetInputs, compare_reference
from memtrim.verify.oracle import Oracle, Upstream, run_oracle

F64 = 8


def _unfreed_bytes(truth: ProfiledMemory) -> int:
    """Bytes of the blocks allocated in the window and not freed in it."""
    made = [d for d in truth.deltas if d > 0]
    return sum(made[n] for n in truth.unfreed)


def _storages(tensors: Iterator[Any]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view counts its whole storage)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel():
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _oracle_tensors(o: Oracle) -> Iterator[Any]:
    for r in (o.run, o.s, o.e):
        if r is not None:
            yield from r.outputs
            yield from r.grads or []
            yield from r.updates or []


def _budget_inputs(n: int, *, wrong: bool) -> tuple[torch.Tensor, BudgetInputs]:
    gen = torch.Generator().manual_seed(0)
    oracle = torch.randn(n, generator=gen, dtype=torch.float64)
    orig = oracle.to(torch.float32)
    cand = orig.clone()
    if wrong:  # one element off in each piece
        cand[:: CHUNK_ELEMENTS + 1] *= 1.5
    s = oracle.abs()
    e = s * 2.0**-24
    return cand, BudgetInputs(orig, oracle, s, e, "traced", torch.float32, False)


@pytest.mark.parametrize("wrong", [False, True])
def test_judging_a_tensor_allocates_pieces_of_bounded_size(wrong: bool) -> None:
    # 16 pieces' worth of elements: judged at once, each float64 temporary would be 16 MiB
    n = 16 * CHUNK_ELEMENTS
    cand, b = _budget_inputs(n, wrong=wrong)
    with profiler_memory() as truth:
        q = compare_reference("output", "output", cand, b, layout="contiguous")
    offending = len(range(0, n, CHUNK_ELEMENTS + 1)) if wrong else 0
    assert q.passed is not wrong and q.n_over == offending
    wrong_at = {(i,) for i in range(0, n, CHUNK_ELEMENTS + 1)} if wrong else set()
    assert len(q.offending) == min(5, offending) and {w["index"] for w in q.offending} <= wrong_at
    pieces = [d for d in truth.allocated_sizes if d > 1024]
    assert pieces, "the judgement allocated no temporaries: the profiler saw nothing"
    assert max(pieces) <= CHUNK_ELEMENTS * F64
    # a handful of piece-sized temporaries at once (and 16 bytes per offending element), never one
    # the size of the tensor in float64
    assert truth.peak_in_window <= 16 * CHUNK_ELEMENTS * F64 + 16 * offending
    assert truth.peak_in_window < n * F64


def test_oracle_keeps_only_its_results_and_their_shadows() -> None:
    # The reference's intermediates (x * 2, its exp) each have shadows S and E; once the oracle is
    # made, only the results and the S and E of the results may stay allocated (no cycle keeps the
    # tracer's shadows alive until the garbage collector runs).
    x = torch.randn(256, 512, requires_grad=True)
    case = Case(torch.float32, "contiguous", 0)
    inputs = build_inputs((x,), case, torch.device("cpu"))
    up = Upstream([torch.randn(256, 512, dtype=torch.float32)], None)
    gc.collect()
    gc.disable()
    try:
        with profiler_memory() as truth:
            oracle = run_oracle(
                lambda t: (t * 2).exp() * 3,
                inputs,
                up,
                torch.device("cpu"),
                rounding_for(torch.float32),
                c=10.0,
            )
    finally:
        gc.enable()
    assert oracle.run.error is None and oracle.s is not None and oracle.source == "traced"
    held = _storages(_oracle_tensors(oracle))
    # output and gradient, each with S and E: six float64 tensors the size of x
    assert held == 6 * x.numel() * F64
    upstream = x.numel() * F64  # the float64 copy of the upstream gradient the oracle was given
    assert _unfreed_bytes(truth) <= held + upstream + 4096
