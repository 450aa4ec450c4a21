"""The optimizer step fused into backward: each parameter is updated, and its gradient freed, as soon as
backward has accumulated it (``register_post_accumulate_grad_hook``), so the model's gradients are never
alive all at once.

>>> import torch
>>> import memtrim.fixes
>>> model = torch.nn.Linear(4, 2)
>>> optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
>>> handle = memtrim.fixes.optimizer_in_backward(optimizer)  # then drop optimizer.step()/zero_grad()
>>> model(torch.randn(3, 4)).sum().backward()  # steps every parameter
>>> model.weight.grad is None, len(handle.optimizers)
(True, 2)
>>> handle.remove()  # back to optimizer.step()

One optimizer of the same class per parameter, built with the options of the parameter's group and
holding the state the original optimizer had for it (the same tensors): for an optimizer whose update of
a parameter reads only that parameter's gradient and state (SGD, Adam, AdamW, ... run per parameter),
training is the same bit for bit. Each parameter's step first takes its group's options as the
original optimizer's group holds them then, so a learning-rate scheduler of the original optimizer keeps
working. It is not for global gradient-norm clipping (no parameter's step can wait for the others'
gradients) or gradient accumulation (it steps at every backward).
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class OptimizerInBackwardHandle:
    """What :func:`optimizer_in_backward` installed: ``optimizers[i]`` steps ``parameters[i]``."""

    optimizer: torch.optim.Optimizer
    parameters: list[torch.nn.Parameter]
    optimizers: list[torch.optim.Optimizer]
    _hooks: list[Any] = field(default_factory=list, repr=False)

    def remove(self) -> None:
        """Remove the hooks and give each parameter's state back to the original optimizer."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for p, single in zip(self.parameters, self.optimizers, strict=True):
            if p in single.state:
                self.optimizer.state[p] = single.state[p]


def optimizer_in_backward(optimizer: torch.optim.Optimizer) -> OptimizerInBackwardHandle:
    """Run ``optimizer``'s update of each parameter in backward, right after its gradient is accumulated,
    and free the gradient there. Drop ``optimizer.step()`` and ``optimizer.zero_grad()`` from the loop
    while installed; ``handle.remove()`` undoes it. A learning-rate scheduler of ``optimizer`` keeps
    working: each step reads its group's options (``lr``...) from ``optimizer.param_groups``."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer_in_backward takes a torch.optim.Optimizer, not {type(optimizer).__name__}: "
            "pass the optimizer your loop steps"
        )
    kind = type(optimizer)
    accepted = inspect.signature(kind.__init__).parameters
    handle = OptimizerInBackwardHandle(optimizer, [], [])
    for group in optimizer.param_groups:
        options = {k: v for k, v in group.items() if k != "params"}
        for p in group["params"]:
            if not p.requires_grad:
                continue
            single = kind([p], **{k: v for k, v in options.items() if k in accepted})
            PER_PARAMETER_OPTIMIZERS.add(single)
            single.param_groups[0].update(options)  # every option as the group had it
            if p in optimizer.state:
                single.state[p] = optimizer.state.pop(p)
            handle.parameters.append(p)
            handle.optimizers.append(single)
            handle._hooks.append(p.register_post_accumulate_grad_hook(_stepper(single, group)))
    return handle


PER_PARAMETER_OPTIMIZERS: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
"""The one-parameter optimizers ``optimizer_in_backward`` built: they are its parts, not the program's
optimizers (a plan applied later must not move them into backward again, even once removed)."""


def _stepper(single: torch.optim.Optimizer, group: dict[str, Any]) -> Any:
    mine = single.param_groups[0]

    def step(p: torch.Tensor) -> None:
        for key, value in group.items():
            if key != "params":
                mine[key] = value  # the group's options now: a scheduler may have changed lr
        single.step()
        p.grad = None  # freed here, not when the next zero_grad() would have

    return step


__all__ = ["OptimizerInBackwardHandle", "optimizer_in_backward"]
