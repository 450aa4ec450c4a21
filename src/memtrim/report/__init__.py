"""The report stage: views of a trace for people (terminal) and programs (JSON via Trace.to_dict)."""

from memtrim.report.terminal import render
from memtrim.report.units import format_bytes

__all__ = ["format_bytes", "render"]
