"""Judge one case of the matrix: run both callables (:mod:`.run`), check structure and side effects,
then compare every output and gradient (:mod:`.compare`), bit for bit or against the oracle
(:mod:`.oracle`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.utils._pytree import tree_unflatten

from memtrim.verify.budget import NoRoundingRule, rounding_for
from memtrim.verify.cases import (
    Case,
    CaseInputs,
    InputError,
    InputsSpec,
    apply_layout,
    build_inputs,
    expanded_values,
    leaf_names,
)
from memtrim.verify.compare import (
    BudgetInputs,
    check_meta,
    compare_exact,
    compare_reference,
    row_extreme_hint,
)
from memtrim.verify.config import Settings
from memtrim.verify.oracle import (
    AbsOf,
    Magnitude,
    Oracle,
    OracleCache,
    Upstream,
    oracle_key,
    run_oracle,
)
from memtrim.verify.results import CaseResult, Failure, FailureKind, QuantityKind, RunResult
from memtrim.verify.run import measure, run_callable

INPLACE_HINT = (
    "an in-place op overwrote a tensor that autograd saved for backward; clone it before modifying it, or "
    "keep the out-of-place op"
)


def run_case(
    st: Settings, cache: OracleCache, case: Case, spec: InputsSpec
) -> tuple[CaseResult, list[Failure]]:
    """Run and judge ``case``; its result and the failures found (each naming the case and the fix)."""
    t0 = time.perf_counter()
    res = CaseResult(case)
    fails: list[Failure] = []

    def fail(what: str, kind: FailureKind, message: str, **details: Any) -> None:
        fails.append(Failure(case.id, what, kind, f"{message} (case {case.id})", details))

    try:
        _run_case(st, cache, case, spec, res, fail)
    except InputError as exc:
        fail("inputs", "inputs", str(exc))
    except NoRoundingRule as exc:
        fail("budget", "budget", str(exc))
    finally:
        cache.done(oracle_key(case))
    if fails:
        res.status = "failed"
        res.note = res.note or fails[0].what
    res.seconds = time.perf_counter() - t0
    return res, fails


def _forward_context(case: Case, device: torch.device) -> Callable[[], AbstractContextManager[Any]]:
    if not case.autocast:
        return contextlib.nullcontext
    assert case.dtype is not None
    dtype = case.dtype
    return lambda: torch.autocast(device.type, dtype=dtype)


def _run_case(
    st: Settings,
    cache: OracleCache,
    case: Case,
    spec: InputsSpec,
    res: CaseResult,
    fail: Callable[..., None],
) -> None:
    inputs = cache.inputs(case, lambda c: build_inputs(spec, c, st.device))
    fwd = _forward_context(case, st.device)
    canon = Upstream(None, None)

    def laid(ts: list[torch.Tensor | None] | None) -> list[torch.Tensor | None] | None:
        return None if ts is None else [None if t is None else apply_layout(t, case.layout)[0] for t in ts]

    def make_grads(outs: list[Any]) -> list[torch.Tensor | None]:
        gs = [
            cache.draw(case, o, j) if isinstance(o, torch.Tensor) and o.requires_grad else None
            for j, o in enumerate(outs)
        ]
        if case.layout == "expanded":
            gs = [None if g is None else expanded_values(g) for g in gs]
        canon.grads = gs
        return laid(gs) or []

    def make_dirs(grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        ds = [None if g is None else cache.draw(case, g, 100 + k) for k, g in enumerate(grads)]
        if case.layout == "expanded":
            ds = [None if d is None else expanded_values(d) for d in ds]
        canon.dirs = ds
        return laid(ds) or []

    diff = inputs.diff_index if st.grads else []
    leaves, guards = inputs.materialize()
    orig = run_callable(
        st.reference,
        leaves,
        inputs.args,
        diff,
        grad_outputs=make_grads if diff else None,
        directions=make_dirs if diff and st.second_order else None,
        guards=guards,
        forward_context=fwd,
        seed=case.seed,
        originals=inputs.leaves,
    )
    del leaves, guards  # what the run changed is in orig.updates; the rest is not needed again
    if orig.error is not None:
        if case.layout != "contiguous":
            res.status, res.note = (
                "skipped",
                f"reference rejects {case.layout} inputs: {orig.error.describe()}",
            )
            return
        fail(
            "reference",
            "reference",
            f"the reference raised {orig.error.describe()}; verify needs a reference "
            "that runs on these inputs",
        )
        return
    out_names = leaf_names(orig.spec, "output")
    for name, o in zip(out_names, orig.outputs, strict=True):
        if not isinstance(o, torch.Tensor):
            fail(
                name,
                "output-type",
                f"reference {name} is {_a(type(o).__name__)}, not a tensor; verify compares "
                "tensors: make both callables return tensors only (wrap them to drop or tensorize the rest)",
            )
            return

    # In reference mode every case needs the oracle: made before the candidate runs, so that the
    # oracle's trace (its intermediates and their shadows) and the candidate's results are never alive
    # together. (In auto mode it is made only where the results are not bit-exact, after the candidate.)
    oracle = _oracle(st, cache, case, inputs, canon) if st.mode == "reference" else None
    leaves_c, guards_c = inputs.materialize()
    cand = run_callable(
        st.candidate,
        leaves_c,
        inputs.args,
        diff,
        grad_outputs=(lambda outs: laid(canon.grads) or []) if diff else None,
        directions=(lambda gs: laid(canon.dirs) or []) if diff and st.second_order else None,
        guards=guards_c,
        forward_context=fwd,
        seed=case.seed,
        originals=inputs.leaves,
    )
    del leaves_c, guards_c
    if cand.error is not None:
        hint = f"; {INPLACE_HINT}" if "modified by an inplace operation" in cand.error.message else ""
        fail(
            "candidate raised",
            "exception",
            f"the candidate raised {cand.error.describe()} (the reference did not){hint}",
            error=cand.error.__dict__,
        )
        return
    if cand.spec != orig.spec:
        fail(
            "structure",
            "structure",
            f"the candidate returned {_describe(cand)} but the reference returned "
            f"{_describe(orig)}; make both callables return the same structure",
        )
        return
    for name, o in zip(out_names, cand.outputs, strict=True):
        if not isinstance(o, torch.Tensor):
            fail(
                name,
                "output-type",
                f"candidate {name} is {_a(type(o).__name__)}, not a tensor like the "
                "reference's; make both callables return tensors in the same places",
            )
            return
    if not _side_effects(inputs, orig, cand, res, fail):
        return
    pairs = _pairs(inputs, orig, cand, out_names, fail)
    if st.memory:
        res.memory_ref = _measure(st.reference, inputs, diff, canon, laid, fwd)
        res.memory_cand = _measure(st.candidate, inputs, diff, canon, laid, fwd)
    if not pairs:
        return
    exact_qs = [compare_exact(n, k, c, o) for n, k, c, o, _ in pairs] if st.mode != "reference" else []
    if st.mode == "exact" or (exact_qs and all(q.passed for q in exact_qs)):
        res.quantities = exact_qs
        for q in exact_qs:
            if not q.passed:
                fail(
                    q.name,
                    "mismatch",
                    f"{q.message}; mode='exact' demands bit-exact results (use "
                    "mode='reference' to accept rounding differences)",
                    offending=q.offending,
                )
        res.held = "exact" if all(q.passed for q in exact_qs) else None
        return
    _judge_reference(st, cache, case, inputs, canon, orig, pairs, res, fail, oracle)


def _side_effects(
    inputs: CaseInputs, orig: RunResult, cand: RunResult, res: CaseResult, fail: Callable[..., None]
) -> bool:
    names = inputs.names
    ok = True
    for i in sorted(set(cand.poisoned) - set(orig.poisoned)):
        fail(
            names[i],
            "out-of-bounds write",
            f"the candidate wrote into the hidden NaN slots around {names[i]} "
            "(noncontiguous layout): it writes outside the tensor's view, ignoring its strides",
        )
        ok = False
    for i in sorted(set(cand.mutated) - set(orig.mutated)):
        how = (
            "through .data or a detached alias (its version counter did not change, so autograd cannot "
            "see it either)"
            if i in cand.mutated_silently
            else "in place (its version counter changed)"
        )
        fail(
            names[i],
            "mutation",
            f"the candidate modifies {names[i]} {how} but the reference does not; clone it first, or the "
            "caller's tensor changes under them",
        )
        ok = False
    for i in sorted(set(orig.mutated) - set(cand.mutated)):
        fail(
            f"{names[i]} (updated in place)",
            "update",
            f"the reference updates {names[i]} in place but the candidate leaves it unchanged; make the "
            "candidate write the same update",
        )
        ok = False
    out_names = leaf_names(orig.spec, "output")
    for j, (o, c) in enumerate(zip(orig.aliases, cand.aliases, strict=False)):
        if c is not None and o != c:
            theirs = "a fresh tensor" if o is None else f"a view of {names[o]}"
            fail(
                out_names[j],
                "aliasing",
                f"candidate {out_names[j]} shares memory with {names[c]} (it is a view of it, or the input "
                f"itself) while the reference's is {theirs}: writing to one changes the other; return a "
                "copy (.clone()) if callers may write to either",
            )
            ok = False
        elif o is not None and c is None:
            res.remarks.append(
                f"the candidate's {out_names[j]} is a fresh tensor where the reference's is a view of "
                f"{names[o]}: it costs memory, and writes to it no longer reach the input"
            )
    for j in cand.detached:
        fail(
            out_names[j],
            "detached",
            f"candidate {out_names[j]} does not require grad but the reference's "
            "does: the candidate cuts it from the autograd graph (.detach(), torch.no_grad(), .data or a "
            "non-differentiable op), so no gradient flows to the inputs",
        )
        ok = False
    for k in sorted(set(cand.not_differentiable) - set(orig.not_differentiable)):
        name = names[inputs.diff_index[k]]
        fail(
            f"grad of {name}",
            "detached",
            f"the candidate's gradient of {name} cannot be differentiated "
            "again while the reference's can: its backward is not built from differentiable ops",
        )
        ok = False
    return ok


def _pairs(
    inputs: CaseInputs, orig: RunResult, cand: RunResult, out_names: list[str], fail: Callable[..., None]
) -> list[tuple[str, QuantityKind, torch.Tensor, torch.Tensor, tuple[str, int]]]:
    """(name, kind, candidate, original, where-in-oracle) for every tensor to compare; meta failures."""
    pairs: list[tuple[str, QuantityKind, torch.Tensor, torch.Tensor, tuple[str, int]]] = []
    ok = True
    for j, (name, c, o) in enumerate(zip(out_names, cand.outputs, orig.outputs, strict=True)):
        msg = check_meta(name, c, o)
        if msg:
            fail(name, "meta", msg)
            ok = False
        else:
            pairs.append((name, "output", c, o, ("outputs", j)))
    names = inputs.names
    for i in orig.mutated:
        o, c = orig.updates[i], cand.updates[i] if i < len(cand.updates) else None
        if o is None or c is None:
            continue
        name = f"{names[i]} (updated in place)"
        msg = check_meta(name, c, o)
        if msg:
            fail(name, "meta", msg)
            ok = False
        else:
            pairs.append((name, "update", c, o, ("updates", i)))
    grad_kinds: tuple[tuple[str, QuantityKind, str], ...] = (
        ("grads", "grad", "grad of"),
        ("grads2", "grad2", "2nd derivative of"),
    )
    for field_, kind, label in grad_kinds:
        og, cg = getattr(orig, field_), getattr(cand, field_)
        if og is None or cg is None:
            continue
        for k, (o, c) in enumerate(zip(og, cg, strict=True)):
            name = f"{label} {names[inputs.diff_index[k]]}"
            if o is None and c is None:
                continue
            if c is None:
                assert o is not None
                if bool((o != 0).any()):
                    fail(
                        name,
                        "no-grad",
                        f"the candidate gives no {name} (None) but the reference's is "
                        "nonzero: a .detach(), torch.no_grad() or .data in the candidate breaks the graph",
                    )
                    ok = False
                    continue
                c = torch.zeros_like(o)
            if o is None:
                o = torch.zeros_like(c)
            msg = check_meta(name, c, o)
            if msg:
                fail(name, "meta", msg)
                ok = False
            else:
                pairs.append((name, kind, c, o, (field_, k)))
    return pairs if ok else []


def _judge_reference(
    st: Settings,
    cache: OracleCache,
    case: Case,
    inputs: CaseInputs,
    canon: Upstream,
    orig: RunResult,
    pairs: list[tuple[str, QuantityKind, torch.Tensor, torch.Tensor, tuple[str, int]]],
    res: CaseResult,
    fail: Callable[..., None],
    oracle: Oracle | None = None,
) -> None:
    """``oracle``: the case's oracle where it was made already (:func:`_oracle`)."""
    if oracle is None:
        oracle = _oracle(st, cache, case, inputs, canon, early=False)
    assert oracle is not None
    if oracle.run.error is not None:
        fail(
            "oracle",
            "reference",
            f"the reference raised in float64 (the oracle): {oracle.run.error.describe()}; reference mode "
            "needs a reference that runs in float64 (use mode='exact' otherwise)",
        )
        return
    if oracle.why_not:
        res.budget_note = oracle.why_not
    for name, kind, c, o, (field_, idx) in pairs:
        ora = _get(oracle.run, field_, idx, o)
        if ora.shape != o.shape:
            fail(
                name,
                "reference",
                f"the reference's float64 {name} has shape {tuple(ora.shape)}, not "
                f"{tuple(o.shape)}: the reference behaves differently in float64",
            )
            continue
        s = _magnitude(oracle.s, field_, idx, o) if oracle.s is not None else None
        e = _get(oracle.e, field_, idx, o) if oracle.e is not None else None
        b = BudgetInputs(o, ora, s, e, oracle.source or "", case.dtype, case.autocast)
        q = compare_reference(name, kind, c, b, layout=case.layout)
        if not q.passed and kind == "grad" and field_ == "grads":
            leaf = inputs.leaves[inputs.diff_index[idx]]
            hint = row_extreme_hint(leaf, [w["index"] for w in q.offending], name.removeprefix("grad of "))
            if hint:
                q.message += ". " + hint
        res.quantities.append(q)
        if not q.passed:
            fail(name, "mismatch", q.message, offending=q.offending)
    if all(q.passed for q in res.quantities):
        res.held = "reference"


