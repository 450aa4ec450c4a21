"""A recording belongs to the process that opened it: a forked child stops recording at once.

A child made by ``os.fork`` (a forked DataLoader worker, ``multiprocessing`` with the fork start method)
inherits the parent's dispatch-mode stack and every open region. Nothing the child does can reach the
parent's trace, so recording it would only slow the child down (DataLoader workers loaded data 5x
slower) and, when the child later left the region, leave it with a copy of the parent's trace to
report or save over the parent's file. So, in the child, right after the fork: every open recorder is
closed and taken off the dispatch-mode stack, and the process-wide settings memtrim holds for open
regions (:mod:`memtrim.capture.outside`, :mod:`memtrim.capture.compiled`) are given back.
:func:`recorded_here` tells a caller (``memtrim run``'s epilogue) whether a trace is this process's.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memtrim.trace.model import TraceLog

_lock = threading.Lock()
_open_modes: list[DetachableMode] = []
# process-wide settings to give back in a forked child, registered by the modules that hold them
_child_cleanups: list[Callable[[], None]] = []

PID_KEY = "pid"
"""The :attr:`TraceLog.metadata` key holding the id of the process that recorded the trace."""


def recorded_here(log: TraceLog) -> bool:
    """False in a process forked from the one that recorded ``log`` (its copy of the parent's trace)."""
    return log.metadata.get(PID_KEY, os.getpid()) == os.getpid()


def on_fork_in_child(cleanup: Callable[[], None]) -> None:
    """Run ``cleanup`` in every child forked from now on."""
    _child_cleanups.append(cleanup)


class DetachableMode(TorchDispatchMode):
    """A dispatch mode that can be taken off the mode stack before its ``with`` block ends (in a
    forked child, or when a recording stops early); the block's end then pops nothing."""

    _detached = False

    def __enter__(self) -> Any:
        self._detached = False
        with _lock:
            _open_modes.append(self)
        try:
            return super().__enter__()
        except BaseException:
            self._forget()
            raise

    def __exit__(self, *exc: object) -> None:
        self._forget()
        if not self._detached:
            super().__exit__(*exc)

    def _forget(self) -> None:
        with _lock:
            if self in _open_modes:
                _open_modes.remove(self)

    def detach(self) -> bool:
        """Take this mode off the current thread's dispatch-mode stack; False if it is not on it."""
        if self._detached:
            return True
        stack = [torch._C._get_dispatch_stack_at(i) for i in range(torch._C._len_torch_dispatch_stack())]
        if not any(mode is self for mode in stack):
            return False
        if stack[-1] is self:  # the usual case: leave exactly as the with block would
            super().__exit__(None, None, None)
        else:  # modes entered after this one stay, in their order
            above = []
            while (mode := torch._C._pop_torch_dispatch_stack(None)) is not self:
                above.append(mode)
            for mode in reversed(above):
                torch._C._push_on_torch_dispatch_stack(mode)
        self._detached = True
        return True

    def attach(self) -> None:
        """Put a detached mode back on top of the current thread's dispatch-mode stack."""
        if self._detached:
            TorchDispatchMode.__enter__(self)
            self._detached = False

    def forked(self) -> None:
        """Called in a forked child while this mode's region is open: stop, and leave the stack."""
        self.detach()


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # another thread may have held it at the fork
    modes, _open_modes[:] = list(_open_modes), []
    for mode in modes:
        with contextlib.suppress(Exception):  # never break the child over memtrim's bookkeeping
            mode.forked()
    for cleanup in _child_cleanups:
        with contextlib.suppress(Exception):
            cleanup()


os.register_at_fork(after_in_child=_after_fork_in_child)
