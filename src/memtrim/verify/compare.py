"""Compare one candidate tensor with the reference's: bit-exact, or against the derived rounding budget."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from memtrim.trace import dtype_name
from memtrim.verify.budget import (
    K_FACTORS,
    Rounding,
    assert_close_tolerances,
    assert_close_verdict,
    elementwise_budget,
    gamma,
    rounding_for,
    tensorwise_budget,
)
from memtrim.verify.results import Quantity, QuantityKind

MAX_SHOWN = 5


def _index(flat: int, shape: torch.Size) -> tuple[int, ...]:
    idx = []
    for s in reversed(shape):
        idx.append(flat % s)
        flat //= s
    return tuple(reversed(idx))


def _val(t: torch.Tensor, flat: int) -> float | int | bool:
    v = t.reshape(-1)[flat].item()
    return v if not isinstance(v, complex) else abs(v)


def same_values(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise equality with NaN equal to NaN (``torch.equal`` semantics plus NaN placement)."""
    eq = a == b
    if a.is_floating_point() or a.is_complex():
        eq = eq | (a.isnan() & b.isnan())
    return eq


def check_meta(name: str, cand: Any, ref: Any) -> str | None:
    """Type, dtype and shape agreement; the message (naming the fix) when they differ."""
    if not isinstance(cand, torch.Tensor):
        return (
            f"candidate {name} is {type(cand).__name__!r}, not a tensor like the reference's; verify "
            "compares tensors: make both callables return tensors in the same places"
        )
    if cand.dtype != ref.dtype:
        return (
            f"candidate {name} is {dtype_name(cand.dtype)} where the reference's is "
            f"{dtype_name(ref.dtype)}: the candidate changes the dtype; compute in the inputs' dtype or "
            "cast the result back (e.g. .to(x.dtype))"
        )
    if cand.shape != ref.shape:
        return (
            f"candidate {name} has shape {tuple(cand.shape)} where the reference's is {tuple(ref.shape)}: "
            "check transposes, the reduced dims and keepdim"
        )
    return None


def compare_exact(name: str, kind: QuantityKind, cand: torch.Tensor, ref: torch.Tensor) -> Quantity:
    """``torch.equal`` on values (NaN in the same places); the offending indices and values if not."""
    eq = same_values(cand, ref)
    bad = (~eq).reshape(-1).nonzero().reshape(-1)
    q = Quantity(
        name, kind, passed=bad.numel() == 0, rule="exact", exact=bad.numel() == 0, numel=cand.numel()
    )
    if bad.numel() == 0:
        return q
    q.n_differ = int(bad.numel())
    if cand.is_floating_point() or cand.is_complex():
        d = (cand.to(torch.complex128 if cand.is_complex() else torch.float64) - ref.to(torch.float64)).abs()
        q.max_abs_diff = float(d.reshape(-1)[bad].nan_to_num(nan=float("inf")).max())
    for flat in bad[:MAX_SHOWN].tolist():
        q.offending.append(
            {"index": _index(flat, cand.shape), "candidate": _val(cand, flat), "reference": _val(ref, flat)}
        )
    first = q.offending[0]
    q.message = (
        f"{name} is not bit-exact: {q.n_differ} of {q.numel} elements differ "
        f"(max |diff| {q.max_abs_diff:.3g}); first at {first['index']}: candidate {first['candidate']!r} "
        f"vs reference {first['reference']!r}"
    )
    return q


@dataclass
class BudgetInputs:
    """What the reference-mode judgement needs besides the candidate: orig, oracle, S and n."""

    orig: torch.Tensor
    oracle: torch.Tensor
    s: torch.Tensor | None
    n: torch.Tensor | None
    s_source: str
    case_dtype: torch.dtype | None
    autocast: bool


