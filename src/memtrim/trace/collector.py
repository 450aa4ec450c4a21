"""Python's cyclic garbage collector paused while memtrim builds or walks a large trace.

Reading, writing, analysing or diagnosing a million-op trace makes millions of small objects and no
reference cycles; every collection those allocations trigger walks every live object (the user's too),
which measured half the time of parsing such a trace and of analysing it. Pausing is safe: nothing memtrim
makes needs the cycle collector, and cycles the user's program left behind are collected as soon as the
block ends.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The collector off for the block, then back as it was (a caller that had it off keeps it off)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
