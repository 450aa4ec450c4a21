"""``torch.compile`` inside a region: compiled code runs eagerly while memtrim records, and is left
exactly as it was afterwards.

What a dispatch mode does to compiled code: when dynamo is asked to run a compiled function and finds
a (non-infra) dispatch mode on the stack, it refuses to compile *and marks the function's code to be
skipped from then on* (``convert_frame``: "non-infra torch dispatch mode present"; the skip applies to
the code object, for all future calls) — so one tracked call left the function de-compiled for the
rest of the process, even an empty mode did. Compiled kernels also allocate their buffers below the
dispatcher (``empty_strided`` in generated code), so a mode could not see the compiled program's
memory anyway.

So memtrim records the eager program: while a region is open the compiler's stance is
``torch.compiler.set_stance("force_eager")``, under which dynamo runs the original Python without
looking at it (no compile, no skip mark), and the trace's metadata says so (:data:`NOTE_KEY`). The
stance is set only if dynamo is loaded; if it is not, an import hook sets it the moment
``torch._dynamo`` is first imported (``torch.compile`` imports it), so a program that compiles
inside the region is covered too without memtrim importing dynamo (2 s and 70 MiB) for programs that
never compile. The stance in force before the first region opened is restored when the last one
closes (unless the program set another meanwhile), and in a forked child.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from typing import Any

from memtrim.capture.fork import on_fork_in_child
from memtrim.trace.model import TraceLog
from memtrim.trace.notes import COMPILED_KEY, COMPILED_NOTE

NOTE_KEY, NOTE = COMPILED_KEY, COMPILED_NOTE

_DYNAMO = "torch._dynamo"
_lock = threading.RLock()
_users = 0
_stance: Any = None  # the torch.compiler.set_stance object memtrim entered, while in force
_entered = 0  # compiled functions and modules entered (and run eagerly) while the stance was memtrim's
_counting: Any = None  # dynamo's own _callback_from_stance, while memtrim's counting wrapper replaces it


def _enter_stance() -> None:
    global _stance
    if _stance is not None or _users == 0:
        return
    import torch.compiler

    try:
        _stance = torch.compiler.set_stance("force_eager")
    except RuntimeError:  # "attempted to set_stance in a torch.compile region": leave it alone
        _stance = None
        return
    _count_compiled_calls()


def _count_compiled_calls() -> None:
    """Count entries into compiled code: dynamo asks ``_callback_from_stance`` each time a compiled
    function or module is entered, with a real compiler callback (``torch.compiler.disable`` contexts
    pass False or None). Private API, read best effort: without it the note says dynamo was loaded."""
    global _counting
    from torch._dynamo import eval_frame

    original = getattr(eval_frame, "_callback_from_stance", None)
    if original is None or _counting is not None:
        return

    def counting(callback: Any) -> Any:
        global _entered
        if callback not in (False, None):
            _entered += 1
        return original(callback)

    _counting = original
    eval_frame._callback_from_stance = counting


def _leave_stance() -> None:
    global _stance
    stance, _stance = _stance, None
    if stance is None:
        return
    from torch._dynamo import eval_frame

    global _counting
    if _counting is not None:
        eval_frame._callback_from_stance = _counting
        _counting = None
    if eval_frame._stance is stance.stance:  # still memtrim's: the program did not set its own
        stance.__exit__(None, None, None)


class _AfterLoading(importlib.abc.Loader):
    """torch._dynamo's own loader, and the stance set once the module has run."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        _remove_watch()
        with _lock:
            _enter_stance()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


class _DynamoImportWatch(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Any, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _DYNAMO:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _AfterLoading(spec.loader)
                return spec
        return None


_watch = _DynamoImportWatch()


def _remove_watch() -> None:
    while _watch in sys.meta_path:
        sys.meta_path.remove(_watch)


def acquire() -> int:
    """A region opens: compiled code runs eagerly until the last open region closes. Returns the count
    of compiled entries so far, for :func:`release`."""
    global _users
    with _lock:
        _users += 1
        if _users == 1:
            if _DYNAMO in sys.modules:
                _enter_stance()
            elif _watch not in sys.meta_path:
                sys.meta_path.insert(0, _watch)
        return _entered


def release(log: TraceLog, entered_before: int = 0) -> None:
    """A region closes: note in its trace that compiled code ran eagerly in it (entered since
    ``entered_before``, :func:`acquire`'s count; where dynamo could not be watched, that it was loaded)."""
    global _users
    with _lock:
        if _users <= 0:  # given back already (in a forked child)
            return
        watched = _counting is not None
        if _DYNAMO in sys.modules and _stance is not None and (not watched or _entered > entered_before):
            log.metadata[NOTE_KEY] = NOTE
        _users -= 1
        if _users == 0:
            _remove_watch()
            _leave_stance()


def _give_back_in_child() -> None:
    global _users, _lock
    _lock = threading.RLock()
    if _users:
        _users = 0
        _remove_watch()
        _leave_stance()


on_fork_in_child(_give_back_in_child)
