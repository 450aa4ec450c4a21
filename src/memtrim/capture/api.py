"""``record()``: record a region of a PyTorch program into a :class:`~memtrim.trace.TraceLog`.

Users call :func:`memtrim.track`, which wraps this and adds the analysis on top; stages below the top
(verify, bench) call ``record`` and :func:`memtrim.analysis.analyze` directly.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import torch

from memtrim.capture import compiled, distributed, outside
from memtrim.capture.fork import PID_KEY
from memtrim.capture.recorder import Recorder
from memtrim.capture.steps import StepWindow
from memtrim.trace.model import TraceLog
from memtrim.trace.ranks import WORLD

# Trackers open right now (outermost first), so that an inner one resetting CUDA's peak statistic
# first hands the current peak to the outer ones.
_open_cuda_watches: list[_CudaPeak] = []


class _CudaPeak:
    """``torch.cuda.max_memory_allocated`` for the region, above the bytes allocated at its start."""

    def __init__(self) -> None:
        self.devices = (
            list(range(torch.cuda.device_count()))
            if torch.cuda.is_available() and torch.cuda.is_initialized()
            else []
        )
        self.start = {d: torch.cuda.memory_allocated(d) for d in self.devices}
        self.seen_max = dict(self.start)
        self.pid = os.getpid()

    def begin(self) -> None:
        for d in self.devices:
            for outer in _open_cuda_watches:
                if d in outer.seen_max:
                    outer.seen_max[d] = max(outer.seen_max[d], torch.cuda.max_memory_allocated(d))
            torch.cuda.reset_peak_memory_stats(d)
        _open_cuda_watches.append(self)

    def end(self) -> dict[str, int]:
        if self in _open_cuda_watches:
            _open_cuda_watches.remove(self)
        if os.getpid() != self.pid:  # a forked child, where CUDA cannot be used
            return {}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            # CUDA first initialised inside the region: its whole history is the region's
            for d in range(torch.cuda.device_count()):
                if d not in self.start:
                    self.devices.append(d)
                    self.start[d] = self.seen_max[d] = 0
        result = {}
        for d in self.devices:
            torch.cuda.synchronize(d)
            peak = max(self.seen_max[d], torch.cuda.max_memory_allocated(d))
            result[f"cuda:{d}"] = peak - self.start[d]
        return result


def _note_world(trace: TraceLog, at_start: dict[str, object] | None) -> None:
    """Which rank of which world the trace is (``trace.metadata["distributed"]``)."""
    found = distributed.world() or at_start
    if found is not None:
        trace.metadata.setdefault(WORLD, found)


def _window_cuda(trace: TraceLog) -> dict[str, Callable[[], None]]:
    """The CUDA peak watch of a step window: from the window's first step to its last."""
    watch: list[_CudaPeak] = []

    def on_open() -> None:
        watch.append(_CudaPeak())
        watch[0].begin()

    def on_close() -> None:
        if watch:
            trace.cuda_max_allocated.update(watch.pop().end())

    return {"on_open": on_open, "on_close": on_close}


@contextlib.contextmanager
def record(*, fake: bool = False, steps: range | None = None) -> Iterator[TraceLog]:
    """Record every storage the code inside the ``with`` block allocates and frees.

    Yields a :class:`~memtrim.trace.TraceLog` that is complete when the block exits — also when it exits
    by an exception (an out-of-memory error, say): the trace then holds everything up to the failure,
    ``trace.error`` names it, and what was alive at that point is the live set at the end.

    ``fake=True`` runs the block under ``FakeTensorMode``: tensors have shapes, dtypes and devices but
    no data, so a full-size program is measured on a CPU without allocating it. Tensors created before
    the block are turned into fake ones when used. Code that reads values (``.item()``, printing,
    data-dependent shapes) cannot run fake.

    What autograd saves for backward is read from each new autograd node, not through saved-tensor
    hooks: the program runs with autograd's own saving, version checks and error messages. Under the
    user's own saved-tensor hooks (checkpointing, offloading) the nodes are not read, and "saved"
    means made in forward and freed in backward.

    ``steps=range(a, b)`` records only training steps ``a`` to ``b - 1`` of the block (a step ends when
    an optimizer's ``step()`` returns; step 0 starts with the block), and runs the rest untracked at
    full speed: what a run of hours needs (see :mod:`memtrim.capture.steps`).

    While the block runs, ``torch.compile``'d code runs eagerly (:mod:`memtrim.capture.compiled`), and
    a process forked inside it records nothing (:mod:`memtrim.capture.fork`).
    """
    trace = TraceLog(fake=fake)
    trace.metadata[PID_KEY] = os.getpid()
    fake_mode = None
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    recorder = Recorder(trace, fake_mode)
    cuda = _CudaPeak()
    world = distributed.world()  # also read at the end: the program may start or end its group inside
    with contextlib.ExitStack() as stack:
        stack.callback(_note_world, trace, world)
        stack.callback(compiled.release, trace, compiled.acquire())
        outside.acquire()
        stack.callback(outside.release)
        if fake_mode is not None:
            stack.enter_context(fake_mode)
        if steps is None:
            cuda.begin()
            stack.callback(lambda: trace.cuda_max_allocated.update(cuda.end()))
        stack.enter_context(recorder)
        stack.callback(recorder.finish)
        if steps is not None:
            window = StepWindow(recorder, trace, steps, finish=recorder.finish, **_window_cuda(trace))
            stack.callback(window.end)
            window.begin()
        try:
            yield trace
        except BaseException as exc:
            trace.error = f"{type(exc).__name__}: {exc}"
            raise
