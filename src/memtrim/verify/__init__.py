"""memtrim.verify: prove a memory rewrite safe — bit-exact, or no less accurate than the original.

>>> report = memtrim.verify.verify(original, rewritten, (z, W_O))   # doctest: +SKIP
>>> report.assert_ok()                                              # doctest: +SKIP
"""

from memtrim.verify.api import verify
from memtrim.verify.cases import LAYOUTS, CancellationProbe, Case
from memtrim.verify.oracle import ABS_RULES, NotMultilinear, register_abs_rule
from memtrim.verify.report import CaseResult, Failure, VerifyReport
from memtrim.verify.tolerances import C_REORDER, K_FACTORS, ROUNDING_REGISTRY, register_rounding

__all__ = [
    "ABS_RULES",
    "C_REORDER",
    "K_FACTORS",
    "LAYOUTS",
    "ROUNDING_REGISTRY",
    "CancellationProbe",
    "Case",
    "CaseResult",
    "Failure",
    "NotMultilinear",
    "VerifyReport",
    "register_abs_rule",
    "register_rounding",
    "verify",
]
