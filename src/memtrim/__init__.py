"""memtrim: find what sets a PyTorch program's peak memory, cut it, and prove the rewrite safe."""

from __future__ import annotations

from memtrim.capture import track
from memtrim.trace import Allocation, Site, Trace, TraceFormatError, load
from memtrim.verify import CancellationProbe, VerifyReport, verify

__version__ = "0.1.0"

__all__ = [
    "Allocation",
    "CancellationProbe",
    "Site",
    "Trace",
    "TraceFormatError",
    "VerifyReport",
    "load",
    "track",
    "verify",
]
