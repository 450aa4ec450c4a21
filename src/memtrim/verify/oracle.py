"""The oracle of a case: the reference run in float64 on the case's rounded inputs, traced op by op
(:mod:`memtrim.verify.magnitudes`) so that every output, gradient and updated input comes with its
magnitude S and its error bound E.

The oracle runs in the case's own layout, so a reference that draws random numbers draws them for the
same elements as the original does. A reference that draws none has the same oracle in every layout that
keeps the values; :class:`OracleCache` then shares it between those cases and drops it after the last.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

from memtrim.verify import magnitude_rules  # noqa: F401  (registers the rules)
from memtrim.verify.budget import Rounding, reorder_factor
from memtrim.verify.cases import Case, CaseInputs, expanded_values, upstream_like
from memtrim.verify.chunks import Index, chunks
from memtrim.verify.magnitudes import Tracer
from memtrim.verify.results import RunResult
from memtrim.verify.run import bits, run_callable

Tensors = list[torch.Tensor | None]
Source = Literal["traced", "supplied"]


@dataclass
class Upstream:
    """Canonical upstream gradients (per flat output) and second-order directions (per diff leaf)."""

    grads: Tensors | None
    dirs: Tensors | None

    def to(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Upstream:
        def m(ts: Tensors | None) -> Tensors | None:
            return None if ts is None else [None if t is None else fn(t) for t in ts]

        return Upstream(m(self.grads), m(self.dirs))


@dataclass
class Oracle:
    """The float64 run of the reference (``run``) and, per compared tensor, S and E in runs of the same
    shape (``s``, ``e``; None where the budget could not be derived, ``why_not`` says why)."""

    run: RunResult
    s: RunResult | None = None
    e: RunResult | None = None
    source: Source | None = None
    why_not: str | None = None
    layout: str = "contiguous"
    layout_specific: bool = False
    """True when the oracle holds for its own layout only (the reference draws random numbers, or the
    trace could not tell)."""


@contextlib.contextmanager
def _traced(tracer: Tracer) -> Iterator[None]:
    # scaled_dot_product_attention in its math form: the fused CPU kernel's backward has no decomposition.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH), tracer.mode:
        yield


def _call(
    fn: Callable[..., Any],
    inputs: CaseInputs,
    leaves: list[Any],
    up: Upstream,
    context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    *,
    laid_out: bool = True,
) -> RunResult:
    """``laid_out``: ``leaves`` are the case's inputs in float64 (whose bits are then compared with the
    canonical inputs', not with a copy made before the call)."""
    grads, dirs = up.grads, up.dirs
    return run_callable(
        fn,
        leaves,
        inputs.args,
        inputs.diff_index,
        grad_outputs=None if grads is None else (lambda outs: list(grads)),
        directions=None if dirs is None else (lambda gs: list(dirs)),
        seed=inputs.case.seed,
        context=context,
        originals=inputs.leaves if laid_out else None,
    )


def _leaves(inputs: CaseInputs, device: torch.device) -> list[Any]:
    return inputs.materialize(dtype=torch.float64, device=device)[0]


