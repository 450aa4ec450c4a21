"""The analysis stage: questions answered from a trace (peak, live set, categories, temporaries)."""

from memtrim.analysis.categories import categorize
from memtrim.analysis.timeline import (
    LineGroup,
    Peak,
    alive_at,
    find_peak,
    largest_temporaries,
    live_at_peak,
    live_curve,
    peaks_by_device,
)

__all__ = [
    "LineGroup",
    "Peak",
    "alive_at",
    "categorize",
    "find_peak",
    "largest_temporaries",
    "live_at_peak",
    "live_curve",
    "peaks_by_device",
]
