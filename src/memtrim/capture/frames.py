"""Which source line in the user's code is running: a stack walk that skips library code.

Library code is torch, memtrim, the Python standard library, the call wrappers torch puts around its
own functions (``typing_extensions.deprecated``) and any folder given to :func:`set_library_roots`; an
op run inside it is blamed on the innermost user frame that called in.

Every code object is classified once and cached, so the per-op cost is one dict lookup per frame
between the op and the first user frame or module call, whichever is further. The caches hold no
code object alive: a code object's entries go when it is freed (functions made and dropped in a
loop, ``exec``'d code), noticed through a weak reference whose callback is C code, so that a Ctrl-C
can never land in it and be swallowed.
"""

from __future__ import annotations

import os
import site
import sys
import sysconfig
import weakref
from collections.abc import Iterable
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
_CAPTURE_DIR = os.path.join(_MEMTRIM_DIR, "capture") + os.sep


def _stdlib_roots() -> tuple[str, ...]:
    """The standard library's folders (those of the base interpreter, also inside a virtualenv)."""
    base = {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}
    paths = {os.path.dirname(os.path.abspath(os.__file__))}
    for key in ("stdlib", "platstdlib"):
        paths.add(os.path.abspath(sysconfig.get_path(key, vars=base)))
    return tuple(sorted(os.path.join(p, "") for p in paths))


_STDLIB = _stdlib_roots()
# Third-party packages may be installed inside the standard library's folder (a system Python's
# lib/python3.X/site-packages): they are not the standard library.
_PACKAGE_DIRS = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)
_library_roots: tuple[str, ...] = ()


def _wrapper_files() -> frozenset[str]:
    """Files of installed modules whose frames only pass a call on: ``typing_extensions``, whose
    ``@deprecated`` wrapper torch puts around some of its own functions (``dist.all_gather_into_tensor``,
    ``dist.reduce_scatter_tensor``), where the wrapper's frame stands between the user's line and the
    op. Never the user's line."""
    found = set()
    for name in ("typing_extensions",):
        path = getattr(sys.modules.get(name), "__file__", None)
        if path:
            found.add(os.path.abspath(path))
    return frozenset(found)


_WRAPPERS = _wrapper_files()


def site_packages() -> list[str]:
    """The folders third-party packages are installed in, for :func:`set_library_roots`."""
    folders = [*site.getsitepackages(), site.getusersitepackages()]
    return [folder for folder in folders if os.path.isdir(folder)]


def set_library_roots(roots: Iterable[str]) -> None:
    """Treat code under these folders as library code, the way torch's own frames are treated: an op
    run inside it is blamed on the innermost user frame that called in (e.g.
    ``set_library_roots(site_packages())``; ``set_library_roots([])`` restores the default). The
    standard library always counts as library code; memtrim's own cases never do.
    """
    global _library_roots
    _library_roots = tuple(os.path.join(os.path.abspath(os.fspath(r)), "") for r in roots)
    _kinds.clear()
    _sites.clear()
    _lines.clear()
    _refs.clear()
    _dead.clear()


def library_roots() -> tuple[str, ...]:
    """The folders given to :func:`set_library_roots`."""
    return _library_roots


def _is_stdlib(name: str) -> bool:
    for root in _STDLIB:
        if name.startswith(root):
            return not any(d in name[len(root) - 1 :] for d in _PACKAGE_DIRS)
    return False


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
# included), which made hashing the largest per-op cost. An id can be reused once its code object is
# freed, so every classified code has a weak reference in _refs whose callback (list.append, C code)
# queues it in _dead; each walk first drops the entries of the dead ones (_purge).
_kinds: dict[int, int] = {}
_sites: dict[tuple[int, int], Site] = {}
_lines: dict[int, list[int]] = {}  # id(code) -> the lines it has in _sites


class _CodeRef(weakref.ref[CodeType]):
    __slots__ = ("key",)
    key: int


_refs: dict[int, _CodeRef] = {}
_dead: list[_CodeRef] = []


def _purge() -> None:
    while _dead:
        ref = _dead.pop()
        key = ref.key
        if _refs.get(key) is ref:
            del _refs[key]
            _kinds.pop(key, None)
            for line in _lines.pop(key, ()):
                _sites.pop((key, line), None)


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
    if name.startswith(_USER_INSIDE_MEMTRIM):
        return USER
    if name.startswith(_MEMTRIM_DIR):
        return INTERNAL
    if _is_stdlib(name) or name.startswith(_library_roots) or name in _WRAPPERS:
        return INTERNAL
    return USER


def _new_site(code: CodeType, line: int) -> Site:
    key = id(code)
    site = _sites[key, line] = Site(code.co_filename, line, code.co_name)
    _lines.setdefault(key, []).append(line)
    return site


def _kind(code: CodeType) -> int:
    key = id(code)
    ref = _CodeRef(code, _dead.append)
    ref.key = key
    _refs[key] = ref
    kind = _kinds[key] = _classify(code)
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
    if _dead:
        _purge()
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


def runs_code(frame: FrameType | None, code: CodeType) -> bool:
    """True if ``code`` is running somewhere up the stack from ``frame``."""
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def called_by_memtrim(frame: FrameType | None) -> bool:
    """True if the code that called into torch here is memtrim's own (not its cases): what memtrim's
    harnesses allocate (verify's RNG bookkeeping) is not the program's memory."""
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_USER_INSIDE_MEMTRIM):
            return False
        if name.startswith(_MEMTRIM_DIR):
            # memtrim.capture itself (the wrapper that asks) is not a caller
            if not name.startswith(_CAPTURE_DIR):
                return True
        elif not (name.startswith(_TORCH_DIR) or _is_stdlib(name) or name.startswith("<frozen")):
            return False
        frame = frame.f_back
    return False
