"""Side-by-side measurement of two callables: peak memory (tracked) and median time (untracked)."""

from memtrim.bench.compare import Comparison, Side, compare

__all__ = ["Comparison", "Side", "compare"]
