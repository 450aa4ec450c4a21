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
    oracle_share,
    rounding_for,
    tensorwise_budget,
)
from memtrim.verify.results import Quantity, QuantityKind
from memtrim.verify.run import same_bits

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
    """Elementwise numeric equality with NaN equal to NaN (so ``-0.0 == 0.0``; see ``same_bits``)."""
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
    """The same bits (NaN in the same places, any payload), so ``-0.0`` and ``+0.0`` differ; the
    offending indices and values if not.

    >>> q = compare_exact("output", "output", torch.tensor([0.0, -0.0]), torch.tensor([0.0, 0.0]))
    >>> q.passed, q.offending
    (False, [{'index': (1,), 'candidate': -0.0, 'reference': 0.0}])
    >>> "the other sign of zero" in q.message
    True
    """
    eq = same_bits(cand, ref)
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
    if q.max_abs_diff == 0 and cand.is_floating_point():
        q.message += " (the same value with the other sign of zero: bit-exact means the same bits)"
    if kind == "update":
        q.message += f"; {_update_hint(name)}"
    return q


def _update_hint(name: str) -> str:
    return f"the candidate updates {name.removesuffix(' (updated in place)')} differently from the reference"


@dataclass
class BudgetInputs:
    """What the reference-mode judgement needs besides the candidate: the original, the oracle, and
    the oracle's magnitude S and error bound E (None where the budget could not be derived)."""

    orig: torch.Tensor
    oracle: torch.Tensor
    s: torch.Tensor | None
    e: torch.Tensor | None
    source: str
    case_dtype: torch.dtype | None
    autocast: bool


def compare_reference(
    name: str, kind: QuantityKind, cand: torch.Tensor, b: BudgetInputs, *, layout: str
) -> Quantity:
    """Judge ``cand`` against the float64 oracle with the rounding budget of :mod:`memtrim.verify.budget`."""
    if not (cand.is_floating_point() and b.orig.is_floating_point()):
        return compare_exact(name, kind, cand, b.orig)
    exact = bool(same_bits(cand, b.orig).all())
    out_r = rounding_for(cand.dtype)
    case_r: Rounding = rounding_for(b.case_dtype or cand.dtype, autocast=b.autocast)
    k = K_FACTORS[kind]
    # Judge on the oracle's device (CPU when the case runs on MPS, which has no float64). Written to
    # make few passes over the data and free each float64 temporary early: these tensors are case-sized.
    dev = b.oracle.device
    oracle = b.oracle.to(dtype=torch.float64)
    cand, orig = cand.to(dev), b.orig.to(dev)
    err = (cand.to(torch.float64) - oracle).abs_()  # (a subtraction: never in place on the inputs)
    orig_err = (orig.to(torch.float64) - oracle).abs_()
    q = Quantity(name, kind, passed=True, rule="", exact=exact, numel=cand.numel())
    q.u_out, q.u, q.u_acc = out_r.u, case_r.u, case_r.u_acc
    finite = oracle.isfinite()
    all_finite = bool(finite.all())
    if all_finite:  # equal values are exactly the zero errors
        same_c, same_o = err == 0, orig_err == 0
    else:
        same_c = same_values(cand.to(torch.float64), oracle)
        same_o = same_values(orig.to(torch.float64), oracle)
    rtol, atol = assert_close_tolerances(cand, oracle)
    q.assert_close, q.assert_close_msg = assert_close_verdict(err, oracle, same_c, rtol, atol)
    q.assert_close_orig, _ = assert_close_verdict(orig_err, oracle, same_o, rtol, atol)
    if cand.numel() == 0:
        q.rule = "empty"
        return q
    if b.s is not None and b.e is not None:
        s = b.s.to(device=dev, dtype=torch.float64)
        budget = elementwise_budget(
            orig_err,
            oracle,
            b.e.to(device=dev, dtype=torch.float64),
            k=k,
            u_out=out_r.u,
            oracle_share=oracle_share(case_r),
            eta_out=out_r.eta,
        )
        q.rule = f"per element, budget {b.source}"
        pos = s > 0
        if bool(pos.any()):
            q.norm_err = _max_ratio(err, s, pos)
            q.norm_err_orig = _max_ratio(orig_err, s, pos)
    else:
        # Elements where the original overflowed (or is NaN) are not held against the candidate's max.
        orig_ok = orig_err.isfinite() | ~finite
        top = tensorwise_budget(orig_err[finite & orig_ok], oracle, k=k, u_out=out_r.u)
        budget = torch.full_like(err, top).masked_fill_(~orig_ok, float("inf"))
        q.rule = "k-times rule on maxima (no budget)"
    del orig_err
    ok = err <= budget  # NaN error compares False: fails
    if not all_finite:
        # Where the oracle itself is not finite, the candidate must match it or the original exactly.
        nonfinite_ok = same_c | same_values(cand.to(torch.float64), orig.to(torch.float64))
        ok = torch.where(finite, ok, nonfinite_ok)
    judged = finite & (budget > 0) & budget.isfinite()
    if bool(judged.any()):
        q.budget_used = _max_ratio(err, budget, judged)
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


def _max_ratio(num: torch.Tensor, den: torch.Tensor, where: torch.Tensor) -> float:
    """max of ``num / den`` over ``where`` (NaN counts as infinite)."""
    ratio = torch.where(where, num / den, 0.0)
    return float(ratio.nan_to_num_(nan=float("inf")).max())


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
    if q.kind == "update":
        return f"{what}. {_update_hint(q.name).capitalize()}"
    if q.n_over > q.numel // 2:
        return f"{what}. Most elements are off: the candidate computes a different function"
    return f"{what}. The candidate is less accurate than the original (or wrong at a few elements)"


def row_extreme_hint(x: Any, indices: list[tuple[int, ...]], input_name: str) -> str | None:
    """Where a gradient fails only at elements that are each the largest (or smallest) of their row of
    the input, say so: a rewrite that subtracts the row max and adds it back (a manual logsumexp or
    softmax) sends that element's gradient through ``amax``, where it comes out as ``1 - sum(softmax)``,
    a difference of nearly equal terms that rounds at the scale of the row rather than of the element."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() == 0 or not indices:
        return None
    if any(len(i) != x.dim() for i in indices):
        return None
    for dim in reversed(range(x.dim())):
        if x.shape[dim] < 4:  # in a row of 2 or 3, being its max proves nothing
            continue
        extremes = ((x.amax(dim, keepdim=True), "largest"), (x.amin(dim, keepdim=True), "smallest"))
        for extreme, word in extremes:
            top = extreme.expand_as(x)
            if all(bool(x[i] == top[i]) for i in indices):
                many = f"each failing element shown ({len(indices)}) is"
                shown = "the failing element is" if len(indices) == 1 else many
                return (
                    f"Where: {shown} the {word} of its row (dim {dim}) of {input_name}. A candidate that "
                    "subtracts the row max and adds it back (a manual logsumexp or softmax) sends that "
                    "element's gradient through amax, where it comes out as 1 - sum(softmax): a difference "
                    "of nearly equal terms, rounded at the scale of the row rather than of the element"
                )
    return None


__all__ = [
    "BudgetInputs",
    "check_meta",
    "compare_exact",
    "compare_reference",
    "row_extreme_hint",
    "same_bits",
    "same_values",
]
