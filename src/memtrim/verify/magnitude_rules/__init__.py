"""The rules of the magnitude tracer (:mod:`memtrim.verify.magnitudes`), one small function per kind of op.

Each rule runs the op on the float64 values, then sets the shadows of its outputs: the magnitude S and the
error E before the output's own rounding (``tracer.set(out, s=..., e=...)``). Notation below: ``S(x)``,
``E(x)`` of an input as stored (``tracer.s``, ``tracer.e``: E includes the input's own rounding).

* moves (views, copies, gathers, concatenation, padding): shadows move with the values;
* selections (``where``, ``max``, ``relu``, ``clamp``, ``abs``, ``neg``): 1-Lipschitz, no rounding;
* sums and products (``mul``, ``div``, ``mm``, ``sum``, ``mean``, ``addmm``, ...): S by the same op on
  magnitudes, E by the product rule, plus ``min(c*sqrt(N), N) * u_acc * S`` for a reduction of N terms;
  an elementwise ``add``/``sub`` adds the errors and keeps its own ``|value|`` as S (see
  :mod:`memtrim.verify.magnitudes`);
* elementwise functions (``exp``, ``log``, ``tanh``, ``erf``, ``sqrt``, ``pow``, ...; ``sigmoid`` as
  ``1 / (1 + exp(-x))``):
  ``|f'(x)| * E(x)`` plus the function's documented error in ulps (:data:`FUNCTION_ULPS`);
* composites (softmax, log_softmax, logsumexp, var/std, layer_norm, rms_norm, GELU, SiLU, cross-entropy,
  and their backward ops): traced through their decompositions (PyTorch's, or the two-pass variance
  here), so their budget is that of their steps, each rounded — which also covers an unfused rewrite
  that stores every step in the low-precision dtype. ``scaled_dot_product_attention`` is traced in its
  math form (the oracle runs under ``sdpa_kernel(MATH)``): two products and a softmax.
* random draws (``bernoulli_``, ``rand``, dropout's mask): exact; the tracer notes that the reference
  draws random numbers, so its oracle runs in each case's own layout.
"""

from __future__ import annotations

from typing import Any

from memtrim.verify.magnitude_rules import arithmetic, composites, functions, moves
from memtrim.verify.magnitude_rules.common import Args, Kwargs, aten
from memtrim.verify.magnitude_rules.functions import FUNCTION_ULPS
from memtrim.verify.magnitudes import MAGNITUDE_RULES, Tracer

__all__ = ["FUNCTION_ULPS", "arithmetic", "composites", "functions", "moves"]


def _inplace(tr: Tracer, func: Any, args: Args, kwargs: Kwargs) -> Any:
    # x.op_(...) is x.copy_(op(x, ...)): the functional rule, then the shadows written into x.
    functional = getattr(aten, func.overloadpacket._qualified_op_name.split("::")[1][:-1])
    overload = getattr(functional, func._overloadname, None) or functional.default
    out = MAGNITUDE_RULES[functional](tr, overload, args, kwargs)
    target = args[0]
    s, e, q = tr.channels(out)
    target.copy_(out)
    tr.set(target, s=s, e=e, rounded=q)
    return target


for _packet in list(MAGNITUDE_RULES):  # a copy: the loop registers more
    _name = _packet._qualified_op_name.split("::")[1]
    _inplace_packet = getattr(aten, _name + "_", None)
    if _inplace_packet is not None and _inplace_packet not in MAGNITUDE_RULES:
        MAGNITUDE_RULES.add(_inplace_packet, _inplace)
