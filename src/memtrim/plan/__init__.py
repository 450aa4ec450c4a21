"""memtrim.plan: a memory plan — the levers chosen to fit a budget — and its file (``memtrim.plan/1``).

This stage sits above :mod:`memtrim.analysis` and :mod:`memtrim.doctor`: a plan's levers are
predicted on a recorded timeline and say what they keep in the doctor's vocabulary
(:data:`memtrim.doctor.diagnosis.Keeps`).
"""

# each registers its levers (micro-batches after memtrim.plan.levers' module levers, which it imports:
# memtrim.applied offers a model to them in that order, so its wrapper wraps the forward they leave)
from memtrim.plan import micro_batch_lever as _micro_batch_lever  # noqa: F401
from memtrim.plan import optimizer_levers as _optimizer_levers  # noqa: F401
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
