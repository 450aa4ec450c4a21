"""Which source line in the user's code is running: a stack walk that skips torch and memtrim.

Every code object is classified once and cached, so the per-op cost is one dict lookup per frame
between the op and the first user frame or module call, whichever is further.
"""

from __future__ import annotations

import os
from types import CodeType, FrameType

import torch
import torch.autograd.graph

from memtrim.capture.modules import CALL_IMPL, module_path
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

# Keyed by id(code): a code object's hash is not cached and covers its constants (nested code
# included), which made hashing the largest per-op cost. _held keeps every classified code alive so
# that its id cannot be reused by another.
_kinds: dict[int, int] = {}
_held: list[CodeType] = []
_sites: dict[tuple[int, int], Site] = {}


def _classify(code: CodeType) -> int:
    if code in _ENGINE_CODES:
        return ENGINE
    if code is CALL_IMPL:  # a module call, whose ``self`` is the module
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


Walk = tuple["Site | None", int, "str | None"]


def user_site(frame: FrameType | None) -> Walk:
    """The innermost user frame above ``frame``, what stood between (INTERNAL, ENGINE or OPTIMIZER),
    and the path of the innermost nn.Module running.

    ENGINE means the op was run on behalf of ``loss.backward()``/``autograd.grad``: the user frame
    returned is then that call, not the code that made the op. The walk goes on until it has met both
    the user frame and a module call (a user's ``forward`` is one frame below its module's), or the
    stack ends.
    """
    seen = INTERNAL
    site: Site | None = None
    module_frame: FrameType | None = None
    kinds = _kinds
    while frame is not None:
        code = frame.f_code
        kind = kinds.get(id(code))
        if kind is None:
            kind = _kind(code)
        if kind == MODULE_CALL:
            if module_frame is None:
                module_frame = frame
                if site is not None:
                    break
        elif site is None:
            if kind == USER:
                line = frame.f_lineno
                site = _sites.get((id(code), line)) or _new_site(code, line)
                if module_frame is not None:
                    break
            elif kind == ENGINE or (kind == OPTIMIZER and seen != ENGINE):
                seen = kind
        frame = frame.f_back
    return site, seen, None if module_frame is None else module_path(module_frame)


def inside_function_forward(frame: FrameType | None) -> bool:
    """True if a custom ``autograd.Function.forward`` is running somewhere up the stack.

    Walks the whole stack, so it is asked only for ops that run with grad mode off.
    """
    while frame is not None:
        if frame.f_code is _FUNCTION_APPLY:
            return True
        frame = frame.f_back
    return False
