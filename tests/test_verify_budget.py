"""The derived error budget: S and n by tracing, the rounding registry, and the per-element rule."""

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
from memtrim.verify.magnitudes import ABS_RULES, NotMultilinear, abs_mode
from memtrim.verify.oracle import Upstream, derive

FAST: dict[str, Any] = {"memory": False, "progress": False, "seeds": (0,)}


def trace(
    fn: Callable[..., Any], *args: torch.Tensor, grad: torch.Tensor | None = None, mode: str = "abs"
) -> Any:
    """(S or n of the output, of each input's gradient) by running ``fn`` under the tracing mode."""
    leaves = [
        (a.detach().abs() if mode == "abs" else torch.ones_like(a)).requires_grad_(a.requires_grad)
        for a in args
    ]
    g = None if grad is None else grad.abs() if mode == "abs" else torch.ones_like(grad)
    tracer, ctx = abs_mode(mode)
    for x in [*leaves, g]:
        if x is not None:
            ctx.mark(x, leaf=True)
    with tracer:
        out = fn(*leaves)
        grads = None
        if g is not None:
            grads = torch.autograd.grad(out, [x for x in leaves if x.requires_grad], g)
    return out.detach(), grads


def test_s_of_einsum_is_the_contraction_of_absolute_values() -> None:
    z = torch.randn(5, 3, 4, dtype=torch.float64, requires_grad=True)
    W = torch.randn(3, 4, 6, dtype=torch.float64, requires_grad=True)
    g = torch.randn(5, 3, 6, dtype=torch.float64)
    s, (sz, sw) = trace(lambda a, b: torch.einsum("...hd,hdm->...hm", a, b), z, W, grad=g)
    torch.testing.assert_close(s, torch.einsum("...hd,hdm->...hm", z.abs(), W.abs()), rtol=0, atol=0)
    # Gradients are multilinear in (inputs, upstream): S is the same contraction on absolute values.
    torch.testing.assert_close(sz, torch.einsum("...hm,hdm->...hd", g.abs(), W.abs()), rtol=1e-15, atol=0)
    torch.testing.assert_close(sw, torch.einsum("...hd,...hm->hdm", z.abs(), g.abs()), rtol=1e-15, atol=0)
    n, (nz, nw) = trace(lambda a, b: torch.einsum("...hd,hdm->...hm", a, b), z, W, grad=g, mode="count")
    assert bool((n == 4).all()) and bool((nz == 6).all()) and bool((nw == 5).all())


def test_subtraction_becomes_addition_and_scalars_their_magnitude() -> None:
    a = torch.tensor([1.0, -2.0], dtype=torch.float64)
    b = torch.tensor([3.0, 5.0], dtype=torch.float64)
    s, _ = trace(
        lambda x, y: (x - 2.0 * y) / -4.0 + (-x).mean() - torch.tensor(-1.0, dtype=torch.float64), a, b
    )
    expected = (a.abs() + 2.0 * b.abs()) / 4.0 + a.abs().mean() + 1.0
    torch.testing.assert_close(s, expected, rtol=0, atol=0)
    n, _ = trace(
        lambda x, y: (x - 2.0 * y) / -4.0 + (-x).mean() - torch.tensor(-1.0, dtype=torch.float64),
        a,
        b,
        mode="count",
    )
    assert n.tolist() == [1 + 1 + 2 + 1] * 2  # x, y, the two terms of the mean, the constant


def test_closure_constants_count_with_their_magnitude() -> None:
    W = torch.tensor([[1.0, -1.0], [-2.0, 2.0]], dtype=torch.float64)  # captured, not an input
    x = torch.tensor([1.0, 1.0], dtype=torch.float64)
    s, _ = trace(lambda v: v @ W, x)
    assert s.tolist() == [3.0, 3.0]  # |1*1| + |1*-2| although the true result is [-1, 1]


