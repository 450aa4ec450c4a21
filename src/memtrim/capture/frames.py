"""Which source line in the user's code is running: a stack walk that skips torch and memtrim.

Every code object is classified once and cached, so the per-op cost is one dict lookup per frame
between the op and the first user frame.
"""

from __future__ import annotations

import os
from types import CodeType, FrameType

import torch
import torch.autograd.graph

from memtrim.trace.model import Site

USER, INTERNAL, ENGINE, OPTIMIZER, MODULE_CALL = 0, 1, 2, 3, 4

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_OPTIM_DIR = os.path.join(_TORCH_DIR, "optim") + os.sep
_MEMTRIM_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# memtrim's own example systems are user code: their lines are what a report should point at.
_USER_INSIDE_MEMTRIM = (os.path.join(_MEMTRIM_DIR, "cases") + os.sep,)
_STDLIB_HELPERS = ("contextlib.py", "functools.py", "threading.py")

# Frames of torch.autograd's entry points: an op whose nearest non-torch frames are these was run for
# backward (by the engine for a built-in node, or to seed the output gradients), not by user code.
_ENGINE_CODES: frozenset[CodeType] = frozenset(
    {
        torch.autograd.graph._engine_run_backward.__code__,
        torch.autograd.backward.__code__,
        torch.autograd.grad.__code__,
    }
)

# Function.apply: ops below it run a custom autograd.Function's forward, where grad mode is off.
_FUNCTION_APPLY: CodeType = torch.autograd.Function.apply.__func__.__code__  # type: ignore[attr-defined]

# nn.Module.__call__'s frames. Everything above the innermost one was already walked when that module
# was entered (see ModulePath), so a walk that reaches one can stop and reuse that result.
_CALL_IMPL: CodeType = torch.nn.Module._call_impl.__code__
_MODULE_CALL_CODES: frozenset[CodeType] = frozenset(
    {_CALL_IMPL, *(c for c in _CALL_IMPL.co_consts if isinstance(c, CodeType) and c.co_name == "inner")}
)

# Keyed by id(code): a code object's hash is not cached and covers its constants (nested code
# included), which made hashing the largest per-op cost. _held keeps every classified code alive so
# that its id cannot be reused by another.
_kinds: dict[int, int] = {}
_held: list[CodeType] = []
_sites: dict[tuple[int, int], Site] = {}


def _classify(code: CodeType) -> int:
    if code in _ENGINE_CODES:
        return ENGINE
    if code in _MODULE_CALL_CODES:
        return MODULE_CALL
    name = code.co_filename
    if name.startswith(_OPTIM_DIR):
        return OPTIMIZER
    if name.startswith(_TORCH_DIR) or name.startswith("<frozen"):
        return INTERNAL
    if name.startswith(_MEMTRIM_DIR) and not name.startswith(_USER_INSIDE_MEMTRIM):
        return INTERNAL
    if os.path.basename(name) in _STDLIB_HELPERS and "site-packages" not in name:
        return INTERNAL
    return USER


def _new_site(code: CodeType, line: int) -> Site:
    site = _sites[id(code), line] = Site(code.co_filename, line, code.co_name)
    return site


def _kind(code: CodeType) -> int:
    _held.append(code)
    kind = _kinds[id(code)] = _classify(code)
    return kind


Walk = tuple["Site | None", int]


def user_site(frame: FrameType | None, module_entry: Walk | None = None) -> Walk:
    """The innermost user frame above ``frame`` and what stood between: INTERNAL, ENGINE or OPTIMIZER.

    ENGINE means the op was run on behalf of ``loss.backward()``/``autograd.grad``: the user frame
    returned is then that call, not the code that made the op. ``module_entry`` is the walk made when
    the innermost running nn.Module was entered; reaching that module's call frame ends the walk there.
    """
    seen = INTERNAL
    kinds = _kinds
    while frame is not None:
        code = frame.f_code
        kind = kinds.get(id(code))
        if kind is None:
            kind = _kind(code)
        if kind == USER:
            line = frame.f_lineno
            site = _sites.get((id(code), line))
            return (site if site is not None else _new_site(code, line)), seen
        if kind != INTERNAL:
            if kind == MODULE_CALL and module_entry is not None:
                return module_entry[0], module_entry[1] if seen == INTERNAL else seen
            if kind == ENGINE or (kind == OPTIMIZER and seen != ENGINE):
                seen = kind
        frame = frame.f_back
    return None, seen


def module_entry_site(frame: FrameType | None, parent_entry: Walk | None) -> Walk:
    """The walk for a module being entered, from inside its forward pre-hook: skip the module's own
    call frames, then walk as for an op, stopping at the parent module's call frame."""
    while frame is not None and frame.f_code is not _CALL_IMPL:
        frame = frame.f_back
    return user_site(frame.f_back if frame is not None else None, parent_entry)


def inside_function_forward(frame: FrameType | None) -> bool:
    """True if a custom ``autograd.Function.forward`` is running somewhere up the stack.

    Walks the whole stack, so it is asked only for ops that run with grad mode off.
    """
    while frame is not None:
        if frame.f_code is _FUNCTION_APPLY:
            return True
        frame = frame.f_back
    return False
