"""Compare one candidate tensor with the reference's: bit-exact, or against the derived rounding budget."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from memtrim.trace import dtype_name
from memtrim.verify.budget import (
    K_FACTORS,
    Rounding,
    assert_close_mismatches,
    assert_close_outcome,
    assert_close_tolerances,
    elementwise_budget,
    oracle_share,
    rounding_for,
    tensorwise_budget_of,
)
from memtrim.verify.chunks import Index, chunks
from memtrim.verify.results import Quantity, QuantityKind
from memtrim.verify.run import same_bits

if TYPE_CHECKING:
    from memtrim.verify.oracle import Magnitude

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
    the oracle's magnitude S and error bound E (None where the budget could not be derived). S may be an
    :class:`~memtrim.verify.oracle.AbsOf` the oracle (read piece by piece, ``s[index]``)."""

    orig: torch.Tensor
    oracle: torch.Tensor
    s: Magnitude | None
    e: torch.Tensor | None
    source: str
    case_dtype: torch.dtype | None
    autocast: bool


def compare_reference(
    name: str, kind: QuantityKind, cand: torch.Tensor, b: BudgetInputs, *, layout: str
) -> Quantity:
    """Judge ``cand`` against the float64 oracle with the rounding budget of :mod:`memtrim.verify.budget`.

    The tensors are judged piece by piece (:mod:`memtrim.verify.chunks`), so the float64 temporaries of
    the judgement are each at most :data:`~memtrim.verify.chunks.CHUNK_ELEMENTS` elements whatever the
    tensor's size; every figure is a count, a maximum or a list of elements, so it is the same as over
    the whole tensor at once.
    """
    if not (cand.is_floating_point() and b.orig.is_floating_point()):
        return compare_exact(name, kind, cand, b.orig)
    out_r = rounding_for(cand.dtype)
    case_r: Rounding = rounding_for(b.case_dtype or cand.dtype, autocast=b.autocast)
    # Judge on the oracle's device (CPU when the case runs on MPS, which has no float64).
    dev = b.oracle.device
    rtol, atol = assert_close_tolerances(cand, torch.empty(0, dtype=torch.float64))
    q = Quantity(name, kind, passed=True, rule="", exact=True, numel=cand.numel())
    q.u_out, q.u, q.u_acc = out_r.u, case_r.u, case_r.u_acc
    judge = _PieceJudge(cand, b, dev, K_FACTORS[kind], out_r, case_r)
    if judge.traced:
        q.rule = f"per element, budget {b.source}"
    else:
        judge.tensorwise_maxima()
        q.rule = "k-times rule on maxima (no budget)"
    close_bad = close_bad_orig = n_over = 0
    norm: list[float] = []
    norm_orig: list[float] = []
    used: list[float] = []
    max_abs: list[float] = []
    bads: list[torch.Tensor] = []
    ratios: list[torch.Tensor] = []
    cand_nan = False
    for offset, index in chunks(cand.shape):
        p = judge.piece(index)
        q.exact = q.exact and bool(same_bits(cand[index], b.orig[index]).all())
        close_bad += assert_close_mismatches(p.err, p.oracle, p.same_c, rtol, atol)
        close_bad_orig += assert_close_mismatches(p.orig_err, p.oracle, p.same_o, rtol, atol)
        if cand.numel() == 0:
            break
        if p.s is not None and p.pos is not None and bool(p.pos.any()):
            norm.append(_max_ratio(p.err, p.s, p.pos))
            norm_orig.append(_max_ratio(p.orig_err, p.s, p.pos))
        judged = p.finite & (p.budget > 0) & p.budget.isfinite()
        if bool(judged.any()):
            used.append(_max_ratio(p.err, p.budget, judged))
        bad = (~p.ok).reshape(-1).nonzero().reshape(-1)
        n_over += int(bad.numel())
        max_abs.append(float(p.err.nan_to_num(nan=float("inf")).max()))
        if bad.numel():
            bads.append(bad + offset)
            ratios.append((p.err - p.budget).reshape(-1)[bad].nan_to_num(nan=float("inf")))
        cand_nan = cand_nan or bool((p.cand.isnan() & p.finite).any())
    q.assert_close, q.assert_close_msg = assert_close_outcome(close_bad, cand.numel(), rtol, atol)
    q.assert_close_orig, _ = assert_close_outcome(close_bad_orig, cand.numel(), rtol, atol)
    if cand.numel() == 0:
        q.rule = "empty"
        return q
    if norm:
        q.norm_err, q.norm_err_orig = max(norm), max(norm_orig)
    if used:
        q.budget_used = max(used)
    q.n_over = n_over
    q.max_abs_diff = max(max_abs)
    q.passed = q.n_over == 0
    if q.passed:
        return q
    bad_all, ratio = torch.cat(bads), torch.cat(ratios)
    order = bad_all[ratio.argsort(descending=True)][:MAX_SHOWN].tolist()
    pieces = list(chunks(cand.shape))
    starts = [offset for offset, _ in pieces]
    for flat in order:
        offset, index = pieces[bisect.bisect_right(starts, flat) - 1]
        p, at = judge.piece(index), flat - offset
        q.offending.append(
            {
                "index": _index(flat, cand.shape),
                "candidate": _val(p.cand, at),
                "oracle": _val(p.oracle, at),
                "original": _val(b.orig[index], at),
                "error": _val(p.err, at),
                "budget": _val(p.budget, at),
            }
        )
    q.worst = q.offending[0]
    q.message = _reference_message(q, cand_nan, layout)
    return q


