"""The float64 oracle of a case, and S and n for its budget (traced, or from a user-supplied function).

The oracle is the reference run in float64 on the case's rounded inputs; S and n come from
:mod:`memtrim.verify.magnitudes`. :class:`OracleCache` shares one oracle between the cases that need
the same one and releases it after the last of them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from memtrim.verify.cases import Case, CaseInputs
from memtrim.verify.magnitudes import abs_mode
from memtrim.verify.results import RunResult
from memtrim.verify.run import run_callable

Tensors = list[torch.Tensor | None]


@dataclass
class Derived:
    """S and n for each output, gradient and second derivative (None where not derived), and why not."""

    s: RunResult | None
    n: RunResult | None
    source: str
    why_not: str | None = None


@dataclass
class Upstream:
    """Canonical upstream gradients (per flat output) and second-order directions (per diff leaf)."""

    grads: Tensors | None
    dirs: Tensors | None

    def to(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Upstream:
        def m(ts: Tensors | None) -> Tensors | None:
            return None if ts is None else [None if t is None else fn(t) for t in ts]

        return Upstream(m(self.grads), m(self.dirs))


def run_oracle(
    reference: Callable[..., Any], inputs: CaseInputs, up: Upstream, device: torch.device
) -> RunResult:
    """The reference in float64 on the case's rounded inputs (contiguous), with float64 upstream grads."""
    leaves, _ = inputs.materialize(layout="contiguous", dtype=torch.float64, device=device)
    up64 = up.to(lambda t: t.to(device=device, dtype=torch.float64))
    return _run(reference, inputs, leaves, up64)


def _run(fn: Callable[..., Any], inputs: CaseInputs, leaves: list[Any], up: Upstream) -> RunResult:
    grads, dirs = up.grads, up.dirs
    return run_callable(
        fn,
        leaves,
        inputs.args,
        inputs.diff_index,
        grad_outputs=None if grads is None else (lambda outs: list(grads)),
        directions=None if dirs is None else (lambda gs: list(dirs)),
        seed=inputs.case.seed,
    )


def _traced(
    fn: Callable[..., Any], inputs: CaseInputs, up: Upstream, device: torch.device, mode: str
) -> RunResult:
    """Run ``fn`` under the abs (S) or count (n) tracing mode on |inputs| or ones."""
    leaves, _ = inputs.materialize(layout="contiguous", dtype=torch.float64, device=device)

    def prep(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().to(device=device, dtype=torch.float64 if t.is_floating_point() else t.dtype)
        if not t.is_floating_point():
            return t
        return t.abs() if mode == "abs" else torch.ones_like(t)

    leaves = [prep(x).requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in leaves]
    up = up.to(prep)
    tracer, ctx = abs_mode(mode)
    for x in leaves:
        if isinstance(x, torch.Tensor):
            ctx.mark(x, leaf=True)
    for t in (up.grads or []) + (up.dirs or []):
        if t is not None:
            ctx.mark(t, leaf=True)
    with tracer:
        return _run(fn, inputs, leaves, up)


def derive(
    reference: Callable[..., Any],
    abs_reference: Callable[..., Any] | None,
    reduction_length: int | None,
    inputs: CaseInputs,
    up: Upstream,
    device: torch.device,
    count_cache: dict[Any, RunResult],
) -> Derived:
    """S by tracing ``abs_reference or reference`` on |inputs|; n by the same trace on ones.

    A supplied ``abs_reference`` that does not trace is called plainly on |inputs| (its gradients with
    |upstream| give S for the gradients); n then comes from ``reduction_length``.
    """
    fn = abs_reference or reference
    source = "supplied" if abs_reference is not None else "traced"
    s = _traced(fn, inputs, up, device, "abs")
    if s.error is not None and abs_reference is not None:
        s = _run(
            abs_reference, inputs, _abs_leaves(inputs, device), up.to(lambda t: t.abs().to(torch.float64))
        )
    if s.error is not None:
        return Derived(None, None, source, _why(s, fn is reference))
    key = (
        id(fn),
        inputs.case.variant,
        tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in inputs.leaves),
    )
    n = count_cache.get(key)
    if n is None:
        n = _traced(fn, inputs, up, device, "count")
        count_cache[key] = n
    if n.error is not None:
        if reduction_length is None:
            why = (
                _why(n, False) + "; pass reduction_length= (products summed per element) with abs_reference="
            )
            return Derived(None, None, source, why)
        n = _constant_n(s, reduction_length)
    return Derived(s, n, source)


def _abs_leaves(inputs: CaseInputs, device: torch.device) -> list[Any]:
    leaves, _ = inputs.materialize(layout="contiguous", dtype=torch.float64, device=device)
    return [
        x.detach().abs().requires_grad_(x.requires_grad)
        if isinstance(x, torch.Tensor) and x.is_floating_point()
        else x
        for x in leaves
    ]


def _constant_n(s: RunResult, n: int) -> RunResult:
    def fill(ts: Tensors | None) -> Tensors | None:
        return None if ts is None else [None if t is None else torch.full_like(t, float(n)) for t in ts]

    return RunResult(
        outputs=[torch.full_like(t, float(n)) if isinstance(t, torch.Tensor) else t for t in s.outputs],
        spec=s.spec,
        grads=fill(s.grads),
        grads2=fill(s.grads2),
    )


def _why(r: RunResult, is_reference: bool) -> str:
    assert r.error is not None
    who = "the reference" if is_reference else "abs_reference"
    if r.error.type == "NotMultilinear":
        return f"{who} uses {r.error.message} in {r.error.phase}"
    return f"tracing {who} failed: {r.error.describe()}"


def oracle_key(case: Case) -> Hashable:
    """Cases with equal keys have the same oracle: the same rounded inputs (layouts other than
    ``expanded`` keep the values) in the same dtype."""
    return (case.variant, case.dtype, case.seed, case.layout == "expanded", case.autocast)


@dataclass
class Oracle:
    """A case's oracle run and its derived budget inputs (None where the oracle raised)."""

    run: RunResult
    derived: Derived | None


@dataclass
class OracleCache:
    """Oracle runs (and traced counts, which depend only on shapes) shared by the cases that need them.

    Built with the keys of every case to come; an oracle is dropped after its last case, so at most
    the oracles of cases still to run are held, not the whole matrix's.
    """

    keys: Iterable[Hashable] = ()
    counts: dict[Any, RunResult] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._left: Counter[Hashable] = Counter(self.keys)
        self._held: dict[Hashable, Oracle] = {}

    def get(self, key: Hashable, make: Callable[[], Oracle]) -> Oracle:
        """The oracle for ``key``, made on first use and kept while cases with this key remain."""
        oracle = self._held.get(key)
        if oracle is None:
            oracle = make()
            if self._left[key] > 1:
                self._held[key] = oracle
        return oracle

    def done(self, key: Hashable) -> None:
        """One case with ``key`` is finished (whether or not it needed the oracle)."""
        self._left[key] -= 1
        if self._left[key] <= 0:
            self._held.pop(key, None)

    def __len__(self) -> int:
        return len(self._held)
