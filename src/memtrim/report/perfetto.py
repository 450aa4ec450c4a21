"""Export to Perfetto (ui.perfetto.dev) and chrome://tracing: Chrome trace-event JSON with one slice per
op on one track per phase, one slice per region, and per device a memory counter track per role plus
the live bytes above the region's start.

Time is memtrim's event clock (one tick per op, allocation or free, shown as microseconds), not wall
time: the picture is the order of events and the bytes, which is what a trace records.
"""

from __future__ import annotations

import json
from typing import Any

from memtrim.analysis import Analysis, Role
from memtrim.report.files import write_text
from memtrim.trace.collector import collector_paused
from memtrim.trace.model import Phase, site_text

PID = 1
PHASE_TIDS = {Phase.FORWARD: 1, Phase.BACKWARD: 2, Phase.OPTIMIZER: 3, Phase.OTHER: 4}
REGION_TID = 9
LIVE = "live above start"
FREED_BEFORE = "from before the region, freed"


def _meta(name: str, tid: int | None, value: str) -> dict[str, Any]:
    event: dict[str, Any] = {"ph": "M", "name": name, "pid": PID, "args": {"name": value}}
    if tid is not None:
        event["tid"] = tid
    return event


def chrome_trace(analysis: Analysis) -> dict[str, Any]:
    """The trace as a Chrome trace-event object (``{"traceEvents": [...]}``)."""
    log = analysis.log
    events: list[dict[str, Any]] = [
        _meta("process_name", None, "memtrim trace" + (" (fake tensors)" if log.fake else ""))
    ]
    for phase, tid in PHASE_TIDS.items():
        events.append(_meta("thread_name", tid, f"ops: {phase.value}"))
        events.append(
            {"ph": "M", "name": "thread_sort_index", "pid": PID, "tid": tid, "args": {"sort_index": tid}}
        )
    rows = log.ops.rows
    for i, row in enumerate(rows):
        end = rows[i + 1].tick if i + 1 < len(rows) else log.end_tick
        args = {"seq": i, "line": site_text(row.site, path_parts=None)}
        if row.node:
            args["node"] = row.node
        if row.module:
            args["module"] = row.module
        events.append(
            {
                "ph": "X",
                "name": row.op,
                "cat": row.phase.value,
                "pid": PID,
                "tid": PHASE_TIDS[row.phase],
                "ts": row.tick,
                "dur": max(1, end - row.tick),
                "args": args,
            }
        )
    if log.regions:
        events.append(_meta("thread_name", REGION_TID, "regions"))
        for r in log.regions:
            end = r.end_tick if r.end_tick is not None else log.end_tick
            events.append(
                {
                    "ph": "X",
                    "name": r.name,
                    "cat": "region",
                    "pid": PID,
                    "tid": REGION_TID,
                    "ts": r.start_tick,
                    "dur": max(1, end - r.start_tick),
                    "args": {"open at the end": r.end_tick is None},
                }
            )
    allocations = analysis.allocations
    for device, curve in analysis.curves.items():
        sums = dict.fromkeys((role.value for role in Role), 0)
        freed = 0
        seen: set[str] = set()  # a counter holds its last value: a role that drops to 0 must say so
        name = f"memory {device}"
        for tick, delta, ident, live in zip(curve.ticks, curve.deltas, curve.ids, curve.live, strict=True):
            a = allocations[ident]
            if a.preexisting:
                freed -= delta
            else:
                role = analysis.roles[ident].value
                sums[role] += delta
                seen.add(role)
            counters: dict[str, int] = {role: n for role, n in sums.items() if role in seen}
            if freed or FREED_BEFORE in seen:
                seen.add(FREED_BEFORE)
                counters[FREED_BEFORE] = -freed
            events.append({"ph": "C", "name": name, "pid": PID, "ts": tick, "args": counters or {"none": 0}})
            events.append(
                {"ph": "C", "name": f"{LIVE} {device}", "pid": PID, "ts": tick, "args": {"bytes": live}}
            )
    peak = analysis.peak
    if peak.tick is not None:
        events.append(
            {
                "ph": "i",
                "name": f"peak {peak.bytes} B",
                "s": "g",
                "pid": PID,
                "tid": PHASE_TIDS[peak.allocation.phase] if peak.allocation else 4,
                "ts": peak.tick,
            }
        )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ns",
        "otherData": {"tool": "memtrim", "clock": "event ticks"},
    }


def save(analysis: Analysis, path: str) -> None:
    """Write the Chrome trace JSON to ``path`` atomically (open it at ui.perfetto.dev)."""
    with collector_paused():
        write_text(path, json.dumps(chrome_trace(analysis), separators=(",", ":"), allow_nan=False))
