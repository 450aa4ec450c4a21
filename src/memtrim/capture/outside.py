"""Allocations and frees that never pass through the dispatcher, which a dispatch mode cannot see.

Two are common enough to matter, and each is one Python-level entry point, wrapped while any region
is open (and given back when the last one closes, or in a forked child):

- ``UntypedStorage.resize_``: FSDP2 frees an unsharded parameter with ``storage.resize_(0)`` and
  allocates it again with ``storage.resize_(n)``; the block changes under the same storage.
- ``torch.get_rng_state`` (and ``torch.cuda.get_rng_state``): a new CPU tensor made by the generator,
  which ``torch.utils.checkpoint`` and ``torch.random.fork_rng`` keep for the backward's recompute.

The wrappers call the original and then tell the recorders open on the calling thread (those on its
dispatch-mode stack); they change nothing else. An RNG state that memtrim's own harness takes (verify
seeds each run under ``fork_rng``) is not the program's memory and is not reported. Storages that C++
code or other functions allocate outside the dispatcher (``torch.load``'s storages,
``UntypedStorage(n)``) are still not seen.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch

from memtrim.capture.fork import on_fork_in_child
from memtrim.capture.frames import called_by_memtrim


class OutsideListener(Protocol):
    def storage_resized(self, storage: Any, before: int, after: int) -> None: ...
    def tensor_made(self, tensor: torch.Tensor, name: str) -> None: ...


_lock = threading.RLock()
_users = 0
_originals: dict[tuple[Any, str], Any] = {}


def _listeners() -> list[OutsideListener]:
    """The open recorders on this thread's dispatch-mode stack."""
    found = []
    for i in range(torch._C._len_torch_dispatch_stack()):
        mode = torch._C._get_dispatch_stack_at(i)
        if getattr(mode, "listens_outside", False):
            found.append(mode)
    return found


def _storage_resize(original: Callable[..., Any]) -> Callable[..., Any]:
    def resize_(self: Any, size: int) -> Any:
        listeners = _listeners()
        if not listeners:
            return original(self, size)
        before = self.nbytes()
        result = original(self, size)
        after = self.nbytes()
        if after != before:
            for listener in listeners:
                listener.storage_resized(self, before, after)
        return result

    return resize_


def _rng_state_getter(original: Callable[..., torch.Tensor], name: str) -> Callable[..., torch.Tensor]:
    def get_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
        state = original(*args, **kwargs)
        listeners = _listeners()
        if listeners and not called_by_memtrim(sys._getframe(1)):
            for listener in listeners:
                listener.tensor_made(state, name)
        return state

    get_rng_state.__wrapped__ = original  # type: ignore[attr-defined]
    get_rng_state.__doc__ = original.__doc__
    return get_rng_state


# what is wrapped while a region is open: (owner, attribute, the wrapper's name in a trace)
_TARGETS: list[tuple[Any, str, str]] = [
    (torch.UntypedStorage, "resize_", "UntypedStorage.resize_"),
    (torch, "get_rng_state", "torch.get_rng_state"),
    (torch.random, "get_rng_state", "torch.get_rng_state"),
    (torch.cuda, "get_rng_state", "torch.cuda.get_rng_state"),
]
_wrappers: dict[tuple[Any, str], Any] = {}


def _install() -> None:
    for owner, attribute, name in _TARGETS:
        original = getattr(owner, attribute, None)
        if original is None:
            continue
        _originals[owner, attribute] = original
        wrapper = _storage_resize(original) if attribute == "resize_" else _rng_state_getter(original, name)
        _wrappers[owner, attribute] = wrapper
        setattr(owner, attribute, wrapper)


def _uninstall() -> None:
    for key, original in _originals.items():
        owner, attribute = key
        if getattr(owner, attribute, None) is _wrappers.get(key):  # not replaced since by someone else
            setattr(owner, attribute, original)
    _originals.clear()
    _wrappers.clear()


def acquire() -> None:
    """A region opens: wrap the entry points (once, for all open regions)."""
    global _users
    with _lock:
        if _users == 0:
            _install()
        _users += 1


def release() -> None:
    """A region closes: the last one gives the originals back."""
    global _users
    with _lock:
        if _users <= 0:  # given back already (in a forked child)
            return
        _users -= 1
        if _users == 0:
            _uninstall()


def _give_back_in_child() -> None:
    global _users, _lock
    _lock = threading.RLock()
    if _users:
        _users = 0
        _uninstall()


on_fork_in_child(_give_back_in_child)
