"""The rounding budget of reference mode: rounding rules per dtype (registries of small functions, as
``torch/utils/flop_counter.py`` keeps its formulas) and the per-element rule.

A candidate in ``reference`` mode passes an element where

    |cand - oracle| <= k * |orig - oracle| + (1 + r) * (E + u_out * |oracle| + eta_out)

``orig`` is the reference run in the case's dtype, ``oracle`` the reference in float64 on the same rounded
inputs, and E the first-order bound on the rounding error of the reference's computation in the case's
precision, traced op by op (:mod:`memtrim.verify.magnitudes`): every step rounded to the storage dtype
(``u``), every reduction of N terms accumulated in any order (``min(c*sqrt(N), N) * u_acc * S``),
transcendental functions within their documented ulps, incoming errors carried through each op's
derivative. A correct rewrite that stores no more roundings than the reference's op-by-op form errs by
at most E; so does the oracle itself in float64, which is what the ``(1 + r)`` covers, with
``r = u_fp64 / min(u, u_acc)`` (1 for fp64 cases, whose original *is* the oracle; below 2**-29 otherwise).

* ``k`` (:data:`K_FACTORS`): 2 for outputs and inputs updated in place, 3 for gradients — the multiples
  FlashAttention's tests allow over a plain PyTorch implementation's error.
* ``u_out``: unit roundoff of the output's dtype — the one final rounding any implementation must make;
  ``eta_out`` the absolute error of that rounding into the subnormals (:attr:`Rounding.eta`).
* ``u`` and ``u_acc``: the storage and accumulator unit roundoffs of the case (:func:`rounding_for`).
* ``c`` (:data:`C_REORDER`): see below.

Why ``c = 10``. A legitimate rewrite may sum the same products in another order (a GEMM's blocked order
instead of ``torch.sum``'s pairwise one, another BLAS, split-K on a GPU). Any order obeys the worst-case
bound ``gamma_n * S`` with ``gamma_n = n*u/(1-n*u)``; that bound is rigorous but grows like ``n``. Higham and
Mary's probabilistic analysis (SIAM J. Sci. Comput. 41(5), 2019, Thm. 3.1) shows that, modelling rounding
errors as independent and mean-zero, an inner product of length ``n`` in any order has error at most
``lambda * sqrt(n) * u * S`` with probability at least ``1 - 2n * exp(-lambda**2 / 2)``. With ``lambda = 10``
that failure probability is below ``4e-22 * n`` per element. Below ``n = c**2`` the worst case ``gamma_n``
is the smaller one and is used instead, so the allowance never exceeds what any summation order can reach.
``c = 10`` is still tight enough to matter: a rewrite that accumulates fp16 in fp16 rounds every partial
sum to fp16 and falls outside it.

>>> r = rounding_for(torch.bfloat16)
>>> r.u == 2.0**-8, r.u_acc == 2.0**-24, r.why
(True, True, 'fp32 accumulate')
>>> gamma(1000, 2.0**-24) < C_REORDER * 1000**0.5 * 2.0**-24
False
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from memtrim.registry import Registry
from memtrim.trace import dtype_name

C_REORDER = 10.0
"""``c`` in the reordering allowance ``c * sqrt(n) * u_acc * S``; justified in the module docstring."""

K_FACTORS: Registry[str, float] = Registry("k factor", "memtrim.verify.budget.K_FACTORS.add(kind, k)")
"""``k`` per kind of quantity: outputs, first and second derivatives, inputs updated in place."""
K_FACTORS.add("output", 2.0)
K_FACTORS.add("grad", 3.0)
K_FACTORS.add("grad2", 3.0)
K_FACTORS.add("update", 2.0)


@dataclass(frozen=True)
class Rounding:
    """How a computation in ``dtype`` rounds: its own unit roundoff and that of its accumulator.

    ``eta`` is the absolute error of rounding into the subnormal range (half the smallest subnormal):
    the standard model with gradual underflow is ``fl(x) = x * (1 + d) + e`` with ``|d| <= u`` and
    ``|e| <= eta`` (Higham, *Accuracy and Stability*, section 2.1). It matters in fp16, whose subnormals
    start at 2**-14: a softmax over long rows stores many of its outputs there.
    """

    dtype: torch.dtype
    u: float
    acc_dtype: torch.dtype
    u_acc: float
    why: str
    eta: float = 0.0


RoundingRule = Callable[[torch.dtype], Rounding]
ROUNDING_REGISTRY: Registry[tuple[torch.dtype, bool], RoundingRule] = Registry(
    "rounding rule", "memtrim.verify.register_rounding(dtype, autocast=...)"
)
"""``(dtype, under_autocast) -> rule``. Register more with :func:`register_rounding`."""


def register_rounding(*dtypes: torch.dtype, autocast: bool = False) -> Callable[[RoundingRule], RoundingRule]:
    """Decorator: ``rule`` gives the :class:`Rounding` of computations in each of ``dtypes``.

    A dtype registered twice is refused (:class:`memtrim.registry.DuplicateRegistration`).
    """
    return ROUNDING_REGISTRY.register(*((dtype, autocast) for dtype in dtypes))


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the machine epsilon: the largest relative error of rounding to nearest in ``dtype``."""
    return float(torch.finfo(dtype).eps) / 2.0


