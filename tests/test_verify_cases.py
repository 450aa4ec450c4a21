"""The case matrix: layouts (OpInfo-style NaN-padded slices, transposed, expanded), inputs, variants."""

from __future__ import annotations

import math
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memtrim.verify import verify
from memtrim.verify.cases import (
    LAYOUTS,
    Case,
    apply_layout,
    build_inputs,
    contiguous_strides,
    expanded_values,
    noncontiguous_like,
    parse_dtype,
)

FAST: dict[str, Any] = {"memory": False, "progress": False, "seeds": (0,)}
shapes = st.lists(st.integers(0, 4), min_size=0, max_size=4).map(tuple)


@settings(max_examples=60, deadline=None)
@given(shapes, st.sampled_from([torch.float32, torch.float16, torch.int64, torch.bool]))
def test_noncontiguous_like_hides_values_between_poison(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    t = (torch.randn(shape) * 5).to(dtype)
    view, buf = noncontiguous_like(t)
    assert view.shape == t.shape and view.dtype == t.dtype
    assert torch.equal(view, t)
    assert view.storage_offset() == 1 and buf.shape == (*shape, 2)
    if t.numel() > 1:
        assert not view.is_contiguous()
    if t.numel() > 0:
        hidden = buf[..., 0]
        if dtype.is_floating_point:
            assert bool(hidden.isnan().all())
        else:
            assert bool((hidden == (True if dtype == torch.bool else 12)).all())


@settings(max_examples=60, deadline=None)
@given(shapes, st.sampled_from(LAYOUTS))
def test_layouts_keep_shape_and_values(shape: tuple[int, ...], layout: str) -> None:
    t = torch.randn(shape, dtype=torch.float64)
    laid, _ = apply_layout(t, layout)
    assert laid.shape == t.shape
    expected = expanded_values(t) if layout == "expanded" else t
    assert torch.equal(laid, expected)
    laid.add_(0) if layout != "expanded" else None  # fresh storage: writing is allowed and harmless
    assert torch.equal(t, torch.as_strided(t, t.shape, contiguous_strides(t.shape)))


def test_layout_strides_are_what_they_claim() -> None:
    t = torch.randn(2, 3, 4)
    assert apply_layout(t, "contiguous")[0].stride() == (12, 4, 1)
    assert apply_layout(t, "noncontiguous")[0].stride() == (24, 8, 2)
    assert apply_layout(t, "transposed")[0].stride() == (1, 2, 6)
    assert apply_layout(t, "expanded")[0].stride() == (0, 4, 1)


def test_example_inputs_are_redrawn_per_seed_and_rounded_per_dtype() -> None:
    x = torch.zeros(3, 4, requires_grad=True)
    dev = torch.device("cpu")
    a = build_inputs((x,), Case(torch.float32, "contiguous", 0), dev)
    b = build_inputs((x,), Case(torch.float32, "contiguous", 1), dev)
    h = build_inputs((x,), Case(torch.bfloat16, "contiguous", 0), dev)
    assert not torch.equal(a.leaves[0], b.leaves[0]) and a.requires_grad == [True]
    assert h.leaves[0].dtype == torch.bfloat16
    torch.testing.assert_close(h.leaves[0].float(), a.leaves[0].bfloat16().float(), rtol=0, atol=0)
    leaves, guards = a.materialize(layout="noncontiguous")
    assert leaves[0].is_leaf and leaves[0].requires_grad and len(guards) == 1


def test_every_run_gets_fresh_inputs() -> None:
    seen: list[int] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.untyped_storage().data_ptr())
        return x * 2

    verify(fn, fn, (torch.randn(3),), dtypes=("fp32",), layouts=("contiguous",), **FAST)
    assert len(seen) == 2 and seen[0] != seen[1]


