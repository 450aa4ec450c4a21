"""The analysis stage: one :class:`Analysis` per trace log (peaks, live sets, categories, temporaries,
what-if), computed once. The diagnosis rules read it from the stage above (:mod:`memtrim.doctor`)."""

from memtrim.analysis.analysis import Analysis, Breakdown, Failure, LineGroup, analyze, group_by_line
from memtrim.analysis.categories import CATEGORY_RULES, Category, categorize
from memtrim.analysis.footprint import Footprint, peak_change
from memtrim.analysis.roles import ROLE_RULES, Role, role_of
from memtrim.analysis.timeline import LiveCurve, Peak, sweep
from memtrim.analysis.whatif import Added, Edits, replay

__all__ = [
    "CATEGORY_RULES",
    "ROLE_RULES",
    "Added",
    "Analysis",
    "Breakdown",
    "Category",
    "Edits",
    "Failure",
    "Footprint",
    "LineGroup",
    "LiveCurve",
    "Peak",
    "Role",
    "analyze",
    "categorize",
    "group_by_line",
    "peak_change",
    "replay",
    "role_of",
    "sweep",
]