def _oracle(
    st: Settings, cache: OracleCache, case: Case, inputs: CaseInputs, canon: Upstream, *, early: bool = True
) -> Oracle | None:
    """The case's oracle (from ``cache`` where another case made it). ``early``: made before the
    candidate runs, so None where the case's dtype has no rounding rule or making it raised (the
    judgement then makes it again and raises where it always did, after the candidate's checks)."""
    try:
        rounding = rounding_for(case.dtype or torch.get_default_dtype(), autocast=case.autocast)
    except NoRoundingRule:
        if early:
            return None
        raise

    def make() -> Oracle:
        return run_oracle(
            st.reference,
            inputs,
            canon,
            st.oracle_device,
            rounding,
            c=st.c,
            abs_reference=st.abs_reference,
            reduction_length=st.reduction_length,
        )

    if not early:
        return cache.get(oracle_key(case), case.layout, make)
    try:
        return cache.get(oracle_key(case), case.layout, make)
    except Exception:  # raised where it always was: after the candidate's checks, by the late call
        return None


def _get(r: RunResult | None, field_: str, idx: int, like: torch.Tensor) -> torch.Tensor:
    seq = getattr(r, field_) if r is not None else None
    t = seq[idx] if seq is not None and idx < len(seq) else None
    if t is None:  # unused input: exactly zero
        return torch.zeros(like.shape, dtype=torch.float64, device=like.device)
    return t.detach()