def compare_reference(
    name: str, kind: QuantityKind, cand: torch.Tensor, b: BudgetInputs, *, c: float, layout: str
) -> Quantity:
    """Judge ``cand`` against the float64 oracle with the rounding budget of :mod:`memtrim.verify.budget`."""
    if not (cand.is_floating_point() and b.orig.is_floating_point()):
        return compare_exact(name, kind, cand, b.orig)
    exact = bool(same_values(cand, b.orig).all())
    out_r = rounding_for(cand.dtype)
    case_r: Rounding = rounding_for(b.case_dtype or cand.dtype, autocast=b.autocast)
    k = K_FACTORS[kind]
    # Judge on the oracle's device (CPU when the case runs on MPS, which has no float64).
    dev = b.oracle.device
    oracle = b.oracle.to(dtype=torch.float64)
    cand, orig = cand.to(dev), b.orig.to(dev)
    c64, o64 = cand.to(torch.float64), orig.to(torch.float64)
    err = (c64 - oracle).abs()
    orig_err = (o64 - oracle).abs()
    q = Quantity(name, kind, passed=True, rule="", exact=exact, numel=cand.numel())
    q.u_out, q.u_acc = out_r.u, case_r.u_acc
    rtol, atol = assert_close_tolerances(cand, oracle)
    same_c, same_o = same_values(c64, oracle), same_values(o64, oracle)
    q.assert_close, q.assert_close_msg = assert_close_verdict(err, oracle, same_c, rtol, atol)
    q.assert_close_orig, _ = assert_close_verdict(orig_err, oracle, same_o, rtol, atol)
    if cand.numel() == 0:
        q.rule = "empty"
        return q
    finite = oracle.isfinite()
    # Where the oracle itself is not finite, the candidate must match it or the original exactly.
    nonfinite_ok = same_c | same_values(c64, o64)
    if b.s is not None and b.n is not None:
        s = b.s.to(device=dev, dtype=torch.float64)
        n = b.n.to(device=dev, dtype=torch.float64)
        budget = elementwise_budget(orig_err, oracle, s, n, k=k, u_out=out_r.u, u_acc=case_r.u_acc, c=c)
        q.rule = f"per element, S {b.s_source}"
        pos = s > 0
        if bool(pos.any()):
            q.norm_err = float((err[pos] / s[pos]).nan_to_num(nan=float("inf")).max())
            q.norm_err_orig = float((orig_err[pos] / s[pos]).nan_to_num(nan=float("inf")).max())
        q.n_max = int(n.max())
        q.gamma_n = gamma(q.n_max, case_r.u_acc)
        # Worst case for a correct implementation: accumulation (gamma_n) plus the final rounding.
        q.bound = q.gamma_n + out_r.u * (1.0 + q.gamma_n)
    else:
        # Elements where the original overflowed (or is NaN) are not held against the candidate's max.
        orig_ok = o64.isfinite()
        top = tensorwise_budget(orig_err[finite & orig_ok], oracle, k=k, u_out=out_r.u)
        budget = torch.where(orig_ok, torch.full_like(err, top), torch.full_like(err, float("inf")))
        q.rule = "k-times rule on maxima (no S)"
    ok = torch.where(finite, err <= budget, nonfinite_ok)  # NaN error compares False: fails
    bad = (~ok).reshape(-1).nonzero().reshape(-1)
    q.n_over = int(bad.numel())
    q.max_abs_diff = float(err.nan_to_num(nan=float("inf")).max())
    q.passed = q.n_over == 0
    if q.passed:
        return q
    ratio = (err - budget).reshape(-1)[bad].nan_to_num(nan=float("inf"))
    order = bad[ratio.argsort(descending=True)][:MAX_SHOWN].tolist()
    for flat in order:
        q.offending.append(
            {
                "index": _index(flat, cand.shape),
                "candidate": _val(cand, flat),
                "oracle": _val(oracle, flat),
                "original": _val(b.orig, flat),
                "error": _val(err, flat),
                "budget": _val(budget, flat),
            }
        )
    q.worst = q.offending[0]
    q.message = _reference_message(q, cand, oracle, layout)
    return q


def _reference_message(q: Quantity, cand: torch.Tensor, oracle: torch.Tensor, layout: str) -> str:
    w = q.worst
    assert w is not None
    what = (
        f"{q.name}: {q.n_over} of {q.numel} elements exceed the rounding budget ({q.rule}); worst at "
        f"{w['index']}: candidate {w['candidate']:.6g}, oracle (float64) {w['oracle']:.6g}, original "
        f"{w['original']:.6g}, |candidate - oracle| {w['error']:.3g} > budget {w['budget']:.3g}"
    )
    cand_nan = cand.isnan() & oracle.isfinite()
    if bool(cand_nan.any()):
        hint = "the candidate gives NaN where the oracle is finite"
        if layout == "noncontiguous":
            hint += (
                " in the noncontiguous layout, whose hidden slots hold NaN: it reads memory outside its "
                "inputs' views (ignores strides or the storage offset); make it stride-aware or call "
                ".contiguous() on its inputs"
            )
        return f"{what}. Hint: {hint}"
    if q.n_over > q.numel // 2:
        return f"{what}. Most elements are off: the candidate computes a different function"
    return f"{what}. The candidate is less accurate than the original (or wrong at a few elements)"


__all__ = ["BudgetInputs", "check_meta", "compare_exact", "compare_reference", "same_values"]
