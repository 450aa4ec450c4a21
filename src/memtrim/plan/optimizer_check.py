"""The numeric check of a plan's ``reference`` optimizer levers (``optimizer-fused``,
``optimizer-foreach-off``): :func:`memtrim.verify.verify` of the program's optimizer step as it was built
against the same step with the lever's options, both from the optimizer's own class and hyperparameters.

Each side is a function of a parameter and its gradient that builds the optimizer for that one parameter
with the group's options, and steps it twice (the first creates its state, the second updates it, with
half the gradient): the new parameter and every state tensor are compared against the float64 oracle —
the step as built, run in float64 — within verify's rounding budget, over verify's seeds, in each dtype
the program's parameters have. Optimizer updates are elementwise, so a ``[64, 48]`` parameter stands for
every shape.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from memtrim.plan.file import Numerics

SHAPE = (64, 48)
STEPS = (1.0, 0.5)
"""The gradient's scale at each of the two steps."""


def _stepper(kind: type[torch.optim.Optimizer], options: dict[str, Any]) -> Callable[..., tuple[Any, ...]]:
    accepted = inspect.signature(kind.__init__).parameters

    def step(p: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q = p.detach().clone()
        optimizer = kind([q], **{k: v for k, v in options.items() if k in accepted})
        optimizer.param_groups[0].update(options)
        for scale in STEPS:
            q.grad = g.detach() * scale
            optimizer.step()
        state = optimizer.state[q]
        return (q, *(v for k, v in sorted(state.items()) if k != "step" and isinstance(v, torch.Tensor)))

    return step


def _inputs(dtype: torch.dtype, device: torch.device | str, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(SHAPE, generator=gen).to(device=device, dtype=dtype) for _ in range(2))


def optimizer_check(
    optimizers: Sequence[torch.optim.Optimizer],
    changes: Sequence[tuple[str, Callable[[torch.optim.Optimizer], dict[str, Any] | None]]],
) -> Numerics | None:
    """Check each ``(lever, options_of)`` of ``changes`` on each optimizer: ``options_of(optimizer)`` is
    the group options the lever sets there (None: it leaves that optimizer alone). None when nothing
    was checked."""
    from memtrim.verify import verify

    notes: list[str] = []
    differences: dict[str, float] = {}
    failed = False
    for optimizer in optimizers:
        for lever, options_of in changes:
            overrides = options_of(optimizer)
            if overrides is None:
                continue
            kind = type(optimizer)
            dtypes = sorted(
                {p.dtype for g in optimizer.param_groups for p in g["params"] if torch.is_floating_point(p)},
                key=str,
            )
            params = [p for g in optimizer.param_groups for p in g["params"]]
            device = params[0].device if params else torch.device("cpu")
            for n, group in enumerate(optimizer.param_groups):
                options = {k: v for k, v in group.items() if k != "params"}
                report = verify(
                    _stepper(kind, options),
                    _stepper(kind, {**options, **overrides}),
                    _inputs,
                    mode="reference",
                    grads=False,
                    dtypes=dtypes or (torch.float32,),
                    layouts=("contiguous",),
                    device=device,
                    memory=False,
                    progress=False,
                )
                for case in report.cases:
                    for q in case.quantities:
                        key = "parameters" if q.name.startswith("output[0]") else "optimizer_state"
                        differences[key] = max(differences.get(key, 0.0), q.max_abs_diff)
                        if q.budget_used is not None:
                            used = differences.get("budget_used", 0.0)
                            differences["budget_used"] = max(used, q.budget_used)
                where = f"{kind.__name__} group {n}" if len(optimizer.param_groups) > 1 else kind.__name__
                notes.append(f"{lever} on {where}: {'passed' if report.passed else 'FAILED'}")
                failed = failed or not report.passed
    if not notes:
        return None
    return Numerics(
        "fail" if failed else "pass",
        differences,
        note="memtrim.verify (reference) of the optimizer step: " + "; ".join(notes),
    )
