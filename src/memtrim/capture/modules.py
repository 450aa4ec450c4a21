"""The nn.Module path of the code that is running (``GPT2.blocks.3.attn``), read from the call stack.

Every ``module(x)`` call runs ``nn.Module._call_impl`` with the module as ``self``: the chain of those
frames above an op is the chain of modules it runs in. Reading it costs nothing until an op asks,
where module hooks would cost every module call (global hooks also move every call onto torch's
slow path). A module's path is computed the first time it is seen and kept while the module lives.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from types import CodeType, FrameType

import torch

CALL_IMPL: CodeType = torch.nn.Module._call_impl.__code__

# id(parent), id(child) -> the child's name in the parent
_names: dict[tuple[int, int], str] = {}
# id(module) -> (a weak reference to it, its path), dropped when the module is freed
_paths: dict[int, tuple[weakref.ref[torch.nn.Module], str]] = {}


def module_of(frame: FrameType) -> torch.nn.Module | None:
    """The module a ``_call_impl`` frame runs."""
    module = frame.f_locals.get("self")
    return module if isinstance(module, torch.nn.Module) else None


def module_path(frame: FrameType) -> str | None:
    """The dotted path of the module whose ``_call_impl`` frame is ``frame``.

    A module called from two different parents keeps the path it was first seen with.
    """
    module = module_of(frame)
    if module is None:
        return None
    known = _paths.get(id(module))
    if known is not None and known[0]() is module:
        return known[1]
    path = _build_path(module, frame.f_back)
    key = id(module)
    _paths[key] = (weakref.ref(module, functools.partial(_forget, key)), path)
    return path


def _forget(key: int, _: weakref.ref[torch.nn.Module]) -> None:
    _paths.pop(key, None)


def _build_path(module: torch.nn.Module, frame: FrameType | None) -> str:
    chain = [module]
    while frame is not None:
        if frame.f_code is CALL_IMPL and (parent := module_of(frame)) is not None:
            chain.append(parent)
        frame = frame.f_back
    outermost_first = chain[::-1]
    names = [_child_name(parent, child) for parent, child in itertools.pairwise(outermost_first)]
    return ".".join([type(outermost_first[0]).__name__, *names])


def _child_name(parent: torch.nn.Module, child: torch.nn.Module) -> str:
    key = (id(parent), id(child))
    name = _names.get(key)
    if name is None or parent._modules.get(name) is not child:
        name = next((n for n, m in parent._modules.items() if m is child), None)
        if name is None:  # called by a module that does not own it
            return type(child).__name__
        if len(_names) > 100_000:  # ids of modules long gone: start afresh
            _names.clear()
        _names[key] = name
    return name
