"""Measure a rewrite against the original in one run: peak bytes, largest temporary, median time.

Timings are A/B interleaved (before, after, before, after, ...) so that drift in the machine's speed
hits both sides alike, and summarised by medians. Memory comes from one extra tracked run of each,
outside the timed runs, so tracking overhead never enters a timing.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from memtrim.capture.api import track
from memtrim.report.units import format_bytes
from memtrim.trace.model import Allocation


@dataclass
class Side:
    name: str
    peak_bytes: int
    largest_temporary: Allocation | None
    seconds: list[float] = field(default_factory=list)

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.seconds) if self.seconds else float("nan")

    @property
    def largest_temporary_bytes(self) -> int:
        return self.largest_temporary.bytes if self.largest_temporary else 0


@dataclass
class Comparison:
    before: Side
    after: Side

    @property
    def speedup(self) -> float:
        """before / after median time: above 1 means the rewrite is faster."""
        return self.before.median_seconds / self.after.median_seconds

    @property
    def peak_saved(self) -> int:
        return self.before.peak_bytes - self.after.peak_bytes

    def rows(self) -> list[list[str]]:
        b, a = self.before, self.after
        return [
            ["", b.name, a.name, "change"],
            [
                "peak above start",
                format_bytes(b.peak_bytes),
                format_bytes(a.peak_bytes),
                f"-{format_bytes(self.peak_saved)}",
            ],
            [
                "largest temporary",
                format_bytes(b.largest_temporary_bytes),
                format_bytes(a.largest_temporary_bytes),
                f"{b.largest_temporary_bytes / max(a.largest_temporary_bytes, 1):.1f}x smaller",
            ],
            [
                f"median time ({len(b.seconds)} runs)",
                f"{b.median_seconds * 1e3:.2f} ms",
                f"{a.median_seconds * 1e3:.2f} ms",
                f"{self.speedup:.2f}x faster" if self.speedup >= 1 else f"{1 / self.speedup:.2f}x slower",
            ],
        ]

    def to_markdown(self) -> str:
        rows = self.rows()
        lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
        lines += ["| " + " | ".join(row) + " |" for row in rows[1:]]
        return "\n".join(lines)

    def __str__(self) -> str:
        rows = self.rows()
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _timed(fn: Callable[[], Any]) -> float:
    _synchronize()
    start = time.perf_counter()
    fn()
    _synchronize()
    return time.perf_counter() - start


def compare(
    before: Callable[[], Any],
    after: Callable[[], Any],
    *,
    repeats: int = 7,
    warmup: int = 1,
    names: tuple[str, str] = ("before", "after"),
) -> Comparison:
    """Run ``before`` and ``after`` (each the whole workload, no arguments) side by side.

    Each callable should create or reset whatever state it needs (e.g. ``zero_grad``) so that runs are
    alike. Results are discarded.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    sides = []
    for name, fn in zip(names, (before, after), strict=True):
        with track() as trace:
            fn()
        temps = trace.largest_temporaries(1)
        sides.append(Side(name, trace.peak_bytes, temps[0] if temps else None))
    for _ in range(warmup):
        before()
        after()
    for _ in range(repeats):
        sides[0].seconds.append(_timed(before))
        sides[1].seconds.append(_timed(after))
    return Comparison(sides[0], sides[1])
