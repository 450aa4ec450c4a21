"""Side-by-side measurement of two callables: peak memory (tracked) and median time (untracked)."""

from memtrim.bench.measure import Comparison, Side, compare

__all__ = ["Comparison", "Side", "compare"]
