"""Applying a plan to a live program: ``with applied(plan): ...`` changes the models and optimizers the
block uses.

Three ways in, one per kind of lever (:class:`~memtrim.plan.levers.Lever`):

- modules: while the block runs, ``nn.Module.__call__`` is wrapped; the first time a module is called,
  before its ``forward`` is looked up, each module lever is offered it — the checkpoint lever wraps the
  submodules it names (:func:`memtrim.fixes.checkpoint_modules`), the chunked loss patches a
  transformers causal LM's forward, ``use_cache`` is switched off, SDPA switched on. A module a lever
  changed is the program's model: its submodules are not offered again.
- optimizers: those alive when the block starts and those built in it are offered to each optimizer
  lever the first time a module holding one of their parameters is called (before that forward: the
  step fused into backward must be in place before the first backward), or at their first step in the
  block, whichever comes first. An optimizer of no parameter the block calls is left alone.
- the block: a lever that changes torch.optim's own behaviour is installed once on entry.

Everything is undone when the block exits, also by an exception, in the reverse order.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook

from memtrim.fixes.optimizer import PER_PARAMETER_OPTIMIZERS
from memtrim.plan.file import Plan
from memtrim.plan.levers import LEVERS, Undo, Uses


class _Optimizers:
    """The optimizers the block may use, each offered to the optimizer levers once."""

    def __init__(self, uses: Mapping[str, Uses], undos: list[Undo]) -> None:
        self.uses = uses
        self.undos = undos
        self.waiting: dict[int, tuple[torch.optim.Optimizer, frozenset[int]]] = {}
        self.done: set[int] = set()
        self.offering = False
        """While a lever is applied: the optimizers it builds (one per parameter) are its own."""
        self.claimed: set[int] = set()
        """The parameters of the optimizers offered: a parameter is changed through one optimizer."""

    def add(self, optimizer: torch.optim.Optimizer) -> None:
        if self.offering or optimizer in PER_PARAMETER_OPTIMIZERS:
            return
        if id(optimizer) not in self.done and id(optimizer) not in self.waiting:
            params = frozenset(id(p) for group in optimizer.param_groups for p in group["params"])
            self.waiting[id(optimizer)] = (optimizer, params)

    def offer(self, optimizer: torch.optim.Optimizer) -> None:
        self.waiting.pop(id(optimizer), None)
        if id(optimizer) in self.done or optimizer in PER_PARAMETER_OPTIMIZERS:
            return
        self.done.add(id(optimizer))
        mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if mine & self.claimed:
            # a second optimizer of a parameter already changed, stepped now: a parameter stepped in
            # backward by one and after backward by the other would train differently, so it stays
            self._passed_over(optimizer)
            return
        self.claimed |= mine
        self.offering = True
        try:
            for name, uses in self.uses.items():
                apply = LEVERS[name].apply_optimizer
                if apply is not None and (undo := apply(optimizer, uses)) is not None:
                    self.undos.append(undo)
        finally:
            self.offering = False

    def module_called(self, module: nn.Module) -> None:
        if not self.waiting:
            return
        mine = {id(p) for p in module.parameters()}
        for optimizer, params in list(self.waiting.values()):
            if id(optimizer) in self.waiting and params & mine:
                chosen = self._the_one_stepped(optimizer, params)
                if chosen is not None:
                    self.offer(chosen)

    def _the_one_stepped(
        self, optimizer: torch.optim.Optimizer, params: frozenset[int]
    ) -> torch.optim.Optimizer | None:
        """Of the waiting optimizers sharing parameters with ``optimizer``, the one the program steps:
        the only one with state. With none or several stepped, no guess: none is changed."""
        rivals = [o for o, ps in self.waiting.values() if o is not optimizer and ps & params]
        if not rivals:
            return optimizer
        stepped = [o for o in [optimizer, *rivals] if o.state]
        chosen = stepped[0] if len(stepped) == 1 else None
        for other in [optimizer, *rivals]:
            if other is not chosen:
                self.waiting.pop(id(other), None)
                self.done.add(id(other))
                self._passed_over(other)
        return chosen

    @staticmethod
    def _passed_over(optimizer: torch.optim.Optimizer) -> None:
        warnings.warn(
            f"memtrim.applied: an optimizer ({type(optimizer).__name__}) shares parameters with another "
            "the program holds, and which one the loop steps is not known; it is left as built (drop the "
            "optimizer the loop does not step)",
            stacklevel=3,
        )

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Optimizers alive now and built from now on are candidates; each is offered at the forward of
        a module holding its parameters, or at its first step."""
        gc.collect()  # an optimizer nothing references any more is not a candidate
        for obj in gc.get_objects():
            # type(), not isinstance(): a module's deprecated attribute proxies warn on __class__
            if issubclass(type(obj), torch.optim.Optimizer):
                self.add(obj)
        original_init = torch.optim.Optimizer.__init__

        def init(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
            original_init(optimizer, *args, **kwargs)
            self.add(optimizer)  # its param_groups exist now; it is offered once it is complete

        def before_forward(module: nn.Module, args: Any) -> None:
            self.module_called(module)

        def before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            self.offer(optimizer)

        torch.optim.Optimizer.__init__ = init  # type: ignore[method-assign,assignment]
        try:
            with register_module_forward_pre_hook(before_forward), contextlib.ExitStack() as stack:
                stack.callback(register_optimizer_step_pre_hook(before_step).remove)
                yield
        finally:
            torch.optim.Optimizer.__init__ = original_init  # type: ignore[method-assign]


@contextlib.contextmanager
def applied(plan: Plan) -> Iterator[Plan]:
    """Apply ``plan`` to every model and optimizer the block builds or calls, undone on exit."""
    uses: dict[str, list[dict[str, Any]]] = {}
    for lever in plan.levers:
        LEVERS[lever.lever]  # an unknown lever raises, listing the known ones, before anything runs
        uses.setdefault(lever.lever, []).append(lever.params)
    # in the registry's order, whatever the plan's: a lever that wraps a model's forward (micro-batches,
    # registered last) wraps the forward the others leave
    module_uses = {name: uses[name] for name in LEVERS if name in uses and LEVERS[name].apply is not None}
    optimizer_uses = {name: p for name, p in uses.items() if LEVERS[name].apply_optimizer is not None}
    undos: list[Undo] = []
    seen: set[int] = set()
    original_call = nn.Module.__call__

    def call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if id(module) not in seen:
            seen.add(id(module))
            changed = []
            for name, params in module_uses.items():
                apply = LEVERS[name].apply
                if apply is not None and (undo := apply(module, params)) is not None:
                    changed.append(undo)
            if changed:
                undos.extend(changed)
                seen.update(id(m) for m in module.modules())
        return original_call(module, *args, **kwargs)

    with contextlib.ExitStack() as stack:
        # the last undone first: registered in the order they were made, undone in reverse
        stack.callback(lambda: [undo() for undo in reversed(undos)])
        for name, params in uses.items():
            install = LEVERS[name].install
            if install is not None:
                undos.append(install(params))
        if optimizer_uses:
            stack.enter_context(_Optimizers(optimizer_uses, undos).watching())
        if module_uses:
            nn.Module.__call__ = call  # type: ignore[method-assign]
            stack.callback(setattr, nn.Module, "__call__", original_call)
        yield plan
