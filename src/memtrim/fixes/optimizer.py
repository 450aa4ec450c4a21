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

:func:`optimizer_options` sets options such as ``fused=True`` on a live optimizer's groups, as if it had
been built with them (:func:`memtrim.verify.verify_optimizer` proves the step no less accurate).
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
    kind = optimizer_class(optimizer, "optimizer_in_backward")
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


def optimizer_class(optimizer: Any, caller: str) -> type[torch.optim.Optimizer]:
    """``optimizer``'s class; raises TypeError, naming ``caller``, where it is no torch.optim.Optimizer."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"{caller} takes a torch.optim.Optimizer, not {type(optimizer).__name__}: pass the "
            "optimizer your loop steps"
        )
    return type(optimizer)


def check_options(
    optimizer: Any, options: dict[str, Any], caller: str, needs: str
) -> type[torch.optim.Optimizer]:
    """``optimizer``'s class, where it is a torch.optim.Optimizer whose class takes every one of
    ``options`` (at least one); raises otherwise, naming ``caller`` and what it ``needs`` the options
    for. Shared by :func:`optimizer_options` and :func:`memtrim.verify.verify_optimizer`, so that what
    the one proves is what the other sets."""
    kind = optimizer_class(optimizer, caller)
    if not options:
        raise ValueError(f"{caller} needs the options {needs}")
    unknown = sorted(set(options) - set(inspect.signature(kind.__init__).parameters))
    if unknown:
        raise ValueError(f"{kind.__name__} takes no option {', '.join(map(repr, unknown))}")
    return kind


# -- options of a live optimizer (fused=True, foreach=False) --------------------------------------------
FUSED_ADAM = (torch.optim.Adam, torch.optim.AdamW)
"""The optimizers whose fused step memtrim offers (their update is ``lerp_``; fused on CPU and CUDA)."""


def fusable(optimizer: torch.optim.Optimizer) -> str | None:
    """Why torch's fused Adam/AdamW cannot take ``optimizer``'s parameters and groups; None if it can."""
    if not isinstance(optimizer, FUSED_ADAM):
        return f"memtrim offers fused=True for Adam and AdamW, not {type(optimizer).__name__}"
    supported = torch.utils._foreach_utils._get_fused_kernels_supported_devices()
    for group in optimizer.param_groups:
        for option in ("differentiable", "capturable"):
            if group.get(option):
                return f"a group has {option}=True, which the fused step does not take here"
        for p in group["params"]:
            if p.device.type not in supported:
                return f"a parameter is on {p.device.type}, where torch has no fused step"
            if not torch.is_floating_point(p):
                return f"a parameter is {p.dtype}, not floating point"
    return None


@dataclass
class OptimizerOptionsHandle:
    """What :func:`optimizer_options` changed: ``before[i]`` is group ``i``'s old value of each option."""

    optimizer: torch.optim.Optimizer
    options: dict[str, Any]
    before: list[dict[str, Any]]
    _moved: list[tuple[dict[str, Any], torch.Tensor]] = field(default_factory=list, repr=False)

    def remove(self) -> None:
        """Give each group its options back, and each moved step counter its device (its value kept)."""
        for group, old in zip(self.optimizer.param_groups, self.before, strict=False):
            group.update(old)
        for state, step in self._moved:
            with torch.no_grad():
                step.copy_(state["step"])
            state["step"] = step
        self.before, self._moved = [], []


def optimizer_options(optimizer: torch.optim.Optimizer, **options: Any) -> OptimizerOptionsHandle:
    """Set ``options`` (``fused=True, foreach=False``, ...) on every group of a live ``optimizer``, as if it
    had been built with them; its state is kept, so training goes on from where it is. ``handle.remove()``
    undoes it. Raises where the optimizer's class takes no such option, or (for ``fused=True``) where its
    parameters cannot take the fused step."""
    check_options(optimizer, options, "optimizer_options", "to set, e.g. fused=True, foreach=False")
    if options.get("fused"):
        why = fusable(optimizer)
        if why is not None:
            raise ValueError(f"fused=True does not apply: {why}")
        if options.get("foreach"):
            raise ValueError("fused=True and foreach=True exclude each other: pass foreach=False")
    handle = OptimizerOptionsHandle(
        optimizer,
        dict(options),
        [{key: group.get(key) for key in options} for group in optimizer.param_groups],
    )
    if options.get("fused"):
        # a step counter made by a for-loop step lives on the CPU; the fused step groups it with its
        # parameter, so it moves to the parameter's device (the counter's value is unchanged)
        for p, state in optimizer.state.items():
            step = state.get("step") if isinstance(state, dict) else None
            if isinstance(step, torch.Tensor) and step.device != p.device:
                handle._moved.append((state, step))
                state["step"] = step.to(device=p.device, dtype=torch.float32)
    for group in optimizer.param_groups:
        group.update(options)
    return handle


__all__ = [
    "FUSED_ADAM",
    "OptimizerInBackwardHandle",
    "OptimizerOptionsHandle",
    "check_options",
    "fusable",
    "optimizer_class",
    "optimizer_in_backward",
    "optimizer_options",
]
