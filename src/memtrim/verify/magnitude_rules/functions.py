"""Rules for elementwise functions: the derivative carries the incoming error, plus the function's own
error in documented ulps (:data:`FUNCTION_ULPS`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from memtrim.registry import Registry
from memtrim.verify.magnitude_rules.common import Args, Kwargs, aten, plus, prop
from memtrim.verify.magnitudes import Tracer, register_magnitude_rule

FUNCTION_ULPS: Registry[str, float] = Registry(
    "function accuracy", "memtrim.verify.magnitude_rules.FUNCTION_ULPS.add(name, ulps)"
)
"""Largest error of each elementwise function's own evaluation, in ulps of its compute precision: the
loosest of the CUDA Math API's single-precision table (expf 2, logf 1, tanhf 2, erff 2, rsqrtf 2, sinf 2,
powf 4; sqrtf is correctly rounded), SLEEF's u10 functions (1.0) and glibc. One ulp is at most twice the
unit roundoff. (``sigmoid`` is traced as ``1 / (1 + exp(-x))``, its definition, step by step.)

``erf`` is the exception, set by what PyTorch's own kernels do rather than by a table, and counted in ulps of
1 (an absolute error: ``erf`` lies in [-1, 1]) rather than of its value. ATen's fused GELU kernels evaluate
erf with an absolute error of up to 11.3 units of fp32 roundoff where ``1 + erf(x / sqrt 2)`` cancels (x
near -3, forward) and 8.7 near x = 0 (backward), on the AVX-512, AVX2 and scalar paths alike (torch 2.13
CPU, measured by ``bench/kernel_ulps.py``), while ``torch.erf`` itself stays within 0.8 ulps of its value.
Budgeted at 2 ulps of its value, ``F.gelu`` failed against the formula it implements (on an AVX2 EPYC 435
of 16,384 elements); at 8 ulps of 1 (16 units of roundoff) a formula and torch's fused op verify either way
round, and the tanh approximation of GELU (off by up to ~5e-4) still fails."""
for _name, _ulps in (
    ("exp", 2),
    ("exp2", 2),
    ("expm1", 1),
    ("log", 1),
    ("log2", 1),
    ("log10", 2),
    ("log1p", 1),
    ("tanh", 2),
    ("erf", 8),  # in ulps of 1, not of its value: ATen's fused GELU kernels, see above
    ("erfc", 4),
    ("sqrt", 0),
    ("rsqrt", 2),
    ("reciprocal", 0),
    ("sin", 2),
    ("cos", 2),
    ("pow", 4),
):
    FUNCTION_ULPS.add(_name, float(_ulps))


# -- elementwise functions: |f'(x)| * E(x) plus the function's own error ----------------------------
Derivative = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


ABSOLUTE_ERROR_FUNCTIONS = frozenset({"erf"})
"""Functions whose own error is counted in ulps of 1 (an absolute error) instead of ulps of the value."""


def _function(name: str, derivative: Derivative) -> Callable[..., Any]:
    ulps = FUNCTION_ULPS[name]
    absolute = name in ABSOLUTE_ERROR_FUNCTIONS

    def rule(tr: Tracer, func: Any, args: Args, kwargs: Kwargs) -> Any:
        x = args[0]
        xv = tr.value(x)
        e_in = tr.e(x)
        out = func(*args, **kwargs)
        yv = tr.value(out)
        size = yv.abs().clamp_min(1.0) if absolute else yv.abs()
        own = size.mul_(2.0 * ulps * tr.u_acc)  # the function's own error, in size's new tensor
        e = plus(prop(derivative(xv, yv), e_in), own)
        del size, own, e_in
        tr.set(out, s=yv.abs(), e=e, owned=True)
        return out

    rule.__name__ = rule.__qualname__ = f"_{name}"
    return rule


_LN2 = math.log(2.0)
_FUNCTIONS: dict[str, tuple[Any, Derivative]] = {
    "exp": (aten.exp, lambda x, y: y),
    "exp2": (aten.exp2, lambda x, y: y * _LN2),
    "expm1": (aten.expm1, lambda x, y: y + 1),
    "log": (aten.log, lambda x, y: 1 / x.abs()),
    "log2": (aten.log2, lambda x, y: 1 / (x.abs() * _LN2)),
    "log10": (aten.log10, lambda x, y: 1 / (x.abs() * math.log(10.0))),
    "log1p": (aten.log1p, lambda x, y: 1 / (1 + x).abs()),
    "tanh": (aten.tanh, lambda x, y: 1 - y * y),
    "erf": (aten.erf, lambda x, y: 2 / math.sqrt(math.pi) * torch.exp(-x * x)),
    "erfc": (aten.erfc, lambda x, y: 2 / math.sqrt(math.pi) * torch.exp(-x * x)),
    "sqrt": (aten.sqrt, lambda x, y: 0.5 / y),
    "rsqrt": (aten.rsqrt, lambda x, y: 0.5 * y / x.abs()),
    "reciprocal": (aten.reciprocal, lambda x, y: y * y),
    "sin": (aten.sin, lambda x, y: torch.cos(x)),
    "cos": (aten.cos, lambda x, y: torch.sin(x)),
}
for _name, (_packet, _derivative) in _FUNCTIONS.items():
    register_magnitude_rule(_packet)(_function(_name, _derivative))


@register_magnitude_rule(aten.pow)
def _pow(tr: Tracer, func: Any, args: Args, kwargs: Kwargs) -> Any:
    base, exponent = args[0], args[1]
    out = func(*args, **kwargs)
    yv = tr.value(out)
    own = 2.0 * FUNCTION_ULPS["pow"] * tr.u_acc * yv.abs()
    if not isinstance(base, torch.Tensor):  # b ** x
        tr.set(out, s=yv.abs(), e=prop(yv * math.log(abs(float(base))), tr.e(exponent)) + own, owned=True)
        return out
    if not isinstance(exponent, torch.Tensor):
        p = float(exponent)
        if p == 0:
            return out  # ones: exact
        if p == 1:
            s, e, q = tr.channels(base)
            tr.set(out, s=s, e=e, rounded=q)
            return out
        sb = tr.s(base)
        if p == int(p) and p > 0:
            # x**k as k-1 multiplications of magnitudes: S**k, and k * S**(k-1) * E to first order.
            own = 0.0 if p == 2 else 2.0 * FUNCTION_ULPS["pow"] * tr.u_acc * sb**p
            tr.set(out, s=sb**p, e=prop(p * sb ** (p - 1), tr.e(base)) + own, owned=True)
            return out
        d = abs(p) * tr.value(base).abs() ** (p - 1)
        tr.set(out, s=yv.abs(), e=prop(d, tr.e(base)) + own, owned=True)
        return out
    xv, pv = tr.value(base), tr.value(exponent)
    e = plus(prop(pv * xv.abs() ** (pv - 1), tr.e(base)), prop(yv * xv.abs().log(), tr.e(exponent)))
    tr.set(out, s=yv.abs(), e=plus(e, own), owned=True)
    return out


@register_magnitude_rule(aten.sigmoid)
def _sigmoid(tr: Tracer, func: Any, args: Args, kwargs: Kwargs) -> Any:
    # Its definition, step by step, so that a rewrite spelling it out in fp16 stays inside the budget.
    return tr.redispatch(lambda x: torch.reciprocal(torch.exp(-x) + 1), args[0])
