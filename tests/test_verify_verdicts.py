"""Issue 13, item by item: verdicts right both ways (each of these failed before the fix)."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
import verify_corpus as vc

from memtrim.verify import verify

QUIET: dict[str, Any] = {"memory": False, "progress": False}


# 1. Nonlinear ops in float64: the oracle is the original there, so the budget must come from the trace.
@pytest.mark.parametrize(
    "name",
    [
        "max-shifted softmax",
        "max-shifted logsumexp",
        "two-pass variance",
        "unfused layer norm",
        "chunked linear + cross-entropy",
    ],
)
def test_nonlinear_rewrites_pass_in_float64(name: str) -> None:
    reference, candidate, inputs = vc.CORRECT[name]
    spec = inputs() if inputs.__code__.co_argcount == 0 else inputs
    r = verify(reference, candidate, spec, dtypes=("fp64",), mode="reference", **QUIET)
    r.assert_ok()
    assert len(r.cases) == 12 and {c.held for c in r.cases} == {"reference"}
    assert {q.rule for c in r.cases for q in c.quantities} == {"per element, budget traced"}


# 2. Reassociation in fp16/bf16: the intermediate product is rounded to the low dtype either way.
def test_reassociated_product_chain_passes_in_half_precision() -> None:
    inputs = (vc.r(8, 32), vc.r(32, 4), vc.r(4, 16))
    r = verify(vc.chain_left, vc.chain_right, inputs, dtypes=("fp16", "bf16"), mode="reference", **QUIET)
    r.assert_ok()
    assert len(r.cases) == 24


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reassociated_chain_is_as_accurate_as_the_original_over_20_seeds(dtype: torch.dtype) -> None:
    # The claim behind item 2, measured without verify: the error of each association against float64.
    ratios = []
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        a, b, c = (torch.randn(s, generator=g, dtype=torch.float64) for s in ((8, 32), (32, 4), (4, 16)))
        exact = a @ b @ c
        low = [t.to(dtype) for t in (a, b, c)]
        left = (vc.chain_left(*low).double() - exact).abs().max()
        right = (vc.chain_right(*low).double() - exact).abs().max()
        ratios.append(float(right / left))
    assert 0.25 < sorted(ratios)[10] < 4  # the median error ratio: the same accuracy


def test_results_in_the_fp16_subnormals_are_within_the_budget() -> None:
    # A softmax over 256 columns of 3*randn stores about half its outputs below fp16's smallest normal
    # (2**-14), where a rounding errs by up to 2**-25 absolutely, not by u relatively: gradual underflow.
    def logits(dtype: torch.dtype, device: torch.device, seed: int) -> tuple[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return ((3 * torch.randn(16, 256, generator=g, dtype=torch.float64)).to(dtype).requires_grad_(),)

    def softmax_max_detached(x: torch.Tensor) -> torch.Tensor:
        e = (x - x.amax(-1, keepdim=True).detach()).exp()
        return e / e.sum(-1, keepdim=True)

    y = torch.softmax(logits(torch.float16, torch.device("cpu"), 0)[0], -1)
    assert int(((y != 0) & (y < 2**-14)).sum()) > y.numel() // 4
    r = verify(vc.softmax, softmax_max_detached, logits, dtypes=("fp16",), mode="reference", **QUIET)
    r.assert_ok()


# 3. Dict outputs: compared key by key, whatever the insertion order.
def test_dict_outputs_in_another_key_order_pass_and_a_wrong_value_is_named() -> None:
    inputs = (vc.r(4, 6), vc.r(6, 3))
    r = verify(vc.two_outputs, vc.two_outputs_other_order, inputs, **QUIET)
    r.assert_ok()
    assert {q.name for q in r.cases[0].quantities} >= {"output['a']", "output['b']"}
    bad = verify(vc.two_outputs, vc.two_outputs_scaled, inputs, seeds=(0,), **QUIET)
    assert not bad.passed and {f.what for f in bad.failures} >= {"output['a']"}
    assert not any(f.what == "output['b']" for f in bad.failures)


# 4. In-place updates of inputs are compared like outputs.
def test_in_place_updates_of_inputs_are_compared() -> None:
    ok = verify(vc.sgd_step, vc.sgd_step_alpha, vc.sgd_inputs, mode="reference", seeds=(0,), **QUIET)
    ok.assert_ok()
    assert "input[0] (updated in place)" in {q.name for c in ok.cases for q in c.quantities}
    for wrong in (vc.sgd_step_too_far, vc.sgd_step_uphill):
        bad = verify(vc.sgd_step, wrong, vc.sgd_inputs, seeds=(0,), **QUIET)
        assert not bad.passed
        assert {f.what for f in bad.failures} == {"input[0] (updated in place)"}
        assert "candidate updates input[0] differently from the reference" in bad.failures[0].message


# 5. A write through .data moves no version counter; the bits still change.
def test_mutation_through_data_is_caught() -> None:
    r = verify(vc.softmax, vc.softmax_mutating_through_data, (vc.r(4, 8),), seeds=(0,), **QUIET)
    assert not r.passed and "through .data" in r.failures[0].message
    for f in r.failures:  # (torch refuses the write into an expanded input: the candidate raises there)
        assert f.kind == "mutation" if "expanded" not in f.case else f.kind == "exception"
    assert len({f.case for f in r.failures if f.kind == "mutation"}) == 12


# 6. Bit-exact means the same bits.
def test_exact_mode_tells_minus_zero_from_zero() -> None:
    x = (vc.r(4, 8),)
    exact = verify(vc.relu, vc.relu_by_mask, x, mode="exact", seeds=(0,), dtypes=("fp32",), **QUIET)
    assert not exact.passed and "other sign of zero" in exact.failures[0].message
    auto = verify(vc.relu, vc.relu_by_mask, x, seeds=(0,), dtypes=("fp32",), **QUIET)
    assert auto.passed and {c.held for c in auto.cases} == {"reference"}  # equal values, other bits


# 7. Random draws: the oracle runs in the case's own layout, so it draws for the same elements.
def test_dropout_is_judged_in_the_transposed_layout() -> None:
    x = (vc.r(16, 8),)
    bad = verify(vc.dropout_half, vc.dropout_more, x, layouts=("transposed",), mode="reference", **QUIET)
    assert not bad.passed and len({f.case for f in bad.failures}) == len(bad.cases) == 12

    def same_but_rescaled(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(x * 3.0, 0.5) / 3.0

    ok = verify(vc.dropout_half, same_but_rescaled, x, mode="reference", **QUIET)
    ok.assert_ok()
    assert {c.held for c in ok.cases} == {"reference"}


# 8. Aliasing: an output that shares an input's memory where the reference's does not.
def test_aliasing_differences_are_reported() -> None:
    x = (vc.r(4, 8),)
    bad = verify(vc.copy_of, vc.view_of, x, seeds=(0,), **QUIET)
    assert not bad.passed and {f.kind for f in bad.failures} == {"aliasing"}
    assert "shares memory with input[0]" in bad.failures[0].message
    fresh = verify(vc.view_of, vc.copy_of, x, seeds=(0,), **QUIET)
    assert fresh.passed and any(
        "is a fresh tensor where the reference's is a view of input[0]" in n for n in fresh.notes
    )


# 9. Memory is released case by case: no oracle outlives the cases that use it.
def test_oracles_are_released_after_their_cases() -> None:
    oracle_outputs: list[weakref.ref[torch.Tensor]] = []
    alive_at_each_oracle: list[int] = []

    def reference(x: torch.Tensor) -> torch.Tensor:
        out = torch.softmax(x, -1)
        if x.dtype == torch.float64:  # an oracle run (or a float64 case)
            gc.collect()
            alive_at_each_oracle.append(sum(ref() is not None for ref in oracle_outputs))
            oracle_outputs.append(weakref.ref(out))
        return out

    r = verify(reference, vc.softmax_manual, (vc.r(4, 8),), mode="reference", **QUIET)
    r.assert_ok()
    assert len(alive_at_each_oracle) >= 12 + 12  # fp64 cases and at least one oracle per dtype and seed
    assert max(alive_at_each_oracle) <= 2  # the current case's original and at most one held oracle
