"""The JSON report: the raw trace log plus the figures a program consuming it wants first."""

from __future__ import annotations

from typing import Any

from memtrim.analysis.diagnoses import diagnose
from memtrim.analysis.timeline import find_peak, largest_temporaries, live_at_peak, peaks_by_device
from memtrim.trace.model import Trace
from memtrim.trace.serialize import trace_to_dict


def summary(trace: Trace) -> dict[str, Any]:
    return {
        "peak_bytes": find_peak(trace).bytes,
        "peak": find_peak(trace).describe(),
        "peak_bytes_by_device": {device: p.bytes for device, p in peaks_by_device(trace).items()},
        "live_at_peak": [group.describe() for group in live_at_peak(trace)[:20]],
        "largest_temporaries": [a.describe() for a in largest_temporaries(trace, 20)],
        "diagnoses": [
            {
                "rule": d.rule,
                "problem": d.problem,
                "advice": d.advice,
                "file": d.site.file if d.site else None,
                "line": d.site.line if d.site else None,
                "peak_after": d.peak_after,
                "allocations": [a.id for a in d.allocations],
            }
            for d in diagnose(trace)
        ],
    }


def trace_json(trace: Trace) -> dict[str, Any]:
    """``{schema, <summary figures>, <raw log>}``; memtrim.load reads the raw log and ignores the rest."""
    raw = trace_to_dict(trace)
    return {"schema": raw.pop("schema"), **summary(trace), **raw}