def test_upstream_gradient_is_laid_out_like_the_case() -> None:
    strides: list[tuple[int, ...]] = []

    class Spy(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            strides.append(g.stride())
            return g * 2

    x = torch.randn(3, 4, requires_grad=True)
    verify(
        lambda x: x * 2, Spy.apply, (x,), dtypes=("fp32",), layouts=("noncontiguous", "transposed"), **FAST
    )
    assert strides == [(8, 2), (1, 3)]


def test_default_matrix_size_and_ids() -> None:
    x = torch.randn(2, 3, requires_grad=True)
    r = verify(lambda x: x * 2, lambda x: x * 2, (x,), memory=False, progress=False)
    assert len(r.cases) == 4 * 4 * 3
    assert r.cases[0].case.id == "float64/contiguous/seed=0"
    assert {c.case.dtype for c in r.cases} == {torch.float64, torch.float32, torch.float16, torch.bfloat16}


def test_integer_only_inputs_run_as_given_in_exact_mode() -> None:
    i = torch.arange(6).reshape(2, 3)
    r = verify(lambda i: i.sum(0), lambda i: i.t().sum(1), (i,), **FAST)
    assert r.passed and len(r.cases) == 4 and r.cases[0].case.id == "as-given/contiguous/seed=0"
    bad = verify(lambda i: i.sum(0), lambda i: i.sum(1)[:3], (i,), **FAST)
    assert not bad.passed


def test_user_supplied_batchless_and_empty_variants() -> None:
    z = torch.randn(2, 5, 3, 4, requires_grad=True)
    W = torch.randn(3, 4, 6, requires_grad=True)
    batchless = (torch.randn(5, 3, 4, requires_grad=True), W)
    empty = (torch.randn(0, 3, 4, requires_grad=True), W)

    def ref(z: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        return (z[..., None] * W).sum(-2)

    def cand(z: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        return torch.einsum("...hd,hdm->...hm", z, W)

    r = verify(
        ref, cand, (z, W), variants={"batchless": batchless, "empty": empty}, dtypes=("fp32", "bf16"), **FAST
    )
    r.assert_ok()
    ids = [c.case.id for c in r.cases]
    assert "batchless/float32/contiguous/seed=0" in ids and "empty/bfloat16/expanded/seed=0" in ids
    empty_out = next(c for c in r.cases if c.case.variant == "empty").quantities[0]
    assert empty_out.numel == 0


def test_variant_that_breaks_the_candidate_is_named() -> None:
    def cand(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], -1).sum(1)  # -1 is ambiguous for an empty batch

    r = verify(
        lambda x: x.sum((1, 2)),
        cand,
        (torch.randn(2, 3, 4),),
        variants={"empty": (torch.randn(0, 3, 4),)},
        dtypes=("fp32",),
        layouts=("contiguous",),
        **FAST,
    )
    assert not r.passed and r.failures[0].case == "empty/float32/contiguous/seed=0"


def test_autocast_cases_on_request() -> None:
    x, W = torch.randn(4, 16, requires_grad=True), torch.randn(16, 8, requires_grad=True)
    r = verify(
        lambda x, W: x @ W,
        lambda x, W: torch.einsum("ik,kj->ij", x, W),
        (x, W),
        dtypes=("fp32",),
        layouts=("contiguous",),
        autocast=True,
        mode="reference",
        **FAST,
    )
    r.assert_ok()
    ac = [c for c in r.cases if c.case.autocast]
    assert [c.case.id for c in ac] == ["autocast(bfloat16)/contiguous/seed=0"]
    assert ac[0].quantities[0].u_acc == 2.0**-8


def test_second_order_on_request() -> None:
    x, W = torch.randn(3, 5, requires_grad=True), torch.randn(5, 2, requires_grad=True)

    def ref(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        return (x @ W) * (x @ W)

    r = verify(ref, lambda x, W: (x @ W).pow(2), (x, W), second_order=True, dtypes=("fp64", "fp32"), **FAST)
    r.assert_ok()
    names = {q.name for c in r.cases for q in c.quantities}
    assert {"2nd derivative of input[0]", "2nd derivative of input[1]"} <= names

    class FirstOrderOnly(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(x, W)
            return (x @ W) ** 2

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            x, W = ctx.saved_tensors
            with torch.no_grad():  # not differentiable twice
                h = 2 * (x @ W) * g
                return h @ W.T, x.T @ h

    bad = verify(ref, FirstOrderOnly.apply, (x, W), second_order=True, dtypes=("fp64",), **FAST)
    assert not bad.passed and "cannot be differentiated again" in bad.failures[0].message


def test_parse_dtype_aliases() -> None:
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype("torch.float16") is torch.float16
    assert parse_dtype(torch.float64) is torch.float64
    assert math.isclose(torch.finfo(parse_dtype("fp32")).eps, 2.0**-23)


def test_random_callables_draw_the_same_numbers_and_the_callers_rng_is_kept() -> None:
    def ref(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(x, 0.5) * 2

    def cand(x: torch.Tensor) -> torch.Tensor:
        return 2 * torch.nn.functional.dropout(x, 0.5)

    x = torch.randn(64, requires_grad=True)
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    r = verify(ref, cand, (x,), mode="exact", **{**FAST, "memory": True})
    assert torch.equal(torch.random.get_rng_state(), before)
    r.assert_ok()


def test_builder_gets_dtype_device_and_seed() -> None:
    calls: list[tuple[torch.dtype, str, int]] = []

    def build(dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
        calls.append((dtype, str(device), seed))
        return torch.randn(3, dtype=dtype, device=device)

    r = verify(
        torch.neg,
        torch.neg,
        build,
        dtypes=("fp16",),
        layouts=("contiguous",),
        seeds=(4, 5),
        device="cpu",
        memory=False,
        progress=False,
    )
    assert r.passed and calls == [(torch.float16, "cpu", 4), (torch.float16, "cpu", 5)]
