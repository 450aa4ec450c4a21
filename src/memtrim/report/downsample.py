"""Thinning a long curve for a picture without losing its peak: split the event axis into buckets (one
per pixel column, or per slice of a viewer's time axis) and keep, in each, its first lowest and its
first highest event. The curve's highest point is the highest of its bucket, so it survives exactly
(the first event at that height, as :meth:`~memtrim.analysis.LiveCurve.peak_index` picks it), and so
does every dip; the values kept are the curve's own, never averages.

Each bucket is scanned with C-level ``max``/``min``/``index`` over a slice (no Python loop per event):
a million events thin in a few tens of milliseconds.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Sequence


def starts_at(keys: Sequence[int], boundaries: Iterable[int]) -> list[int]:
    """The first index of sorted ``keys`` at or after each boundary: where each bucket starts."""
    return [bisect.bisect_left(keys, b) for b in boundaries]


def extremes(values: Sequence[int], starts: Sequence[int]) -> list[int]:
    """Indexes of ``values`` to keep, in order, without repeats: for each bucket (``starts[k]`` up to
    the next start; the last bucket runs to the end) its first lowest and its first highest value, and
    the last index (where the curve ends)."""
    n = len(values)
    bounds = sorted({min(max(s, 0), n) for s in starts} | {0, n})
    keep: list[int] = []
    for lo, hi in itertools.pairwise(bounds):
        if hi - lo <= 2:
            keep.extend(range(lo, hi))
            continue
        bucket = values[lo:hi]
        low = lo + bucket.index(min(bucket))
        high = lo + bucket.index(max(bucket))
        keep.extend((low, high) if low < high else (high, low) if high < low else (low,))
    if n and keep[-1] != n - 1:
        keep.append(n - 1)
    return keep


def merged(*groups: Iterable[int]) -> list[int]:
    """The union of several index lists, sorted."""
    found: set[int] = set()
    for group in groups:
        found.update(group)
    return sorted(found)


def sums_at(deltas: Sequence[int], slots: Sequence[int], count: int, keep: Sequence[int]) -> list[list[int]]:
    """Per slot (``0 <= slot < count``), the running sum of the deltas of its events, read just after
    each event of ``keep`` (sorted): ``out[slot][j]`` is the sum over events ``0..keep[j]``."""
    sums = [0] * count
    out: list[list[int]] = [[] for _ in range(count)]
    start = 0
    for k in keep:
        for delta, slot in zip(deltas[start : k + 1], slots[start : k + 1], strict=True):
            sums[slot] += delta
        start = k + 1
        for slot, value in enumerate(sums):
            out[slot].append(value)
    return out
