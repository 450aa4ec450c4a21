"""The report stage: views of an :class:`~memtrim.analysis.Analysis` for people (terminal) and
programs (the JSON summary saved with a trace)."""

from memtrim.report.escape import safe
from memtrim.report.json import summary
from memtrim.report.terminal import render

__all__ = ["render", "safe", "summary"]