@dataclass
class _Piece:
    """One piece of a judged tensor (float64 on the oracle's device, except ``cand``)."""

    cand: torch.Tensor
    oracle: torch.Tensor
    err: torch.Tensor
    orig_err: torch.Tensor
    finite: torch.Tensor
    same_c: torch.Tensor
    same_o: torch.Tensor
    s: torch.Tensor | None
    pos: torch.Tensor | None
    budget: torch.Tensor
    ok: torch.Tensor


class _PieceJudge:
    """The per-element judgement of :func:`compare_reference`, on one piece of the tensors at a time."""

    def __init__(
        self,
        cand: torch.Tensor,
        b: BudgetInputs,
        dev: torch.device,
        k: float,
        out_r: Rounding,
        case_r: Rounding,
    ) -> None:
        self.cand, self.b, self.dev, self.k, self.out_r, self.case_r = cand, b, dev, k, out_r, case_r
        self.traced = b.s is not None and b.e is not None
        self.top = 0.0  # the k-times rule's budget, when there is no traced one

    def _values(self, index: Index) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(candidate on the oracle's device, oracle, original on the oracle's device) of a piece."""
        oracle = self.b.oracle[index].to(dtype=torch.float64)
        return self.cand[index].to(self.dev), oracle, self.b.orig[index].to(self.dev)

    def tensorwise_maxima(self) -> None:
        """The k-times rule's budget: ``max|orig - oracle|`` and ``max|oracle|`` over the finite
        elements (those where the original overflowed, or is NaN, are not held against the candidate)."""
        worst = top = 0.0
        for _, index in chunks(self.cand.shape):
            _, oracle, orig = self._values(index)
            orig_err = (orig.to(torch.float64) - oracle).abs_()
            finite = oracle.isfinite()
            held = orig_err[finite & (orig_err.isfinite() | ~finite)]
            if held.numel():
                worst = max(worst, float(held.max()))
            kept = oracle[finite]
            if kept.numel():
                top = max(top, float(kept.abs().max()))
        self.top = tensorwise_budget_of(worst, top, k=self.k, u_out=self.out_r.u)

    def piece(self, index: Index) -> _Piece:
        cand, oracle, orig = self._values(index)
        cand64, orig64 = cand.to(torch.float64), orig.to(torch.float64)
        err = (cand64 - oracle).abs_()  # (a subtraction: never in place on the inputs)
        orig_err = (orig64 - oracle).abs_()
        finite = oracle.isfinite()
        all_finite = bool(finite.all())
        if all_finite:  # equal values are exactly the zero errors
            same_c, same_o = err == 0, orig_err == 0
        else:
            same_c, same_o = same_values(cand64, oracle), same_values(orig64, oracle)
        s = pos = None
        if self.traced:
            assert self.b.s is not None and self.b.e is not None
            s = self.b.s[index].to(device=self.dev, dtype=torch.float64)
            budget = elementwise_budget(
                orig_err,
                oracle,
                self.b.e[index].to(device=self.dev, dtype=torch.float64),
                k=self.k,
                u_out=self.out_r.u,
                oracle_share=oracle_share(self.case_r),
                eta_out=self.out_r.eta,
            )
            pos = s > 0
        else:
            orig_ok = orig_err.isfinite() | ~finite
            budget = torch.full_like(err, self.top).masked_fill_(~orig_ok, float("inf"))
        ok = err <= budget  # NaN error compares False: fails
        if not all_finite:
            # Where the oracle itself is not finite, the candidate must match it or the original exactly.
            ok = torch.where(finite, ok, same_c | same_values(cand64, orig64))
        return _Piece(cand, oracle, err, orig_err, finite, same_c, same_o, s, pos, budget, ok)


def _max_ratio(num: torch.Tensor, den: torch.Tensor, where: torch.Tensor) -> float:
    """max of ``num / den`` over ``where`` (NaN counts as infinite)."""
    ratio = torch.where(where, num / den, 0.0)
    return float(ratio.nan_to_num_(nan=float("inf")).max())


def _reference_message(q: Quantity, cand_nan: bool, layout: str) -> str:
    """``cand_nan``: the candidate gives NaN somewhere the oracle is finite."""
    w = q.worst
    assert w is not None
    what = (
        f"{q.name}: {q.n_over} of {q.numel} elements exceed the rounding budget ({q.rule}); worst at "
        f"{w['index']}: candidate {w['candidate']:.6g}, oracle (float64) {w['oracle']:.6g}, original "
        f"{w['original']:.6g}, |candidate - oracle| {w['error']:.3g} > budget {w['budget']:.3g}"
    )
    if cand_nan:
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
