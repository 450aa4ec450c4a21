"""What memtrim.verify itself holds in memory, in bytes, against torch.profiler's CPU allocation events
(tests/groundtruth.py) and the sizes of the program's own tensors."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from groundtruth import ProfiledMemory, _allocation_events, profiler_memory
from torch.profiler import ProfilerActivity, profile

from memtrim.verify.budget import rounding_for
from memtrim.verify.cases import Case, build_inputs
from memtrim.verify.chunks import CHUNK_ELEMENTS, chunks
from memtrim.verify.compare import BudgetInputs, compare_reference
from memtrim.verify.magnitude_rules.common import plus
from memtrim.verify.magnitudes import Tracer
from memtrim.verify.oracle import AbsOf, Oracle, Upstream, run_oracle

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
    # output and gradient, each with E: four float64 tensors the size of x; each S (a product of
    # exact inputs and constants: |value| bit for bit) is the value's absolute value, read piece by piece
    assert [type(t) for t in [*oracle.s.outputs, *(oracle.s.grads or [])]] == [AbsOf, AbsOf]
    assert held == 4 * x.numel() * F64
    upstream = x.numel() * F64  # the float64 copy of the upstream gradient the oracle was given
    assert _unfreed_bytes(truth) <= held + upstream + 4096


def _peak_bytes(prof: Any) -> int:
    """The peak of every CPU allocation in ``prof``, those made and freed inside one op included (a
    magnitude rule's temporaries live inside the op it traces)."""
    live = best = 0
    for _, _, delta, _ in _allocation_events(prof):
        live += delta
        best = max(best, live)
    return best


def test_tracer_keeps_the_shadows_a_rule_made_instead_of_copying_them() -> None:
    # One traced product of a traced intermediate: its value, S and E are three float64 tensors the size
    # of x. The rule's own S and E become the shadows (no copies), and its error terms are summed in the
    # first term's tensor, so at most the value, S, E and the two error terms are alive at once.
    x = torch.randn(256, 512, dtype=torch.float64)
    tracer = Tracer(rounding_for(torch.float32))
    with tracer.mode:
        y = x.exp()
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, tracer.mode:
        z = y * x
    size = x.numel() * F64
    assert _peak_bytes(prof) <= 5 * size + size // 2  # the bool masks of the zero terms: 1/8 each
    s, e = tracer.final(z, copy=False)
    assert s.untyped_storage().data_ptr() != e.untyped_storage().data_ptr()
    assert torch.equal(s, y.abs() * x.abs())


def test_set_owned_adopts_only_a_new_tensor_laid_out_as_the_output() -> None:
    tracer = Tracer(rounding_for(torch.float32))
    out = torch.randn(4, 6, dtype=torch.float64)
    s = torch.rand(4, 6, dtype=torch.float64)
    e = torch.rand(4, 6, dtype=torch.float64)
    tracer.set(out, s=s, e=e, owned=True)
    fs, fe = tracer.final(out, copy=False)
    assert fs.data_ptr() == s.data_ptr() and fe.data_ptr() == e.data_ptr()
    # a view (of another tensor's memory), another layout, the output itself or one tensor for both: copied
    for make in (
        lambda o: (torch.rand(8, 6, dtype=torch.float64)[:4], torch.rand(4, 6, dtype=torch.float64)),
        lambda o: (torch.rand(6, 4, dtype=torch.float64).T, torch.rand(4, 6, dtype=torch.float64)),
        lambda o: (o, torch.rand(4, 6, dtype=torch.float64)),
    ):
        out = torch.randn(4, 6, dtype=torch.float64)
        s, e = make(out)
        tracer.set(out, s=s, e=e, owned=True)
        fs, _ = tracer.final(out, copy=False)
        assert fs.data_ptr() != s.data_ptr() and torch.equal(fs, s)
    out = torch.randn(4, 6, dtype=torch.float64)
    both = torch.rand(4, 6, dtype=torch.float64)
    tracer.set(out, s=both, e=both, owned=True)
    fs, fe = tracer.final(out, copy=False)
    assert fs.data_ptr() != fe.data_ptr() and torch.equal(fs, fe)


def test_plus_adds_into_its_first_term_where_that_has_the_sum_shape() -> None:
    a, b = torch.rand(4, 6, dtype=torch.float64), torch.rand(6, dtype=torch.float64)
    want = a + b
    got = plus(a, b)
    assert got is a and torch.equal(got, want)
    small = torch.rand(6, dtype=torch.float64)
    big = torch.rand(4, 6, dtype=torch.float64)
    got = plus(small, big)
    assert got is not small and torch.equal(got, small + big) and plus(0.0, 0.0) == 0.0


def _oracle_of(fn: Any, x: torch.Tensor, dtype: torch.dtype) -> Oracle:
    inputs = build_inputs((x,), Case(dtype, "contiguous", 0), torch.device("cpu"))
    up = Upstream([torch.randn(fn(x).shape, generator=torch.Generator().manual_seed(1)).to(dtype)], None)
    return run_oracle(fn, inputs, up, torch.device("cpu"), rounding_for(dtype), c=10.0)


@pytest.mark.parametrize(
    "fn",
    [
        lambda t: torch.softmax(t, -1),
        lambda t: torch.nn.functional.layer_norm(t, t.shape[-1:]),
        lambda t: (t * 2).exp() * 3,
        lambda t: t @ t.T,
        lambda t: (t - t.mean(-1, keepdim=True)).tanh(),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_s_kept_as_the_values_absolute_value_is_the_tracers_s_bit_for_bit(
    fn: Any, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The same oracle made twice, the second time keeping every S the tracer computed as a tensor: an
    # S read from AbsOf has the same bits as the tracer's own, piece by piece and as a whole.
    x = torch.randn(3 * CHUNK_ELEMENTS // 512, 512, generator=torch.Generator().manual_seed(0))
    lazy = _oracle_of(fn, x, dtype)
    monkeypatch.setattr("memtrim.verify.oracle.abs_of_value", lambda s, value: s)
    kept = _oracle_of(fn, x, dtype)
    assert lazy.s is not None and kept.s is not None
    pairs = [
        *zip(lazy.s.outputs, kept.s.outputs, strict=True),
        *zip(lazy.s.grads or [], kept.s.grads or [], strict=True),
    ]
    for a, b in pairs:
        assert isinstance(b, torch.Tensor)
        if isinstance(a, AbsOf):
            a = torch.cat([a[index].reshape(-1) for _, index in chunks(a.shape)]).view(b.shape)
        assert torch.equal(a.view(torch.int64), b.contiguous().view(torch.int64))
