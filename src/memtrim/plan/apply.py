"""Applying a plan to a live program: ``with applied(plan): ...`` changes the models the block calls.

While the block runs, ``nn.Module.__call__`` is wrapped: the first time a module is called, before its
``forward`` is looked up, each lever of the plan is offered it (:attr:`Lever.apply`) — the checkpoint
lever wraps the submodules it names (:func:`memtrim.fixes.checkpoint_modules`), the chunked loss
patches a transformers causal LM's forward, ``use_cache`` is switched off in its configs. A module a
lever changed is the program's model: its submodules are not offered again. Everything is undone when
the block exits, also by an exception, in the reverse order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from memtrim.plan.file import Plan
from memtrim.plan.levers import LEVERS, Undo


@contextlib.contextmanager
def applied(plan: Plan) -> Iterator[Plan]:
    """Apply ``plan`` to every model the block builds or calls, undone on exit."""
    uses: dict[str, list[dict[str, Any]]] = {}
    for lever in plan.levers:
        LEVERS[lever.lever]  # an unknown lever raises, listing the known ones, before anything runs
        uses.setdefault(lever.lever, []).append(lever.params)
    undos: list[Undo] = []
    seen: set[int] = set()
    original_call = nn.Module.__call__

    def call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if id(module) not in seen:
            seen.add(id(module))
            changed = [u for name, params in uses.items() if (u := LEVERS[name].apply(module, params))]
            if changed:
                undos.extend(changed)
                seen.update(id(m) for m in module.modules())
        return original_call(module, *args, **kwargs)

    if uses:
        nn.Module.__call__ = call  # type: ignore[method-assign]
    try:
        yield plan
    finally:
        if uses:
            nn.Module.__call__ = original_call  # type: ignore[method-assign]
        for undo in reversed(undos):
            undo()