def _magnitude(r: RunResult, field_: str, idx: int, like: torch.Tensor) -> Magnitude:
    """The oracle's S of a compared tensor: a tensor, or :class:`AbsOf` the oracle's value."""
    seq = getattr(r, field_)
    t = seq[idx] if seq is not None and idx < len(seq) else None
    return t if isinstance(t, AbsOf) else _get(r, field_, idx, like)


def _measure(
    fn: Callable[..., Any],
    inputs: CaseInputs,
    diff: list[int],
    canon: Upstream,
    laid: Callable[[Any], Any],
    fwd: Callable[[], AbstractContextManager[Any]],
) -> Any:
    leaves, _ = inputs.materialize()
    grads, dirs = laid(canon.grads), laid(canon.dirs)
    return measure(
        lambda: run_callable(
            fn,
            leaves,
            inputs.args,
            diff,
            grad_outputs=(lambda outs: list(grads)) if grads is not None else None,
            directions=(lambda gs: list(dirs)) if dirs is not None else None,
            forward_context=fwd,
            seed=inputs.case.seed,
            watch_inputs=False,
        )
    )


def _a(word: str) -> str:
    return f"an {word}" if word[:1].lower() in "aeiou" else f"a {word}"


def _describe(r: RunResult) -> str:
    tree = tree_unflatten(r.outputs, r.spec)
    return _describe_tree(tree)


def _describe_tree(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return "a single tensor"
    if isinstance(x, (tuple, list)):
        kinds = {type(v).__name__ for v in x}
        what = "tensors" if kinds == {"Tensor"} else "items (" + ", ".join(sorted(kinds)) + ")"
        return f"a {type(x).__name__} of {len(x)} {what}"
    if isinstance(x, dict):
        return f"a dict with keys {sorted(map(str, x))}"
    return f"a {type(x).__name__}"


__all__ = ["run_case"]
