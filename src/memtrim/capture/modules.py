"""The nn.Module path of the code that is running, read from the call stack:
``LlamaForCausalLM.model.layers.0.self_attn``.

Every ``module(x)`` call runs ``nn.Module._call_impl`` with the module as ``self``: the chain of those
frames above an op is the chain of modules it runs in. Reading it costs nothing until an op asks,
where module hooks would cost every module call (global hooks also move every call onto torch's
slow path). A module's path is computed the first time it is seen and kept while the module lives.

The path is the outermost module's class name, then the name ``named_modules()`` of that module gives
the innermost one: after the first dot, it is what ``root.get_submodule()`` takes. The class name
leads because an op in the outermost module's own ``forward`` needs a name (``named_modules()`` gives
it ``""``), and it tells apart two models run in one region. A container that is iterated rather
than called (``for layer in self.layers``) runs no ``_call_impl``, so a child is looked up among its
caller's descendants: ``model.layers.0``, not ``model.LlamaDecoderLayer``.
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
# id(module) -> a weak reference to it, for modules with buffers on a chain a path was built from
_holding_buffers: dict[int, weakref.ref[torch.nn.Module]] = {}


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
    for held in chain:
        if held._buffers and id(held) not in _holding_buffers:
            key = id(held)
            _holding_buffers[key] = weakref.ref(held, functools.partial(_forget_holder, key))
    outermost_first = chain[::-1]
    names = [_child_name(parent, child) for parent, child in itertools.pairwise(outermost_first)]
    return ".".join([type(outermost_first[0]).__name__, *names])


def _child_name(parent: torch.nn.Module, child: torch.nn.Module) -> str:
    key = (id(parent), id(child))
    name = _names.get(key)
    if name is None or _submodule(parent, name) is not child:
        name = next((n for n, m in parent._modules.items() if m is child), None)
        if name is None:  # not a direct child: held by a container the parent iterates, or not owned
            name = next((n for n, m in parent.named_modules() if m is child and n), None)
        if name is None:  # called by a module that does not own it
            return type(child).__name__
        if len(_names) > 100_000:  # ids of modules long gone: start afresh
            _names.clear()
        _names[key] = name
    return name


def _submodule(parent: torch.nn.Module, dotted: str) -> torch.nn.Module | None:
    module: torch.nn.Module | None = parent
    for part in dotted.split("."):
        module = None if module is None else module._modules.get(part)
    return module


def _forget_holder(key: int, _: weakref.ref[torch.nn.Module]) -> None:
    _holding_buffers.pop(key, None)


def modules_with_buffers() -> list[torch.nn.Module]:
    """Live modules that had buffers when an op inside them was first seen (on the chain of modules
    above it): :mod:`memtrim.capture.facts` reads their buffers when a region ends."""
    return [m for ref in list(_holding_buffers.values()) if (m := ref()) is not None]


def modules_seen() -> list[torch.nn.Module]:
    """Live modules an op has been seen running in (any region's): :mod:`memtrim.capture.distributed`
    reads FSDP2's state from those that are ``fully_shard`` modules when a region ends."""
    return [m for ref, _ in list(_paths.values()) if (m := ref()) is not None]
