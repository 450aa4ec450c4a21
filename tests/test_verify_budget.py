"""The derived error budget: S and E by tracing, the rounding registry, and the per-element rule."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memtrim.verify import verify
from memtrim.verify.budget import (
    C_REORDER,
    ROUNDING_REGISTRY,
    NoRoundingRule,
    gamma,
    reorder_factor,
    rounding_for,
    tensorwise_budget,
)
from memtrim.verify.cases import Case, build_inputs
from memtrim.verify.magnitudes import ABS_RULES, MAGNITUDE_RULES, NotMultilinear, NotTraceable, Tracer
from memtrim.verify.oracle import Upstream, run_oracle

FAST: dict[str, Any] = {"memory": False, "progress": False, "seeds": (0,)}
U32 = 2.0**-24


def trace(
    fn: Callable[..., Any], *args: torch.Tensor, grad: torch.Tensor | None = None, dtype: Any = torch.float32
) -> tuple[Any, Any, Any]:
    """(output, (S, E) of the output, [(S, E) of each input's gradient]) with ``fn`` run under the tracer
    on float64 copies of ``args``, budgeted for ``dtype``."""
    leaves = [a.detach().to(torch.float64).requires_grad_(a.requires_grad) for a in args]
    tr = Tracer(rounding_for(dtype))
    with tr.mode:
        out = fn(*leaves)
        grads = []
        if grad is not None:
            grads = list(torch.autograd.grad(out, [x for x in leaves if x.requires_grad], grad.double()))
    return out.detach(), tr.final(out), [tr.final(g) for g in grads]


def test_s_of_einsum_is_the_contraction_of_absolute_values() -> None:
    z = torch.randn(5, 3, 4, dtype=torch.float64, requires_grad=True)
    W = torch.randn(3, 4, 6, dtype=torch.float64, requires_grad=True)
    g = torch.randn(5, 3, 6, dtype=torch.float64)
    _, (s, e), [(sz, ez), (sw, ew)] = trace(lambda a, b: torch.einsum("...hd,hdm->...hm", a, b), z, W, grad=g)
    torch.testing.assert_close(s, torch.einsum("...hd,hdm->...hm", z.abs(), W.abs()), rtol=1e-15, atol=0)
    # Gradients are multilinear in (inputs, upstream): S is the same contraction on absolute values.
    torch.testing.assert_close(sz, torch.einsum("...hm,hdm->...hd", g.abs(), W.abs()), rtol=1e-15, atol=0)
    torch.testing.assert_close(sw, torch.einsum("...hd,...hm->hdm", z.abs(), g.abs()), rtol=1e-15, atol=0)
    # Exact inputs: E is the accumulation allowance alone, min(c*sqrt(n), n) * u_acc * S, n terms summed.
    for (si, ei), n in (((s, e), 4), ((sz, ez), 6), ((sw, ew), 5)):
        torch.testing.assert_close(ei, min(C_REORDER * math.sqrt(n), n) * U32 * si, rtol=1e-12, atol=0)


def test_sums_keep_their_terms_magnitudes_and_a_difference_its_own() -> None:
    # A reduction's magnitude is the reduction of its terms' magnitudes (a re-ordering or re-association
    # of the sum stays inside the budget); an elementwise difference that cancels is as small as its
    # value (so what is built on it, x - mean(x), keeps a tight budget); scalars count by magnitude.
    a = torch.tensor([1.0, -2.0], dtype=torch.float64)
    b = torch.tensor([3.0, 5.0], dtype=torch.float64)
    _, (s, e), _ = trace(lambda x, y: ((x - 2.0 * y) * -3.0).sum(), a, b)
    assert float(s) == float(3.0 * (a - 2.0 * b).abs().sum())
    # E, step by step: 2y is rounded (u*2|y|) and carried into x - 2y, itself rounded (u*|x - 2y|); times
    # 3 and rounded again (u*3|x - 2y|); then the sum of 2 terms adds min(c*sqrt(2), 2)*u_acc*S.
    diff = (a - 2.0 * b).abs()
    steps = 3 * (U32 * 2 * b.abs() + U32 * diff) + U32 * 3 * diff
    assert float(e) == pytest.approx(float(steps.sum() + 2 * U32 * s), rel=1e-12)
    _, (s2, _), _ = trace(lambda x: (-x).mean(), a)
    assert float(s2) == float(a.abs().mean())


def test_closure_constants_count_with_their_magnitude() -> None:
    W = torch.tensor([[1.0, -1.0], [-2.0, 2.0]], dtype=torch.float64)  # captured, not an input
    x = torch.tensor([1.0, 1.0], dtype=torch.float64)
    _, (s, _), _ = trace(lambda v: v @ W, x)
    assert s.tolist() == [3.0, 3.0]  # |1*1| + |1*-2| although the true result is [-1, 1]


def test_errors_propagate_through_each_op_and_every_step_rounds() -> None:
    # exp(x @ W): the product errs by E1 = u_acc*min(c*sqrt(k), k)*S and is stored (+ u*S); exp turns an
    # absolute error into a relative one (|exp'| = exp) and adds its own 2 ulps. In bf16 the storage
    # rounding dominates: u = 2**-8 against u_acc = 2**-24.
    x, W = torch.randn(3, 8, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    y, (s, e), _ = trace(lambda a, b: torch.exp(a @ b), x, W, dtype=torch.bfloat16)
    s1 = x.abs() @ W.abs()
    e1 = min(C_REORDER * math.sqrt(8), 8) * U32 * s1 + 2.0**-8 * s1
    torch.testing.assert_close(s, y.abs(), rtol=0, atol=0)
    torch.testing.assert_close(e, y * e1 + 2 * 2 * U32 * y, rtol=1e-12, atol=0)


def test_views_share_shadows_and_in_place_writes_update_them() -> None:
    x = torch.randn(4, 3, dtype=torch.float64)
    tr = Tracer(rounding_for(torch.float32))
    with tr.mode:
        y = x * 3.0  # one rounding: E (before it) 0, rounded
        v = y.t()[1]  # a view: the same shadows
        y[0].mul_(2.0)  # an in-place write through a view: the product rule on that row
    s, e = tr.final(v)
    assert torch.equal(s, (3 * x.abs()).t()[1] * torch.tensor([2.0, 1, 1, 1], dtype=torch.float64))
    # the row written in place: the product rule on y's rounding (u*|y|, plus fp32's underflow eta)
    assert float(e[0]) == pytest.approx(2.0 * U32 * 3 * abs(float(x[0, 1])), rel=1e-12)
    assert bool((e[1:] == 0).all())


@pytest.mark.parametrize(
    ("fn", "op"),
    [
        (lambda x: torch.atan(x), "aten.atan"),
        (lambda x: x * x.sum().item(), "aten._local_scalar_dense"),
        (lambda x: torch.view_as_complex(torch.stack([x, x], -1)).abs(), "complex"),
    ],
)
def test_ops_without_a_rule_stop_the_trace(fn: Callable[..., Any], op: str) -> None:
    with pytest.raises(NotTraceable, match=op):
        trace(fn, torch.randn(3, dtype=torch.float64))
    assert NotMultilinear is NotTraceable and ABS_RULES is MAGNITUDE_RULES  # the former names still work


def test_division_by_a_computed_tensor_carries_its_error() -> None:
    x = torch.tensor([2.0, -4.0], dtype=torch.float64)
    t = torch.tensor([-2.0, 3.0], dtype=torch.float64)
    _, (s, e), _ = trace(lambda a, b: a / (b * 2.0), x, t)
    # b * 2 is exact but stored: E(b*2) = u*|2b|; E(a / q) = S(a)*E(q)/q**2, all before the own rounding.
    q = 2 * t
    torch.testing.assert_close(s, x.abs() / q.abs(), rtol=0, atol=0)
    torch.testing.assert_close(e, x.abs() * U32 * q.abs() / q**2, rtol=1e-15, atol=0)


ISSUE_OPS: dict[str, Callable[..., torch.Tensor]] = {
    "exp": torch.exp,
    "log": lambda x: torch.log(x.abs() + 0.5),
    "softmax": lambda x: torch.softmax(x, -1),
    "log_softmax": lambda x: torch.log_softmax(x, -1),
    "logsumexp": lambda x: torch.logsumexp(x, -1),
    "var": lambda x: x.var(-1),
    "std": lambda x: x.std(-1),
    "layer_norm": lambda x: torch.nn.functional.layer_norm(x, (6,), x[0] * 0 + 1.5, x[1] * 0 - 0.5),
    "rms_norm": lambda x: torch.nn.functional.rms_norm(x, (6,), x[0] * 0 + 2.0),
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "gelu": torch.nn.functional.gelu,
    "gelu tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "silu": torch.nn.functional.silu,
    "scaled_dot_product_attention": lambda x: torch.nn.functional.scaled_dot_product_attention(
        x[None, :, :4], x[None, :, 1:5], x[None, :, 2:]
    ),
}


@pytest.mark.parametrize("name", ISSUE_OPS)
def test_every_op_the_issue_lists_traces_forward_and_backward(name: str) -> None:
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    out = ISSUE_OPS[name](x)
    y, (s, e), [(sg, eg)] = trace(ISSUE_OPS[name], x, grad=torch.randn(out.shape, dtype=torch.float64))
    assert bool((s >= y.abs() * (1 - 1e-12)).all()) and bool((e > 0).all()) and bool(e.isfinite().all())
    assert bool((sg >= 0).all()) and bool((eg > 0).all()) and bool(eg.isfinite().all())


def test_oracle_reports_why_not() -> None:
    inputs = build_inputs(
        (torch.randn(3, requires_grad=True),), Case(torch.float32, "contiguous", 0), torch.device("cpu")
    )
    up = Upstream([torch.randn(3)], None)
    r = rounding_for(torch.float32)
    o = run_oracle(torch.atan, inputs, up, torch.device("cpu"), r, c=C_REORDER)
    assert o.s is None and o.why_not is not None and "aten.atan" in o.why_not and o.run.error is None
    assert o.layout_specific  # the trace stopped: it cannot tell whether atan draws random numbers
    # |atan(y)| <= |y| and |atan'| <= 1: the budget of the identity bounds atan's (a supplied stand-in).
    supplied = run_oracle(
        torch.atan, inputs, up, torch.device("cpu"), r, c=C_REORDER, abs_reference=lambda x: x
    )
    assert supplied.source == "supplied" and supplied.s is not None and supplied.why_not is None


def test_user_supplied_budget_judges_each_element() -> None:
    # mode="reference" on both runs: the verdict must not depend on whether einsum and @ happen to round
    # alike on this CPU (they are bit-identical on some machines, so "auto" would hold exactly there).
    assert torch.ops.aten.atan not in MAGNITUDE_RULES  # the point: an op the tracer cannot follow

    def ref(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        return torch.atan(x @ W)

    def cand(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        return torch.atan(torch.einsum("ij,jk->ik", x, W))

    x, W = torch.randn(4, 32, requires_grad=True), torch.randn(32, 8, requires_grad=True)
    plain = verify(ref, cand, (x, W), dtypes=("fp32",), mode="reference", **FAST)
    assert plain.passed and any("the budget could not be derived" in n for n in plain.notes)
    assert {q.rule for c in plain.cases for q in c.quantities} == {"k-times rule on maxima (no budget)"}
    # |atan(y)| <= |y| and |atan'| <= 1: the inner product's budget bounds what reaches the output.
    supplied = verify(
        ref, cand, (x, W), dtypes=("fp32",), mode="reference", abs_reference=lambda x, W: x @ W, **FAST
    )
    assert supplied.passed and not any("could not be derived" in n for n in supplied.notes)
    assert {q.rule for c in supplied.cases for q in c.quantities} == {"per element, budget supplied"}

    # Each element is judged: a candidate off by 1% at one element fails there, and only there.
    def off_at_one(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        y = cand(x, W)
        return y + torch.zeros_like(y).index_put_((torch.tensor([1]), torch.tensor([2])), y[1, 2] * 0.01)

    bad = verify(
        ref, off_at_one, (x, W), dtypes=("fp32",), mode="reference", abs_reference=lambda x, W: x @ W, **FAST
    )
    out = [q for c in bad.cases for q in c.quantities if q.name == "output"]
    assert not bad.passed and all(q.n_over == 1 and q.offending[0]["index"] == (1, 2) for q in out)


def test_rounding_registry_is_keyed_by_dtype() -> None:
    assert rounding_for(torch.float16).u == 2.0**-11 and rounding_for(torch.float16).u_acc == 2.0**-24
    assert rounding_for(torch.bfloat16).u == 2.0**-8 and rounding_for(torch.bfloat16).u_acc == 2.0**-24
    assert rounding_for(torch.float32).u_acc == 2.0**-24
    assert rounding_for(torch.float64).u_acc == 2.0**-53
    assert rounding_for(torch.bfloat16, autocast=True).u_acc == 2.0**-8
    assert (torch.float16, False) in ROUNDING_REGISTRY
    with pytest.raises(NoRoundingRule, match="mode='exact'"):
        rounding_for(torch.int32)


@given(st.integers(1, 10**7), st.sampled_from([2.0**-24, 2.0**-53]))
def test_reorder_allowance_never_exceeds_the_worst_case(n: int, u: float) -> None:
    f = float(reorder_factor(torch.tensor([float(n)]), u)[0])
    assert f <= gamma(n, u) * (1 + 1e-12)
    assert f <= C_REORDER * math.sqrt(n) * u * (1 + 1e-12)
    assert f == pytest.approx(min(C_REORDER * math.sqrt(n) * u, gamma(n, u)), rel=1e-9)


def test_tensorwise_rule_grants_one_rounding_of_the_largest_value() -> None:
    oracle = torch.tensor([4.0, -1.0], dtype=torch.float64)
    assert (
        tensorwise_budget(torch.zeros(2, dtype=torch.float64), oracle, k=2, u_out=2.0**-53)
        == 2 * 4 * 2.0**-53
    )
    assert tensorwise_budget(torch.tensor([0.5, 0.0]), oracle, k=3, u_out=2.0**-53) == 1.5


def test_fp16_accumulating_in_fp16_fails_but_fp32_reordering_passes() -> None:
    z, W = torch.randn(8, 4, 64, requires_grad=True), torch.randn(4, 64, 32, requires_grad=True)

    def broadcast(z: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        return (z[..., None] * W).sum(-2)

    def accumulate_in_dtype(z: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        out = z[..., 0, None] * W[:, 0, :]
        for d in range(1, z.shape[-1]):
            out = out + z[..., d, None] * W[:, d, :]  # rounds every partial sum to z's dtype
        return out

    r = verify(
        broadcast, accumulate_in_dtype, (z, W), dtypes=("fp16", "fp32"), layouts=("contiguous",), **FAST
    )
    status = {c.case.id: c.status for c in r.cases}
    assert status == {"float16/contiguous/seed=0": "failed", "float32/contiguous/seed=0": "passed"}
    assert "less accurate than the original" in r.failures[0].message


def test_gemm_for_broadcast_sum_passes_at_long_reductions_in_fp32() -> None:
    # Seed 001: fp32 reductions over d_model with large entries differ by backend; still correct.
    x, W = 100 * torch.randn(16, 1024), (100 * torch.randn(1024, 24)).requires_grad_()
    r = verify(
        lambda x, W: (x[:, :, None] * W).sum(1),
        torch.matmul,
        (x, W),
        dtypes=("fp32",),
        layouts=("contiguous",),
        mode="reference",
        **FAST,
    )
    r.assert_ok()
    q = r.cases[0].quantities[0]
    # Independently of the budget: within Higham's worst case for 1024 products, gamma_1024 + u (final).
    assert q.norm_err is not None and q.norm_err <= gamma(1024, U32) + U32 * (1 + gamma(1024, U32))


@settings(max_examples=25, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 5),
    st.integers(1, 5),
    st.sampled_from(["mm", "einsum", "bcast", "sub", "mean"]),
    st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_a_callable_always_verifies_against_itself(
    b: int, k: int, m: int, op: str, dtype: torch.dtype
) -> None:
    progs: dict[str, Callable[..., torch.Tensor]] = {
        "mm": lambda x, y: x @ y,
        "einsum": lambda x, y: torch.einsum("bk,km->bm", x, y),
        "bcast": lambda x, y: (x[:, :, None] * y).sum(1),
        "sub": lambda x, y: x @ y - (x * 2) @ y.flip(0),
        "mean": lambda x, y: (x @ y).mean(0, keepdim=True) - x.sum(1, keepdim=True),
    }
    fn = progs[op]
    x, y = torch.randn(b, k, requires_grad=True), torch.randn(k, m, requires_grad=True)
    for mode in ("exact", "reference"):
        r = verify(fn, fn, (x, y), mode=mode, dtypes=(dtype,), layouts=("contiguous", "transposed"), **FAST)
        assert r.passed, r.failures[:1]


@settings(max_examples=20, deadline=None)
@given(st.integers(2, 6), st.integers(1, 40), st.integers(0, 2**31 - 1))
def test_s_bounds_the_values_and_e_bounds_the_float32_error(b: int, k: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, k, dtype=torch.float64, generator=gen).float().double().requires_grad_()
    y = torch.randn(k, 3, dtype=torch.float64, generator=gen).float().double().requires_grad_()
    g = torch.randn(b, 3, dtype=torch.float64, generator=gen).float().double()

    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x @ y - x[:, :1] * 0.5

    out, (s, e), [(sx, ex), (sy, ey)] = trace(f, x, y, grad=g)
    gx, gy = torch.autograd.grad(f(x, y), (x, y), g)
    assert bool((out.abs() <= s * (1 + 1e-12)).all())  # the triangle inequality
    assert bool((gx.abs() <= sx * (1 + 1e-12)).all()) and bool((gy.abs() <= sy * (1 + 1e-12)).all())
    # The same computation in float32 (the inputs are float32 values) errs by at most E + u*|value|.
    x32, y32 = x.detach().float().requires_grad_(), y.detach().float().requires_grad_()
    o32 = f(x32, y32)
    gx32, gy32 = torch.autograd.grad(o32, (x32, y32), g.float())
    for got, want, bound in ((o32, out, e), (gx32, gx, ex), (gy32, gy, ey)):
        assert bool(((got.double() - want).abs() <= bound + U32 * want.abs()).all())


def test_every_verify_registry_refuses_duplicates_and_lists_valid_keys() -> None:
    from memtrim.registry import DuplicateRegistration, UnknownKey
    from memtrim.verify import register_abs_rule, register_rounding
    from memtrim.verify.budget import K_FACTORS
    from memtrim.verify.cases import DTYPE_ALIASES, LAYOUT_RULES, apply_layout

    with pytest.raises(DuplicateRegistration, match=r"aten\.mul"):
        register_abs_rule(torch.ops.aten.mul)(lambda ctx, func, args, kwargs: None)
    with pytest.raises(DuplicateRegistration, match="float16"):
        register_rounding(torch.float16)(lambda dtype: rounding_for(dtype))
    for registry in (K_FACTORS, DTYPE_ALIASES, LAYOUT_RULES):
        key = registry.keys()[0]
        with pytest.raises(DuplicateRegistration):
            registry.add(key, registry[key])
    with pytest.raises(UnknownKey, match="valid: 'contiguous', 'noncontiguous', 'transposed', 'expanded'"):
        apply_layout(torch.zeros(2), "diagonal")
    with pytest.raises(UnknownKey, match="valid: 'output', 'grad', 'grad2'"):
        K_FACTORS["hessian"]
    # A refused registration leaves the registry as it was.
    assert ABS_RULES[torch.ops.aten.mul] is not None and rounding_for(torch.float16).u == 2.0**-11