def underflow(dtype: torch.dtype) -> float:
    """Half the smallest subnormal of ``dtype``: the absolute error of rounding into its subnormals.

    >>> underflow(torch.float16) == 2.0**-25, underflow(torch.bfloat16) == 2.0**-134
    (True, True)
    """
    info = torch.finfo(dtype)
    return float(info.smallest_normal) * float(info.eps) / 2.0


@register_rounding(torch.float16, torch.bfloat16, torch.float32)
def _single_accumulate(dtype: torch.dtype) -> Rounding:
    # CPU kernels and GPU tensor cores accumulate half-precision reductions in fp32 (PyTorch's opmath),
    # as fp32 ones are.
    return Rounding(
        dtype,
        unit_roundoff(dtype),
        torch.float32,
        unit_roundoff(torch.float32),
        "fp32 accumulate",
        underflow(dtype),
    )


@register_rounding(torch.float64)
def _double(dtype: torch.dtype) -> Rounding:
    return Rounding(
        dtype,
        unit_roundoff(dtype),
        torch.float64,
        unit_roundoff(torch.float64),
        "fp64 accumulate",
        underflow(dtype),
    )


@register_rounding(torch.float16, torch.bfloat16, autocast=True)
def _autocast_half(dtype: torch.dtype) -> Rounding:
    # Under autocast the fp32 inputs of matmuls are rounded to ``dtype`` before the fp32 accumulation.
    # Those input roundings perturb each product by at most 2u, which the reordering term with
    # u_acc = u(dtype) covers (c * sqrt(n) >= 2), so the budget uses the low dtype's unit roundoff.
    u = unit_roundoff(dtype)
    return Rounding(dtype, u, dtype, u, f"autocast: inputs rounded to {dtype_name(dtype)}", underflow(dtype))


class NoRoundingRule(LookupError):
    """No rounding rule is registered for a dtype: only ``exact`` comparisons are possible."""


def rounding_for(dtype: torch.dtype, *, autocast: bool = False) -> Rounding:
    """The registered :class:`Rounding` of ``dtype`` (``autocast=True``: of autocast to ``dtype``)."""
    rule = ROUNDING_REGISTRY.get((dtype, autocast))
    if rule is None:
        raise NoRoundingRule(
            f"no rounding rule is registered for {dtype_name(dtype)}{' under autocast' if autocast else ''}; "
            "judge it with mode='exact' or register one with "
            "memtrim.verify.register_rounding"
        )
    return rule(dtype)


def gamma(n: float, u: float) -> float:
    """Higham's gamma_n = n*u / (1 - n*u): the worst-case relative error of summing n products."""
    nu = n * u
    return math.inf if nu >= 1.0 else nu / (1.0 - nu)


def reorder_factor(n: torch.Tensor, u_acc: float, c: float = C_REORDER) -> torch.Tensor:
    """Per element ``min(c * sqrt(n) * u_acc, gamma_n)``: the reordering allowance per unit of S."""
    n = n.to(torch.float64)
    probabilistic = c * n.sqrt() * u_acc
    nu = n * u_acc
    worst = torch.where(nu < 1.0, nu / (1.0 - nu).clamp_min(1e-300), torch.full_like(nu, math.inf))
    return torch.minimum(probabilistic, worst)


