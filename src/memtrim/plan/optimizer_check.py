"""The numeric check of a plan's ``reference`` optimizer levers (``optimizer-fused``,
``optimizer-foreach-off``): :func:`memtrim.verify.verify_optimizer` of each of the program's optimizers
with the lever's options — the step as built against the same step with them, both from the optimizer's
own class and hyperparameters, judged against the float64 oracle within verify's rounding budget.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from memtrim.plan.file import Numerics


def optimizer_check(
    optimizers: Sequence[torch.optim.Optimizer],
    changes: Sequence[tuple[str, Callable[[torch.optim.Optimizer], dict[str, Any] | None]]],
) -> Numerics | None:
    """Check each ``(lever, options_of)`` of ``changes`` on each optimizer: ``options_of(optimizer)`` is
    the group options the lever sets there (None: it leaves that optimizer alone). None when nothing
    was checked."""
    from memtrim.verify.optimizer import verify_optimizer

    notes: list[str] = []
    differences: dict[str, float] = {}
    failed = False
    for optimizer in optimizers:
        for lever, options_of in changes:
            overrides = options_of(optimizer)
            if overrides is None:
                continue
            for where, report in verify_optimizer(optimizer, **overrides):
                for case in report.cases:
                    for q in case.quantities:
                        key = "parameters" if q.name.startswith("output[0]") else "optimizer_state"
                        differences[key] = max(differences.get(key, 0.0), q.max_abs_diff)
                        if q.budget_used is not None:
                            used = differences.get("budget_used", 0.0)
                            differences["budget_used"] = max(used, q.budget_used)
                notes.append(f"{lever} on {where}: {'passed' if report.passed else 'FAILED'}")
                failed = failed or not report.passed
    if not notes:
        return None
    return Numerics(
        "fail" if failed else "pass",
        differences,
        note="memtrim.verify (reference) of the optimizer step: " + "; ".join(notes),
    )
