"""The nn.Module path of the code that is running (``GPT2.blocks.3.attn``), via global module hooks."""

from __future__ import annotations

import threading
from sys import _getframe
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from memtrim.capture.frames import Walk, module_entry_site

# (id(parent), id(child)) -> the child's name in the parent, shared by all regions and threads.
_names: dict[tuple[int, int], str] = {}


class ModulePath(threading.local):
    """Per thread: the dotted path of the innermost module running (``path``), kept by global hooks.

    A ``threading.local`` subclass so that reading ``path`` on the per-op hot path is one attribute
    lookup; the class attributes are each new thread's defaults.
    """

    path: str | None = None
    entry: Walk | None = None  # the user-site walk made when the innermost module was entered
    _handles: tuple[RemovableHandle, ...] = ()

    def __init__(self) -> None:
        # threading.local runs __init__ again in each thread that uses the object: a stack per thread
        self.stack: list[tuple[torch.nn.Module, str | None, Walk | None]] = []

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        stack = self.stack
        if not stack:
            path = type(module).__name__
        else:
            parent, parent_path, _ = stack[-1]
            # Scanning a long Sequential for the child costs more than the rest of the hook: reuse the
            # name found last time, checked against the parent so that a reused id cannot mislead.
            key = (id(parent), id(module))
            child = _names.get(key)
            if child is None or parent._modules.get(child) is not module:
                child = next((n for n, m in parent._modules.items() if m is module), None)
                if child is not None:
                    if len(_names) > 100_000:  # ids of modules long gone: start afresh
                        _names.clear()
                    _names[key] = child
            path = f"{parent_path}.{child if child is not None else type(module).__name__}"
        entry = module_entry_site(_getframe(1), self.entry)
        stack.append((module, path, entry))
        self.path, self.entry = path, entry

    def _exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        stack = self.stack
        # Pop down to this module: a hook that raised may have skipped a child's exit.
        while stack and stack.pop()[0] is not module:
            pass
        _, self.path, self.entry = stack[-1] if stack else (None, None, None)

    def install(self) -> None:
        modules = torch.nn.modules.module
        self._handles = (
            modules.register_module_forward_pre_hook(self._enter),
            modules.register_module_forward_hook(self._exit, always_call=True),
        )

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = ()
        self.stack.clear()
        self.path = self.entry = None
