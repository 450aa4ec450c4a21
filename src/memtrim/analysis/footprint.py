"""A run's memory in two figures — its peak and its largest temporary — the one type every before/after
comparison (``memtrim.verify``, ``memtrim.bench.compare``, the demos) reports."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from memtrim.analysis.analysis import Analysis
from memtrim.units import format_bytes


@dataclass(frozen=True)
class Footprint:
    """Peak bytes above the start of a tracked run, and its largest temporary."""

    peak_bytes: int
    largest_temporary_bytes: int
    largest_temporary_where: str | None = None
    """``aten.mul.Tensor at heads.py:63``."""

    @classmethod
    def of(cls, analysis: Analysis) -> Footprint:
        temps = analysis.largest_temporaries(1)
        if not temps:
            return cls(analysis.peak.bytes, 0, None)
        t = temps[0]
        loc = f"{os.path.basename(t.file)}:{t.line}" if t.file else "?"
        return cls(analysis.peak.bytes, t.bytes, f"{t.op} at {loc}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "peak_bytes": self.peak_bytes,
            "largest_temporary_bytes": self.largest_temporary_bytes,
            "largest_temporary_where": self.largest_temporary_where,
        }

    def temporary_text(self) -> str:
        if not self.largest_temporary_bytes:
            return "none"
        return f"{format_bytes(self.largest_temporary_bytes)} ({self.largest_temporary_where or '?'})"


def peak_change(before: Footprint, after: Footprint) -> str:
    """'2.81 MiB less at peak (3.07 MiB -> 264 KiB)', or '... MORE at peak ...' when it grew."""
    saved = before.peak_bytes - after.peak_bytes
    if saved == 0:
        change = "the same peak"
    else:
        change = f"{format_bytes(abs(saved))} {'less' if saved > 0 else 'MORE'} at peak"
    return f"{change} ({format_bytes(before.peak_bytes)} -> {format_bytes(after.peak_bytes)})"
