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

The outermost module is the one the program called. ``torch.compile``'s wrapper is not a name a
program's objects resolve (``OptimizedModule._orig_mod``): the module it wraps leads instead. Two
different outermost modules of one class are told apart (``T5Stack``, ``T5Stack#2``), and when a
region ends, an outermost module that another module owns is named from its owner
(``T5ForConditionalGeneration.encoder`` for ``model.encoder(...)``), so that every path resolves with
``get_submodule`` on one object the program holds (:func:`name_roots`).
"""

from __future__ import annotations

import functools
import gc
import itertools
import weakref
from collections.abc import Iterable
from types import CodeType, FrameType

import torch

from memtrim.trace.model import OpLog

CALL_IMPL: CodeType = torch.nn.Module._call_impl.__code__

# id(parent), id(child) -> the child's name in the parent
_names: dict[tuple[int, int], str] = {}
# id(module) -> (a weak reference to it, its path), dropped when the module is freed
_paths: dict[int, tuple[weakref.ref[torch.nn.Module], str]] = {}
# id(module) -> a weak reference to it, for modules with buffers on a chain a path was built from
_holding_buffers: dict[int, weakref.ref[torch.nn.Module]] = {}
# the leading name of a path -> a weak reference to the outermost module it stands for
_roots: dict[str, weakref.ref[torch.nn.Module]] = {}


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
    while len(outermost_first) > 1 and _compiled_wrapper_of(outermost_first[0], outermost_first[1]):
        outermost_first.pop(0)
    names = [_child_name(parent, child) for parent, child in itertools.pairwise(outermost_first)]
    return ".".join([_root_name(outermost_first[0]), *names])


def _compiled_wrapper_of(wrapper: torch.nn.Module, module: torch.nn.Module) -> bool:
    """``wrapper`` is ``torch.compile(module)`` (checked without importing dynamo)."""
    return (
        type(wrapper).__name__ == "OptimizedModule"
        and wrapper.__dict__.get("_modules", {}).get("_orig_mod") is module
    )


def _root_name(module: torch.nn.Module) -> str:
    """Its class name, or ``Name#2``, ``Name#3`` where another live module of that class leads paths."""
    base = type(module).__name__
    for n in itertools.count(1):
        name = base if n == 1 else f"{base}#{n}"
        held = _roots.get(name)
        if held is None or held() is None:
            _roots[name] = weakref.ref(module)
            return name
        if held() is module:
            return name
    raise AssertionError("unreachable")


def name_roots(paths: Iterable[str]) -> dict[str, str]:
    """For the leading names of ``paths`` that stand for a module another module owns, the path of
    that module from the outermost owner (``T5Stack`` -> ``T5ForConditionalGeneration.encoder``).

    Asked only when a region's paths lead with two or more names (``model.encoder(...)`` and
    ``model.decoder(...)`` both called): one module owning both is what a fix must be applied to. It
    walks every live module once (``gc.get_objects``), so a region that called one model costs nothing.
    """
    leads = {p.partition(".")[0] for p in paths}
    held = {name: module for name in leads if (ref := _roots.get(name)) is not None and (module := ref())}
    if len(leads) < 2 or not held:
        return {}
    owner: dict[int, tuple[torch.nn.Module, str]] = {}
    for obj in gc.get_objects():
        # type(), not isinstance(): a module's deprecated attribute proxies warn on __class__
        if issubclass(type(obj), torch.nn.Module):
            for name, child in obj._modules.items():
                if child is not None and not _compiled_wrapper_of(obj, child):
                    owner.setdefault(id(child), (obj, name))
    renamed: dict[str, str] = {}
    top_names = {id(module): name for name, module in held.items()}  # a lead already names its module
    for lead, module in held.items():
        names: list[str] = []
        top, seen = module, {id(module)}
        while (up := owner.get(id(top))) is not None and id(up[0]) not in seen:
            top = up[0]
            seen.add(id(top))
            names.append(up[1])
        if not names:
            continue
        top_name = top_names.get(id(top))
        if top_name is None:  # two owners of one class stay apart: Model, Model#2
            taken = {*leads, *top_names.values()}
            base = type(top).__name__
            top_name = next(
                n for k in itertools.count(1) if (n := base if k == 1 else f"{base}#{k}") not in taken
            )
            top_names[id(top)] = top_name
        renamed[lead] = ".".join([top_name, *reversed(names)])
    return renamed


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


def rename_roots(ops: OpLog) -> None:
    """Rewrite the module paths of a finished region's ops with :func:`name_roots`, in place."""
    paths = ops.module_paths()
    renamed = name_roots(paths)
    if not renamed:
        return
    new = {}
    for path in paths:
        lead, dot, rest = path.partition(".")
        if lead in renamed:
            new[path] = renamed[lead] + dot + rest
    ops.rename_modules(new)


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