def oracle_share(r: Rounding) -> float:
    """``r`` in the budget: the oracle's own float64 error relative to a bound in the case's precision."""
    return unit_roundoff(torch.float64) / min(r.u, r.u_acc)


def elementwise_budget(
    orig_err: torch.Tensor,
    oracle: torch.Tensor,
    e: torch.Tensor,
    *,
    k: float,
    u_out: float,
    oracle_share: float,
    eta_out: float = 0.0,
) -> torch.Tensor:
    """The per-element budget (float64) of the rule in the module docstring.

    >>> one = torch.ones(1, dtype=torch.float64)
    >>> elementwise_budget(0 * one, one, 2**-52 * one, k=2, u_out=2**-53, oracle_share=1.0) * 2**53
    tensor([6.], dtype=torch.float64)
    """
    final = oracle.abs().mul_(u_out).add_(eta_out)  # the final rounding, into subnormals too
    return final.add_(e).mul_(1.0 + oracle_share).add_(orig_err, alpha=k)


def tensorwise_budget(orig_err: torch.Tensor, oracle: torch.Tensor, *, k: float, u_out: float) -> float:
    """Without S only the k-times rule holds, judged as FlashAttention's tests do: on the tensor's maxima.

    ``max|cand - oracle| <= k * max(max|orig - oracle|, u_out * max|oracle|)``. The floor grants the
    original at least the one rounding of the largest value that every implementation must make (in
    spirit FlashAttention 3's ``atol = 2 * (ref + 0.3 - 0.3 - ref)``); without it float64, whose oracle
    is the original itself, would demand bit equality.
    """
    finite = oracle[oracle.isfinite()]
    top = float(finite.abs().max()) if finite.numel() else 0.0
    worst = float(orig_err.max()) if orig_err.numel() else 0.0
    return tensorwise_budget_of(worst, top, k=k, u_out=u_out)


def tensorwise_budget_of(worst: float, top: float, *, k: float, u_out: float) -> float:
    """:func:`tensorwise_budget` from its two maxima: ``worst = max|orig - oracle|`` and
    ``top = max|oracle|`` over the finite elements (each 0.0 where there is none)."""
    return k * max(worst, u_out * top)


def assert_close_tolerances(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """``torch.testing.assert_close``'s default (rtol, atol) for this pair: the loosest of the two dtypes'."""
    try:
        from torch.testing._comparison import default_tolerances

        rtol, atol = default_tolerances(actual, expected)
        return float(rtol), float(atol)
    except Exception:  # private helper moved: assert_close's documented defaults
        table = {torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5), torch.float32: (1.3e-6, 1e-5)}
        pairs = [table.get(t.dtype, (1e-7, 1e-7)) for t in (actual, expected)]
        return max(p[0] for p in pairs), max(p[1] for p in pairs)


def assert_close_verdict(
    err: torch.Tensor, expected: torch.Tensor, same: torch.Tensor, rtol: float, atol: float
) -> tuple[bool, str]:
    """Whether ``torch.testing.assert_close(actual, expected, check_dtype=False, equal_nan=True)`` passes.

    Computed from ``err = |actual - expected|`` (float64) as ``isclose`` does, ``same`` marking
    elements that are identical (so infinities and NaNs in the same places count as close).
    """
    bad = assert_close_mismatches(err, expected, same, rtol, atol)
    return assert_close_outcome(bad, err.numel(), rtol, atol)


def assert_close_mismatches(
    err: torch.Tensor, expected: torch.Tensor, same: torch.Tensor, rtol: float, atol: float
) -> int:
    """How many elements ``torch.testing.assert_close`` would count as mismatched (see
    :func:`assert_close_verdict`), so that a tensor can be judged piece by piece."""
    close = (err <= expected.abs().mul_(rtol).add_(atol)) | same
    return int((~close).sum())


def assert_close_outcome(bad: int, numel: int, rtol: float, atol: float) -> tuple[bool, str]:
    """The verdict and message of :func:`assert_close_verdict` from the count of mismatched elements."""
    if bad == 0:
        return True, ""
    return False, f"{bad} of {numel} elements mismatched (rtol={rtol:g}, atol={atol:g})"
