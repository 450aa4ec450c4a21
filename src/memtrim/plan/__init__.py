"""memtrim.plan: a memory plan — the levers chosen to fit a budget — and its file (``memtrim.plan/1``).

This stage sits above :mod:`memtrim.analysis` and :mod:`memtrim.doctor`: a plan's levers are
predicted on a recorded timeline and say what they keep in the doctor's vocabulary
(:data:`memtrim.doctor.diagnosis.Keeps`).
"""

from memtrim.plan import optimizer_levers as _optimizer_levers  # noqa: F401  (registers its levers)
from memtrim.plan.file import (
    SCHEMA,
    Numerics,
    Plan,
    PlanFormatError,
    PlannedLever,
    load_plan,
    parse_budget,
)

__all__ = ["SCHEMA", "Numerics", "Plan", "PlanFormatError", "PlannedLever", "load_plan", "parse_budget"]
