"""Applying a plan to a live program: ``with applied(plan): ...`` changes the models the block calls.

A global forward pre-hook (``torch.nn.modules.module.register_module_forward_pre_hook``) sees every
module called inside the block; the first time a module whose submodules the plan's checkpoint levers
name is called, they are wrapped (:func:`memtrim.fixes.checkpoint_modules`) before its forward runs.
Everything is undone when the block exits, also by an exception.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook

from memtrim.fixes.checkpoint import CheckpointHandle, checkpoint_modules
from memtrim.plan.file import Plan
from memtrim.plan.levers import LEVERS


@contextlib.contextmanager
def applied(plan: Plan) -> Iterator[Plan]:
    """Apply ``plan`` to every model the block builds or calls, undone on exit."""
    for lever in plan.levers:
        LEVERS[lever.lever]  # an unknown lever raises, listing the known ones, before anything runs
    names = {lever.params["module"] for lever in plan.levers if lever.lever == "checkpoint"}
    handles: list[CheckpointHandle] = []
    seen: set[int] = set()

    def checkpoint_on_first_call(module: nn.Module, args: Any) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        present = [name for name, _ in module.named_modules() if name in names]
        if present:
            handles.append(checkpoint_modules(module, present))
            seen.update(id(m) for m in module.modules())

    hook = register_module_forward_pre_hook(checkpoint_on_first_call) if names else None
    try:
        yield plan
    finally:
        if hook is not None:
            hook.remove()
        for handle in reversed(handles):
            handle.undo()
