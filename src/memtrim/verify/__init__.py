"""memtrim.verify: prove a memory rewrite safe — bit-exact, or no less accurate than the original.

>>> import torch
>>> from memtrim.verify import verify
>>> def original(x, W):
...     return (x[:, :, None] * W).sum(1)      # builds an [n, k, m] temporary
>>> def rewrite(x, W):
...     return x @ W                           # the same contraction, no temporary
>>> x, W = torch.randn(8, 16, requires_grad=True), torch.randn(16, 4, requires_grad=True)
>>> report = verify(original, rewrite, (x, W), seeds=(0,), mode="reference", memory=False)
>>> report.passed, len(report.cases)           # fp64/fp32/fp16/bf16 x 4 layouts x 1 seed
(True, 16)
>>> report.assert_ok()

The package, one module per job (data flows down the list):

* :mod:`.api` — :func:`verify`, the function users call: validates arguments, builds the matrix, runs it.
* :mod:`.fix` — :func:`verify_fix`: a change to a live model (checkpointing, a patched loss) as two
  functions of its parameters and batch, compared by :func:`verify` (loss, gradients, updated buffers).
* :mod:`.optimizer` — :func:`verify_optimizer`: an optimizer's step with other options (``fused=True``,
  ``foreach=False``) against its step as built, group by group.
* :mod:`.config` — :class:`Settings`, the frozen configuration of one call.
* :mod:`.cases` — the matrix: :class:`Case` (dtype x layout x seed x variant), the layouts, the inputs.
* :mod:`.judge` — judges one case: runs both callables, checks structure and side effects, compares.
* :mod:`.run` — runs one callable once: forward, gradients, second derivatives, errors, side effects.
* :mod:`.oracle` — the float64 oracle of a case and its budget inputs; :class:`OracleCache`.
* :mod:`.magnitudes` — traces the reference: each value's magnitude S and error bound E
  (:data:`MAGNITUDE_RULES`).
* :mod:`.budget` — rounding rules per dtype (:data:`ROUNDING_REGISTRY`) and the budget formulas.
* :mod:`.compare` — one tensor against the reference: bit-exact, or within the budget.
* :mod:`.chunks` — pieces of a tensor, so per-element work needs temporaries of a bounded size.
* :mod:`.probes` — cancellation probes (exact zeros must stay zero).
* :mod:`.results` — every result type: :class:`VerifyReport`, :class:`CaseResult`, :class:`Quantity`,
  :class:`Failure`, :class:`ProbeResult`, :class:`RunResult`, :class:`CallError`.
"""

from memtrim.verify.api import verify
from memtrim.verify.budget import C_REORDER, K_FACTORS, ROUNDING_REGISTRY, Rounding, register_rounding
from memtrim.verify.cases import LAYOUTS, CancellationProbe, Case
from memtrim.verify.config import Settings
from memtrim.verify.fix import model_loss, verify_fix
from memtrim.verify.magnitudes import ABS_RULES, NotMultilinear, register_abs_rule
from memtrim.verify.optimizer import OptimizerReport, verify_optimizer
from memtrim.verify.results import (
    CallError,
    CaseResult,
    Failure,
    ProbeResult,
    Quantity,
    RunResult,
    VerifyReport,
)

__all__ = [
    "ABS_RULES",
    "C_REORDER",
    "K_FACTORS",
    "LAYOUTS",
    "ROUNDING_REGISTRY",
    "CallError",
    "CancellationProbe",
    "Case",
    "CaseResult",
    "Failure",
    "NotMultilinear",
    "OptimizerReport",
    "ProbeResult",
    "Quantity",
    "Rounding",
    "RunResult",
    "Settings",
    "VerifyReport",
    "model_loss",
    "register_abs_rule",
    "register_rounding",
    "verify",
    "verify_fix",
    "verify_optimizer",
]
