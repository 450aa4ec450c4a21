"""The JSON summary: the figures a program consuming a trace file wants first (the raw log follows)."""

from __future__ import annotations

from typing import Any

from memtrim.analysis import Analysis, Breakdown, LineGroup, Peak
from memtrim.doctor import Diagnosis, diagnoses
from memtrim.trace.model import Allocation


def allocation_json(analysis: Analysis, a: Allocation) -> dict[str, Any]:
    """An allocation as a flat JSON object."""
    return {
        "id": a.id,
        "bytes": a.bytes,
        "op": a.op,
        "shape": list(a.shape),
        "dtype": a.dtype,
        "device": a.device,
        "phase": a.phase.value,
        "role": analysis.role(a).value,
        "category": analysis.category(a).value,
        "file": a.file,
        "line": a.line,
        "function": a.function,
        "node": a.node,
        "module": a.module,
        "alloc_tick": a.alloc_tick,
        "free_tick": a.free_tick,
    }


def peak_json(peak: Peak) -> dict[str, Any]:
    site, a = peak.site, peak.allocation
    return {
        "bytes": peak.bytes,
        "device": peak.device,
        "tick": peak.tick,
        "phase": None if peak.phase is None else peak.phase.value,
        "op": a.op if a else None,
        "node": a.node if a else None,
        "file": site.file if site else None,
        "line": site.line if site else None,
        "function": site.function if site else None,
    }


def line_group_json(group: LineGroup) -> dict[str, Any]:
    site = group.site
    return {
        "file": site.file if site else None,
        "line": site.line if site else None,
        "function": site.function if site else None,
        "bytes": group.bytes,
        "count": group.count,
        "categories": {category.value: n for category, n in group.categories.items()},
        "roles": {role.value: n for role, n in group.roles.items()},
        "kept_after_forward": group.kept_after_forward,
        "ops": dict(group.ops),
    }


def diagnosis_json(d: Diagnosis) -> dict[str, Any]:
    return {
        "rule": d.rule,
        "file": d.site.file if d.site else None,
        "line": d.site.line if d.site else None,
        "function": d.site.function if d.site else None,
        "module": d.module,
        "problem": d.problem,
        "fix": d.fix,
        "bytes_at_stake": d.bytes_at_stake,
        "peak_before": d.peak_before,
        "peak_after": d.peak_after,
        "safe_because": list(d.safe_because),
        "keeps": d.keeps,
        "verify_mode": d.verify_mode,
        "code": d.code,
        "binds": {name: what for name, what in d.binds},
        "proof": d.proof,
        "ops": list(d.ops),
        "allocations": [a.id for a in d.allocations],
        "sites": [{"file": s.file, "line": s.line, "function": s.function} for s in d.sites],
        "cost": d.cost,
        "note": d.note,
    }


def breakdown_json(b: Breakdown) -> dict[str, Any]:
    """``{"made": {role: bytes}, "preexisting": {role: bytes}, "preexisting_freed": bytes, "tick": t}``."""
    return {
        "tick": b.tick,
        "device": b.device,
        "made": {role.value: n for role, n in b.made.items()},
        "preexisting": {role.value: n for role, n in b.preexisting.items()},
        "preexisting_freed": b.preexisting_freed,
    }


def summary(analysis: Analysis, *, rows: int = 20) -> dict[str, Any]:
    """The derived figures, ``rows`` per list."""
    return {
        "peak_bytes": analysis.peak.bytes,
        "peak": peak_json(analysis.peak),
        "peak_bytes_by_device": {device: p.bytes for device, p in analysis.peaks.items()},
        "peak_by_phase": {phase.value: n for phase, n in analysis.peak_by_phase.items()},
        # bytes by role alive at the peak, made in the region: they sum to the peak, less any
        # pre-region bytes freed before it (``preexisting_freed_at_peak``)
        "breakdown_at_peak": {role.value: n for role, n in analysis.breakdown_at_peak.made.items()},
        "preexisting_at_peak": {role.value: n for role, n in analysis.breakdown_at_peak.preexisting.items()},
        "preexisting_freed_at_peak": analysis.breakdown_at_peak.preexisting_freed,
        "breakdown_at_phase_end": {
            phase.value: breakdown_json(b) for phase, b in analysis.breakdown_at_phase_end.items()
        },
        "live_at_peak": [line_group_json(g) for g in analysis.lines_at_peak[:rows]],
        "largest_temporaries": [allocation_json(analysis, a) for a in analysis.largest_temporaries(rows)],
        "diagnoses": [diagnosis_json(d) for d in diagnoses(analysis)],
        "alive_at_failure": failure_json(analysis),
    }


def failure_json(analysis: Analysis, *, rows: int = 20) -> dict[str, Any] | None:
    """The post-mortem, or None when the region did not fail."""
    f = analysis.failure
    if f is None:
        return None
    return {
        "error": f.error,
        "tick": f.tick,
        "op": None if f.op is None else f.op.op,
        "phase": None if f.op is None else f.op.phase.value,
        "file": None if f.op is None or f.op.site is None else f.op.site.file,
        "line": None if f.op is None or f.op.site is None else f.op.site.line,
        "function": None if f.op is None or f.op.site is None else f.op.site.function,
        "requested_bytes": f.requested_bytes,
        "live_bytes": f.live_bytes,
        "by_role": breakdown_json(f.breakdown),
        "by_line": [line_group_json(g) for g in f.lines[:rows]],
    }
