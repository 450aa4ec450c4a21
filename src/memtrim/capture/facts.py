"""What the recorder sees storages used as: parameters, gradients, optimizer state, module buffers.

Each fact is taken where torch already tells it, so that no aten op pays for it:

- ``parameter``: an ``nn.Parameter`` (frozen ones too), or a leaf tensor that requires grad, first
  seen as an op's input (the recorder's slow path for storages from before the region); a parameter
  registered on a module inside the region (``torch.nn.modules.module``'s global
  parameter-registration hook); a leaf autograd stores a gradient in; an optimizer's parameters.
- ``gradient``: what autograd's ``AccumulateGrad`` stores in a leaf's ``.grad``. When it can, it
  *steals* the incoming gradient with one ``detach`` and makes no storage; otherwise it makes the
  new ``.grad`` with an op run under its node. The recorder sees both. The ``.grad`` of an
  optimizer's parameters is also read when its step begins (a gradient assigned by hand).
- ``optimizer_state``: every tensor in an optimizer's ``state`` after its ``step`` (Adam's ``exp_avg``,
  ``exp_avg_sq`` and ``step``; a momentum buffer), read by a global step post-hook, and at the
  region's end for a step that raised (it runs no post-hook).
- ``buffer``: a buffer registered inside the region (global buffer-registration hook), and at the
  region's end the buffers of the modules the region ran.

The hooks are global, installed when the region opens and removed when it closes; a nested region
installs its own. Every hook returns None (the user's tensors are never replaced) and swallows its
own errors: reading facts must never change or break the program. The per-parameter work (one
storage lookup per gradient stored) is done once per parameter and step, never per op.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import torch
import torch.nn.modules.module as _module_hooks
import torch.optim.optimizer as _optimizer_hooks
from torch.utils.hooks import RemovableHandle

from memtrim.capture import storages
from memtrim.capture.distributed import placed_fact
from memtrim.trace.model import Fact

ACCUMULATE_GRAD: Any = torch._C._functions.AccumulateGrad  # type: ignore[attr-defined]
"""The node class autograd gives each leaf that requires grad; it stores gradients in ``.grad``."""

_Parameter = torch.nn.Parameter
_Tensor = torch.Tensor
_PARAMETER, _GRADIENT, _OPTIMIZER_STATE, _BUFFER = (
    Fact.PARAMETER,
    Fact.GRADIENT,
    Fact.OPTIMIZER_STATE,
    Fact.BUFFER,
)
_NO_STORAGE = (RuntimeError, NotImplementedError, TypeError)  # sparse, nested, opaque tensors


class Watch(Protocol):
    index: int
    """The allocation row of the watched storage."""


WatchUnseen = Callable[[torch.Tensor, Any], Watch]
"""``watch_unseen(tensor, storage)``: watch a storage the region has not seen as one from before the
region."""


def is_parameter(t: torch.Tensor) -> bool:
    """An ``nn.Parameter`` (frozen ones too), or a leaf tensor that requires grad."""
    return (t.requires_grad and t.grad_fn is None) or isinstance(t, _Parameter)


def _state_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Tensors in an optimizer's per-parameter state (dicts of tensors, lists, numbers)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _state_tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _state_tensors(item)


class FactRecorder:
    """Adds facts to ``facts`` (row -> facts) for the storages in ``watches`` (storage key -> watch);
    owned by one recorder, whose dicts these are."""

    def __init__(
        self, watches: dict[int, Any], facts: dict[int, set[Fact]], watch_unseen: WatchUnseen
    ) -> None:
        self._watches = watches
        self._facts = facts
        self._watch_unseen = watch_unseen
        self._open = True
        self.recording = True  # False outside a step window: nothing is tagged or watched then
        # leaves whose .grad autograd was seen storing, by id (each is tagged once)
        self._accumulated: set[int] = set()
        # optimizers whose step began and has not finished (a raise): their state is read at the end
        self._stepping: dict[int, weakref.ref[torch.optim.Optimizer]] = {}
        self._handles: list[RemovableHandle] = []

    # -- the global hooks ---------------------------------------------------------------------------
    def install(self) -> None:
        if self._handles:
            return
        self._handles = [
            _module_hooks.register_module_parameter_registration_hook(self._on_parameter_registered),
            _module_hooks.register_module_buffer_registration_hook(self._on_buffer_registered),
            _optimizer_hooks.register_optimizer_step_pre_hook(self._before_step),
            _optimizer_hooks.register_optimizer_step_post_hook(self._after_step),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _on_parameter_registered(self, module: Any, name: str, param: Any) -> None:
        try:
            if isinstance(param, torch.Tensor):
                self.tag(param, _PARAMETER, watch_unseen=True)
        except Exception:  # never break the program being tracked
            pass

    def _on_buffer_registered(self, module: Any, name: str, tensor: Any) -> None:
        try:
            if isinstance(tensor, torch.Tensor):
                self.tag(tensor, _BUFFER, watch_unseen=True)
        except Exception:
            pass

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        try:
            self._stepping[id(optimizer)] = weakref.ref(optimizer)
            for group in optimizer.param_groups:
                for p in group["params"]:
                    # a parameter without a gradient is skipped by the step: not watched if not seen
                    grad = p.grad
                    self.tag(p, _PARAMETER, watch_unseen=grad is not None)
                    if grad is not None:
                        self.tag(grad, _GRADIENT, watch_unseen=True)
        except Exception:
            pass

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        try:
            self._stepping.pop(id(optimizer), None)
            self._tag_state(optimizer)
        except Exception:
            pass

    # -- facts --------------------------------------------------------------------------------------
    def _add(self, index: int, fact: Fact) -> None:
        found = self._facts.get(index)
        if found is None:
            self._facts[index] = {fact}
        else:
            found.add(fact)

    def tag(self, t: torch.Tensor, fact: Fact, *, watch_unseen: bool = False) -> None:
        """Add ``fact`` to the allocation of ``t``'s storage, if the region holds it (or, with
        ``watch_unseen``, once it is watched as a storage from before the region)."""
        if not self._open or not self.recording:
            return
        try:
            cls = type(t)
            if (cls is not _Tensor and not issubclass(cls, _Parameter)) or t.is_meta or t.is_nested:
                # a subclass (a DTensor parameter is of type DTensor; a fake tensor), a nested or
                # meta tensor: the storages that hold its memory
                found = storages.parts(t)
                fact = placed_fact(t, fact)
            else:
                found = [(t, t.untyped_storage())]
            for part, storage in found:
                watch = self._watches.get(storage._cdata)
                if watch is not None:
                    self._add(watch.index, fact)
                elif watch_unseen and storage.nbytes():
                    self._add(self._watch_unseen(part, storage).index, fact)
        except _NO_STORAGE:
            pass

    def preexisting(self, t: torch.Tensor, index: int) -> None:
        """A storage from before the region, first seen as an op's input at row ``index``."""
        if is_parameter(t):
            self._add(index, _PARAMETER)

    def accumulated(self, node: Any, gradient: Any) -> None:
        """The engine's ``detach`` of ``gradient`` under an ``AccumulateGrad`` node: autograd
        stealing it as the leaf's ``.grad``."""
        try:
            watch = self._watches.get(gradient.untyped_storage()._cdata)
            if watch is not None:
                self._add(watch.index, _GRADIENT)
            leaf = node.variable
            if id(leaf) not in self._accumulated:
                self._accumulated.add(id(leaf))
                self.tag(leaf, _PARAMETER, watch_unseen=True)
        except Exception:
            pass

    def accumulating(self, node: Any) -> None:
        """An op the engine runs for an ``AccumulateGrad`` node: a copy of the incoming gradient, or a
        sum with the leaf's ``.grad``, which may be from before the region (in place: no new storage)."""
        try:
            leaf = node.variable
            self.tag(leaf, _PARAMETER, watch_unseen=True)
            if (grad := leaf.grad) is not None:
                self.tag(grad, _GRADIENT, watch_unseen=True)
        except Exception:
            pass

    def _tag_state(self, optimizer: torch.optim.Optimizer) -> None:
        for state in list(optimizer.state.values()):
            for t in _state_tensors(state):
                self.tag(t, _OPTIMIZER_STATE)

    def finish(self, modules: Iterable[torch.nn.Module]) -> None:
        """At the region's end: the state of optimizers whose step raised, and the buffers of
        ``modules`` (those the region ran). Kept short: it runs at the end of every region."""
        try:
            for ref in list(self._stepping.values()):
                optimizer = ref()
                if optimizer is not None:
                    self._tag_state(optimizer)
            for module in modules:
                for b in module._buffers.values():
                    if b is not None:
                        self.tag(b, _BUFFER)
        except Exception:
            pass
        self._open = False
