"""Measure a rewrite against the original in one run: peak bytes, largest temporary, median time.

Each side runs once untracked first (warm-up: lazily built buffers, caches and one-time costs land
there, not in either side's figures), then once tracked for memory, then the timed runs, A/B
interleaved (before, after, before, after, ...) so that drift in the machine's speed hits both sides
alike, summarised by medians. Tracking overhead never enters a timing.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from memtrim.analysis.analysis import analyze
from memtrim.analysis.footprint import Footprint
from memtrim.capture.api import record
from memtrim.units import format_bytes, format_delta, format_ratio


@dataclass
class Side:
    """One callable's figures: its memory footprint and its timed runs."""

    name: str
    memory: Footprint
    seconds: list[float] = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:
        return self.memory.peak_bytes

    @property
    def largest_temporary_bytes(self) -> int:
        return self.memory.largest_temporary_bytes

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.seconds) if self.seconds else float("nan")


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
        """Bytes the rewrite takes off the peak (negative when the peak grows)."""
        return self.before.peak_bytes - self.after.peak_bytes

    def rows(self) -> list[list[str]]:
        b, a = self.before, self.after
        speed = self.speedup
        if speed != speed:  # NaN: no timed runs
            timing = "-"
        elif speed >= 1:
            timing = f"{speed:.2f}x faster"
        else:
            timing = f"{1 / speed:.2f}x slower"
        return [
            ["", b.name, a.name, "change"],
            [
                "peak above start",
                format_bytes(b.peak_bytes),
                format_bytes(a.peak_bytes),
                format_delta(b.peak_bytes, a.peak_bytes),
            ],
            [
                "largest temporary",
                format_bytes(b.largest_temporary_bytes),
                format_bytes(a.largest_temporary_bytes),
                format_ratio(b.largest_temporary_bytes, a.largest_temporary_bytes),
            ],
            [
                f"median time ({len(b.seconds)} runs)",
                f"{b.median_seconds * 1e3:.2f} ms",
                f"{a.median_seconds * 1e3:.2f} ms",
                timing,
            ],
        ]

    def to_dict(self) -> dict[str, Any]:
        def side(s: Side) -> dict[str, Any]:
            return {
                "name": s.name,
                **s.memory.to_dict(),
                "median_seconds": s.median_seconds,
                "seconds": s.seconds,
            }

        return {
            "before": side(self.before),
            "after": side(self.after),
            "peak_saved": self.peak_saved,
            "speedup": self.speedup,
        }

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
    alike. Results are discarded. ``warmup`` untracked runs of each come first (at least one), so that
    neither side's memory figure pays for one-time work the other then reuses.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be 0 or more, got {warmup}")
    for _ in range(max(warmup, 1)):
        before()
        after()
    sides = []
    for name, fn in zip(names, (before, after), strict=True):
        with record() as log:
            fn()
        sides.append(Side(name, Footprint.of(analyze(log))))
    for _ in range(repeats):
        sides[0].seconds.append(_timed(before))
        sides[1].seconds.append(_timed(after))
    return Comparison(sides[0], sides[1])