@pytest.mark.parametrize(
    ("fn", "op"),
    [
        (lambda x: x.exp(), "aten.exp"),
        (lambda x: torch.softmax(x, -1), "aten._softmax"),
        (lambda x: x / x.sum(), "division by a computed tensor"),
        (lambda x: x * x.sum().item(), "aten._local_scalar_dense"),
    ],
)
def test_non_multilinear_ops_stop_the_trace(fn: Callable[..., Any], op: str) -> None:
    with pytest.raises(NotMultilinear, match=op):
        trace(fn, torch.randn(3, dtype=torch.float64))


def test_division_by_an_input_is_allowed() -> None:
    x = torch.tensor([2.0, -4.0], dtype=torch.float64)
    t = torch.tensor([-2.0, 2.0], dtype=torch.float64)
    s, _ = trace(lambda a, b: a / b, x, t)
    assert s.tolist() == [1.0, 2.0]


def test_registry_covers_the_issue_list() -> None:
    aten = torch.ops.aten
    for packet in (
        aten.add,
        aten.sub,
        aten.mul,
        aten.sum,
        aten.mean,
        aten.matmul,
        aten.mm,
        aten.bmm,
        aten.einsum,
        aten.view,
        aten.permute,
        aten.expand,
        aten.transpose,
    ):
        assert packet in ABS_RULES


def test_derive_reports_why_not() -> None:
    inputs = build_inputs(
        (torch.randn(3, requires_grad=True),), Case(torch.float32, "contiguous", 0), torch.device("cpu")
    )
    up = Upstream([torch.randn(3)], None)
    d = derive(torch.tanh, None, None, inputs, up, torch.device("cpu"), {})
    assert d.s is None and d.why_not is not None and "aten.tanh" in d.why_not
    d2 = derive(torch.tanh, lambda x: x, 1, inputs, up, torch.device("cpu"), {})  # supplied S of tanh: |x|
    assert d2.source == "supplied" and d2.s is not None and d2.why_not is None


def test_user_supplied_s_judges_each_element() -> None:
    # mode="reference" on both runs: the verdict must not depend on whether einsum and @ happen to round
    # alike on this CPU (they are bit-identical on some machines, so "auto" would hold exactly there).
    def ref(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ W)

    def cand(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.einsum("ij,jk->ik", x, W))

    x, W = torch.randn(4, 32, requires_grad=True), torch.randn(32, 8, requires_grad=True)
    plain = verify(ref, cand, (x, W), dtypes=("fp32",), mode="reference", **FAST)
    assert plain.passed and any("S could not be derived" in n for n in plain.notes)
    assert {q.rule for c in plain.cases for q in c.quantities} == {"k-times rule on maxima (no S)"}
    # |tanh(y)| <= |y|: S of the inner product bounds the error that reaches the output.
    supplied = verify(
        ref, cand, (x, W), dtypes=("fp32",), mode="reference", abs_reference=lambda x, W: x @ W, **FAST
    )
    assert supplied.passed and not any("S could not be derived" in n for n in supplied.notes)
    assert {q.rule for c in supplied.cases for q in c.quantities} == {"per element, S supplied"}

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
    assert q.n_max == 1024 and q.norm_err is not None and q.bound is not None and q.norm_err < q.bound
    assert q.gamma_n == pytest.approx(gamma(1024, 2.0**-24))


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
def test_s_bounds_the_oracle_and_n_counts_products(b: int, k: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, k, dtype=torch.float64, generator=gen, requires_grad=True)
    y = torch.randn(k, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    g = torch.randn(b, 3, dtype=torch.float64, generator=gen)

    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x @ y - x[:, :1] * 0.5

    s, (sx, sy) = trace(f, x, y, grad=g)
    out = f(x, y)
    gx, gy = torch.autograd.grad(out, (x, y), g)
    assert bool((out.abs() <= s * (1 + 1e-12)).all())  # the triangle inequality
    assert bool((gx.abs() <= sx * (1 + 1e-12)).all()) and bool((gy.abs() <= sy * (1 + 1e-12)).all())
    n, _ = trace(f, x, y, mode="count")
    assert bool((n == k + 1).all())


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