class AbsOf:
    """The magnitude S of a result whose S is ``|value|`` bit for bit (a result of a subtraction, of an
    elementwise function, ...): the value's absolute value, taken piece by piece where it is read
    (``s[index]``), instead of a float64 tensor the size of the result kept next to it."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    @property
    def shape(self) -> torch.Size:
        return self.value.shape

    def __getitem__(self, index: Index) -> torch.Tensor:
        return self.value[index].abs()

    def detach(self) -> AbsOf:
        return self

    def materialize(self) -> torch.Tensor:
        """S as a tensor (for tests and callers that want one)."""
        return self.value.abs()


Magnitude = torch.Tensor | AbsOf


def abs_of_value(s: torch.Tensor, value: torch.Tensor) -> Magnitude:
    """``AbsOf(value)`` where ``s`` holds the bits of ``|value|`` at every element (compared piece by
    piece, so no temporary is case-sized), else ``s``."""
    if s.shape != value.shape or value.dtype != torch.float64 or s.dtype != torch.float64:
        return s
    for _, index in chunks(s.shape):
        if not torch.equal(bits(s[index]), bits(value[index].abs())):
            return s
    return AbsOf(value)


def _shadow_runs(tracer: Tracer, run: RunResult, *, lazy_abs: bool = False) -> tuple[RunResult, RunResult]:
    """S and E of every tensor in ``run``, laid out as ``run`` is; then the tracer drops every other
    shadow (those of the reference's intermediates), so only the results' stay alive.

    ``lazy_abs`` (``run`` is the oracle's own run, kept with it): an S that is ``|value|`` bit for bit
    is kept as :class:`AbsOf` the value, and its tensor dropped."""

    def finals(ts: list[Any] | None) -> list[Any] | None:
        if ts is None:
            return None
        return [_final(t) if isinstance(t, torch.Tensor) else (t, t) for t in ts]

    def _final(t: torch.Tensor) -> tuple[Any, torch.Tensor]:
        s, e = tracer.final(t, copy=False)
        return (abs_of_value(s, t) if lazy_abs else s), e

    outs, grads, grads2, updates = (finals(x) for x in (run.outputs, run.grads, run.grads2, run.updates))
    tracer.clear()

    def pick(pairs: list[Any] | None, k: int) -> Any:
        return None if pairs is None else [p[k] for p in pairs]

    def one(k: int) -> RunResult:
        return RunResult(
            outputs=pick(outs, k),
            spec=run.spec,
            grads=pick(grads, k),
            grads2=pick(grads2, k),
            updates=pick(updates, k) or [],
        )

    return one(0), one(1)


def _why(error: Any, who: str) -> str:
    if error.type == "NotTraceable":
        return f"{who} uses {error.message} in {error.phase}"
    return f"tracing {who} failed: {error.describe()}"


def run_oracle(
    reference: Callable[..., Any],
    inputs: CaseInputs,
    up: Upstream,
    device: torch.device,
    rounding: Rounding,
    *,
    c: float,
    abs_reference: Callable[..., Any] | None = None,
    reduction_length: int | None = None,
) -> Oracle:
    """The reference in float64 on the case's rounded inputs (in the case's layout), with float64 upstream
    gradients, traced for S and E (the rounding of the case's dtype, ``rounding``).

    ``abs_reference``, when given, supplies the budget instead of the reference: it is traced the same way
    if it can be; otherwise it is called on ``|inputs|`` (its gradients with ``|upstream|``) and its result
    is S, with E the reordering allowance ``min(c*sqrt(n), gamma_n/u_acc) * u_acc * S`` for
    ``n = reduction_length``.
    """
    up64 = up.to(lambda t: t.to(device=device, dtype=torch.float64))
    tracer = Tracer(rounding, c)
    run = _call(reference, inputs, _leaves(inputs, device), up64, lambda: _traced(tracer))
    oracle = Oracle(run, layout=inputs.case.layout, layout_specific=tracer.rng_used)
    if run.error is not None and run.error.type in ("NotTraceable", "NotMultilinear"):
        oracle.why_not = _why(run.error, "the reference")
        oracle.layout_specific = True  # the trace stopped: whether it draws random numbers is unknown
        oracle.run = _call(reference, inputs, _leaves(inputs, device), up64)
    elif run.error is None:
        oracle.s, oracle.e = _shadow_runs(tracer, run, lazy_abs=True)
        oracle.source = "traced"
    if oracle.run.error is not None or abs_reference is None:
        return oracle
    oracle.s, oracle.e, oracle.source, oracle.why_not = None, None, "supplied", None
    tracer = Tracer(rounding, c)
    supplied = _call(abs_reference, inputs, _leaves(inputs, device), up64, lambda: _traced(tracer))
    if supplied.error is None:
        oracle.s, oracle.e = _shadow_runs(tracer, supplied)
        return oracle
    if supplied.error.type != "NotTraceable":
        oracle.why_not = _why(supplied.error, "abs_reference")
        return oracle
    if reduction_length is None:
        oracle.why_not = (
            _why(supplied.error, "abs_reference") + "; pass reduction_length= (products summed per element)"
        )
        return oracle
    abs_leaves = [
        x.detach().abs().requires_grad_(x.requires_grad) if _is_float(x) else x
        for x in _leaves(inputs, device)
    ]
    s = _call(abs_reference, inputs, abs_leaves, up64.to(torch.abs), laid_out=False)
    if s.error is not None:
        oracle.why_not = f"abs_reference raised {s.error.describe()}"
        return oracle
    allowance = float(reorder_factor(torch.tensor([float(reduction_length)]), rounding.u_acc, c)[0])
    oracle.s = s
    oracle.e = _scaled(s, allowance)
    return oracle


def _is_float(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _scaled(r: RunResult, factor: float) -> RunResult:
    def m(ts: Tensors | None) -> Tensors | None:
        return None if ts is None else [None if t is None else t * factor for t in ts]

    return RunResult(
        outputs=[o * factor if isinstance(o, torch.Tensor) else o for o in r.outputs],
        spec=r.spec,
        grads=m(r.grads),
        grads2=m(r.grads2),
        updates=m(r.updates) or [],
    )


def oracle_key(case: Case) -> Hashable:
    """Cases with equal keys share their oracle when the reference draws no random numbers: the same
    rounded inputs (every layout but ``expanded`` keeps the values) in the same dtype."""
    return (case.variant, case.dtype, case.seed, case.layout == "expanded", case.autocast)


def _group(key: Hashable) -> Hashable:
    """The cases of an oracle key and of its expanded twin: the same draws (the expanded layout repeats
    the first slice of the same values)."""
    assert isinstance(key, tuple)
    return key[:3] + key[4:]


@dataclass
class OracleCache:
    """Oracles shared by the cases that can use them, each dropped after the last case with its key.

    Built with the keys of every case to come, so at most the oracles of cases still to run are held;
    with the matrix in its order (dtype, then seed, then layout) that is one at a time.
    """

    keys: Iterable[Hashable] = ()

    def __post_init__(self) -> None:
        self._left: Counter[Hashable] = Counter(self.keys)
        self._held: dict[Hashable, Oracle] = {}
        # the canonical inputs and upstream draws of the (variant, dtype, seed) running now, kept
        # until its last case: drawing them is a good part of a small case's time
        self._group_left: Counter[Hashable] = Counter(_group(k) for k in self._left.elements())
        self._group: Hashable = None
        self._inputs: CaseInputs | None = None
        self._draws: dict[Hashable, torch.Tensor] = {}

    def inputs(self, case: Case, build: Callable[[Case], CaseInputs]) -> CaseInputs:
        """``case``'s canonical inputs: ``build(case)`` once per (variant, dtype, seed), in the
        contiguous layout's values; the expanded layout's repeat their first slice along
        :func:`~memtrim.verify.cases.expand_dim`, as :func:`~memtrim.verify.cases.build_inputs` makes
        them."""
        self._enter(_group(oracle_key(case)))
        if self._inputs is None:
            self._inputs = build(dataclasses.replace(case, layout="contiguous"))
        base = self._inputs
        leaves = base.leaves
        if case.layout == "expanded":
            leaves = [expanded_values(x) if isinstance(x, torch.Tensor) else x for x in leaves]
        return dataclasses.replace(base, case=case, leaves=leaves)

    def draw(self, case: Case, like: torch.Tensor, salt: int) -> torch.Tensor:
        """``upstream_like(like, case.seed, salt)``, drawn once per (variant, dtype, seed)."""
        self._enter(_group(oracle_key(case)))
        key = (tuple(like.shape), like.dtype, like.device, salt)
        if key not in self._draws:
            self._draws[key] = upstream_like(like, case.seed, salt)
        return self._draws[key]

    def _enter(self, group: Hashable) -> None:
        if group != self._group:
            self._group, self._inputs, self._draws = group, None, {}

    def get(self, key: Hashable, layout: str, make: Callable[[], Oracle]) -> Oracle:
        """The oracle for ``key`` in ``layout``, made on first use and kept while cases with this key
        remain (unless it holds for its own layout only)."""
        oracle = self._held.get(key)
        if oracle is None or (oracle.layout_specific and oracle.layout != layout):
            oracle = make()
            if self._left[key] > 1:
                self._held[key] = oracle
        return oracle

    def done(self, key: Hashable) -> None:
        """One case with ``key`` is finished (whether or not it needed the oracle)."""
        self._left[key] -= 1
        if self._left[key] <= 0:
            self._held.pop(key, None)
        self._group_left[_group(key)] -= 1
        if self._group_left[_group(key)] <= 0 and _group(key) == self._group:
            self._group, self._inputs, self._draws = None, None, {}

    def __len__(self) -> int:
        return len(self._held)


__all__ = ["AbsOf", "Oracle", "OracleCache", "Upstream", "oracle_key", "run_oracle"]
