"""``memtrim.region(name)``: a named span of the recorded timeline, and what ``memtrim run --region``
records.

Inside a tracked block, entering a region marks its start (and leaving it, its end) on the clock of
every recorder that is running, so views show it as a named span. Outside any tracked block it costs
nothing and records nothing, so a script can keep its regions when it runs untracked.

``memtrim run --region NAME`` records only the code inside ``memtrim.region(NAME)``: each entry of that
region is one recorded trace (:func:`capture_region`), and what the script does outside it runs
untracked, at full speed.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field

from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from memtrim.capture.api import record
from memtrim.capture.recorder import Recorder
from memtrim.capture.source import remember_source_lines
from memtrim.trace.model import Region, TraceLog


@dataclass
class RegionCapture:
    """The traces recorded for one region name, one per entry, in the order entered."""

    name: str
    fake: bool = False
    traces: list[TraceLog] = field(default_factory=list)
    recording: bool = False


_capture: RegionCapture | None = None


def _running_recorders() -> list[Recorder]:
    return [
        m for m in _get_current_dispatch_mode_stack() if isinstance(m, Recorder) and m.trace.finished is False
    ]


def _now(recorder: Recorder) -> int:
    # the recorder's own clock, so a region's ticks order with its ops, allocations and frees
    return recorder.tick()


@contextlib.contextmanager
def _mark(name: str) -> Iterator[None]:
    opened = []
    for recorder in _running_recorders():
        regions = recorder.trace.regions
        opened.append((recorder, len(regions)))
        regions.append(Region(name, _now(recorder)))
    try:
        yield
    finally:
        for recorder, index in opened:
            if not recorder.trace.finished:  # a region left after its tracker ended stays open
                regions = recorder.trace.regions
                regions[index] = dataclasses.replace(regions[index], end_tick=_now(recorder))


@contextlib.contextmanager
def region(name: str) -> Iterator[None]:
    """Mark the code inside the ``with`` block as the region ``name``.

    Inside ``memtrim.track()`` the region shows as a named span in every view of the trace. Run by
    ``memtrim run --region NAME script.py``, only the code inside ``memtrim.region(NAME)`` is recorded.
    Untracked, it does nothing.

    >>> import torch, memtrim
    >>> with memtrim.track() as trace:
    ...     with memtrim.region("step"):
    ...         y = torch.ones(1024)
    >>> [r.name for r in trace.log.regions]
    ['step']
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"memtrim.region needs a non-empty name, e.g. memtrim.region('step'); got {name!r}")
    capture = _capture
    if capture is None or capture.name != name or capture.recording:
        with _mark(name):
            yield
        return
    capture.recording = True
    try:
        with record() as log:
            log.fake = capture.fake
            capture.traces.append(log)
            with _mark(name):
                yield
    finally:
        capture.recording = False
        if capture.traces:
            remember_source_lines(capture.traces[-1])


@contextlib.contextmanager
def capture_region(name: str, *, fake: bool = False) -> Iterator[RegionCapture]:
    """Record each entry of ``memtrim.region(name)`` inside the ``with`` block into its own trace.

    ``fake`` only labels the traces: the caller runs the whole program under ``FakeTensorMode`` (what
    the program builds before the region must be fake too), and the region's recorder sits above it.
    """
    global _capture
    if _capture is not None:
        raise RuntimeError(f"already recording the region {_capture.name!r}")
    _capture = RegionCapture(name, fake)
    try:
        yield _capture
    finally:
        _capture = None
