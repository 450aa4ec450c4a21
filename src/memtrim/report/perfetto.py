"""Export to Perfetto (ui.perfetto.dev) and chrome://tracing: Chrome trace-event JSON with, on one track
per phase, a slice per stretch of that phase with the modules it ran nested inside (one slice per run
of consecutive ops in a module, by module path) and a slice per op; one slice per region; and per
device a memory counter track per role plus the live bytes above the region's start.

Time is memtrim's event clock (one tick per op, allocation or free, shown as microseconds), not wall
time: the picture is the order of events and the bytes, which is what a trace records.

Long traces stay small and quick to write (bench/views.py's million ops: 23 MB in about 1 s, where a
slice per op and a sample per event made 417 MB in 10 s):

- op slices: every op up to :data:`OP_SLICES` ops; beyond, only the ops within
  :data:`PEAK_WINDOW_OPS` either side of the peak's op. The phase and module slices cover every op at
  any length (when even those pass :data:`STRUCTURE_SLICES`, the deepest module levels are left out);
- counters: every event up to ``2 *`` :data:`COUNTER_BUCKETS` events on a device; beyond, the time
  axis is cut into that many buckets and each keeps its first lowest and first highest moment of the
  live curve (:mod:`memtrim.report.downsample`), so the peak is kept exactly, at its tick, and every
  value written is the curve's own at its tick; every event inside the peak window is kept too.
"""

from __future__ import annotations

import bisect
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

from memtrim.analysis import Analysis, LiveCurve, Role
from memtrim.report.downsample import extremes, merged, starts_at, sums_at
from memtrim.report.files import write_text
from memtrim.report.series import BEFORE_REGION, op_index, role_slots
from memtrim.trace.collector import collector_paused
from memtrim.trace.model import OpRow, Phase, site_text

PID = 1
PHASE_TIDS = {Phase.FORWARD: 1, Phase.BACKWARD: 2, Phase.OPTIMIZER: 3, Phase.OTHER: 4}
REGION_TID = 9
LIVE = "live above start"
FREED_BEFORE = "from before the region, freed"
OP_SLICES = 100_000
"""Traces with up to this many ops get a slice per op; longer ones only around the peak."""
PEAK_WINDOW_OPS = 5_000
"""Ops either side of the peak's op that keep their own slice, and whose events keep every counter
sample, in a long trace."""
COUNTER_BUCKETS = 10_000
"""Buckets of the time axis per device for a long trace's counters (two samples at most each)."""
STRUCTURE_SLICES = 250_000
"""At most this many phase and module slices: deeper module levels are left out past it."""


@dataclass(frozen=True)
class Thinning:
    """What a long trace's export kept (the file's ``otherData.thinning``, and the CLI's line)."""

    ops: int
    op_slices: int
    window: tuple[int, int] | None
    """First and last op that kept their own slice, when not every op did."""
    module_depth: int | None
    """Module levels nested as slices (None: every level)."""
    events: dict[str, int]
    """Per device, the allocation events (allocs and frees) of its curve."""
    samples: dict[str, int]
    """Per device, the moments written to its counters."""

    @property
    def thinned(self) -> bool:
        """Whether the file leaves out any op slice, module level or counter sample."""
        return (
            self.window is not None
            or self.module_depth is not None
            or any(self.samples[d] < n for d, n in self.events.items())
        )

    def text(self) -> str:
        ops = (
            f"a slice per op ({self.ops:,})"
            if self.window is None
            else f"{self.op_slices:,} op slices (ops {self.window[0]:,}-{self.window[1]:,}, around the peak) "
            f"of {self.ops:,} ops"
        )
        depth = "" if self.module_depth is None else f", module slices to depth {self.module_depth}"
        counters = "; ".join(
            f"{device}: {self.samples[device]:,} of {n:,} events"
            + (" (min/max per bucket, the peak kept)" if self.samples[device] < n else "")
            for device, n in self.events.items()
        )
        return f"{ops}, phase and module slices over all of them{depth}; counters {counters or 'none'}"


def _meta(name: str, tid: int | None, value: str) -> dict[str, Any]:
    event: dict[str, Any] = {"ph": "M", "name": name, "pid": PID, "args": {"name": value}}
    if tid is not None:
        event["tid"] = tid
    return event


def _slice(name: str, cat: str, tid: int, start: int, end: int, args: dict[str, Any]) -> dict[str, Any]:
    return {
        "ph": "X",
        "name": name,
        "cat": cat,
        "pid": PID,
        "tid": tid,
        "ts": start,
        "dur": max(1, end - start),
        "args": args,
    }


def _components(module: str | None, cache: dict[str | None, tuple[str, ...]]) -> tuple[str, ...]:
    found = cache.get(module)
    if found is None:
        found = cache[module] = tuple(module.split(".")) if module else ()
    return found


def _label(path: tuple[str, ...]) -> str:
    """A module slice's name: its last path component (with its parent's for a container index,
    ``h.0``)."""
    last = path[-1]
    return f"{path[-2]}.{last}" if last.isdigit() and len(path) > 1 else last


def _structure(rows: list[OpRow]) -> Iterator[tuple[int, int, int, str, tuple[str, ...]]]:
    """Phase runs and module runs as (depth, first op, op after the last, phase, module path): depth 0
    a stretch of consecutive ops in one phase, depth d a run of consecutive ops inside the same
    module path's first d components."""
    cache: dict[str | None, tuple[str, ...]] = {}
    first = 0
    for phase, run in itertools.groupby(map(attrgetter("phase"), rows)):
        end = first + sum(1 for _ in run)
        yield 0, first, end, phase.value, ()
        opened: list[int] = []  # per open depth, the op that opened it
        path: tuple[str, ...] = ()
        previous: str | None = None
        for i in range(first, end):
            module = rows[i].module
            if module == previous and i > first:
                continue
            previous = module
            new = _components(module, cache)
            common = 0
            for a, b in zip(path, new, strict=False):
                if a != b:
                    break
                common += 1
            while len(opened) > common:
                depth = len(opened)
                yield depth, opened.pop(), i, phase.value, path[:depth]
            opened.extend(itertools.repeat(i, len(new) - common))
            path = new
        while opened:
            depth = len(opened)
            yield depth, opened.pop(), end, phase.value, path[:depth]
        first = end


def _op_window(analysis: Analysis, op_ticks: list[int]) -> tuple[int, int] | None:
    """The ops that keep their own slice: all (None) up to :data:`OP_SLICES`, else the peak's window."""
    n = len(op_ticks)
    if n <= OP_SLICES:
        return None
    peak_tick = analysis.peak.tick
    centre = op_index(op_ticks, peak_tick) if peak_tick is not None else 0
    lo = max(0, centre - PEAK_WINDOW_OPS)
    return lo, min(n - 1, centre + PEAK_WINDOW_OPS)


def _counter_indices(curve: LiveCurve, window_ticks: tuple[int, int] | None) -> list[int]:
    n = len(curve.ticks)
    if n <= 2 * COUNTER_BUCKETS:
        return list(range(n))
    first, last = curve.ticks[0], curve.ticks[-1]
    span = last - first + 1
    boundaries = (first + -(-b * span // COUNTER_BUCKETS) for b in range(1, COUNTER_BUCKETS))
    kept = extremes(curve.live, [0, *starts_at(curve.ticks, boundaries)])
    if window_ticks is None:
        return kept
    lo = bisect.bisect_left(curve.ticks, window_ticks[0])
    hi = bisect.bisect_right(curve.ticks, window_ticks[1])
    return merged(kept, range(lo, hi))


def _counters(
    analysis: Analysis, device: str, curve: LiveCurve, window_ticks: tuple[int, int] | None
) -> tuple[list[dict[str, Any]], int]:
    keep = _counter_indices(curve, window_ticks)
    slots = role_slots(analysis, curve)
    names = [role.value for role in Role]
    sums = sums_at(curve.deltas, slots, len(names) + 1, keep)
    # a counter holds its last value: a role that drops to 0 must say so, from its first event on
    first_event = {slot: slots.index(slot) for slot in set(slots)}
    name, live_name = f"memory {device}", f"{LIVE} {device}"
    events: list[dict[str, Any]] = []
    ticks, live = curve.ticks, curve.live
    for j, i in enumerate(keep):
        counters: dict[str, int] = {
            names[slot]: sums[slot][j]
            for slot in range(len(names))
            if slot in first_event and first_event[slot] <= i
        }
        if BEFORE_REGION in first_event and first_event[BEFORE_REGION] <= i:
            counters[FREED_BEFORE] = sums[BEFORE_REGION][j]
        events.append({"ph": "C", "name": name, "pid": PID, "ts": ticks[i], "args": counters or {"none": 0}})
        events.append({"ph": "C", "name": live_name, "pid": PID, "ts": ticks[i], "args": {"bytes": live[i]}})
    return events, len(keep)


def thinned_trace(analysis: Analysis) -> tuple[dict[str, Any], Thinning]:
    """The Chrome trace-event object and what of the trace it kept (see the module docstring)."""
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
    op_ticks = list(map(attrgetter("tick"), rows))
    op_end = [*op_ticks[1:], log.end_tick] if rows else []
    tids = {phase.value: tid for phase, tid in PHASE_TIDS.items()}

    structure = list(_structure(rows))
    depth_limit: int | None = None
    if len(structure) > STRUCTURE_SLICES:
        per_depth: dict[int, int] = {}
        for depth, *_ in structure:
            per_depth[depth] = per_depth.get(depth, 0) + 1
        total, depth_limit = 0, 0
        for depth in sorted(per_depth):
            total += per_depth[depth]
            if total > STRUCTURE_SLICES:
                break
            depth_limit = depth
        structure = [s for s in structure if s[0] <= depth_limit]
    slices: list[dict[str, Any]] = []
    for depth, first, end, phase_name, path in structure:
        args: dict[str, Any] = {"ops": end - first, "first op": first, "last op": end - 1}
        if depth == 0:
            slices.append(
                _slice(phase_name, "phase", tids[phase_name], op_ticks[first], op_end[end - 1], args)
            )
        else:
            args["module"] = ".".join(path)
            slices.append(
                _slice(_label(path), "module", tids[phase_name], op_ticks[first], op_end[end - 1], args)
            )

    window = _op_window(analysis, op_ticks)
    lo, hi = window if window is not None else (0, len(rows) - 1)
    for i in range(lo, hi + 1):
        row = rows[i]
        args = {"seq": i, "line": site_text(row.site, path_parts=None)}
        if row.node:
            args["node"] = row.node
        if row.module:
            args["module"] = row.module
        slices.append(_slice(row.op, row.phase.value, PHASE_TIDS[row.phase], row.tick, op_end[i], args))
    # parents before children where they start together (viewers nest by order at equal times)
    slices.sort(key=lambda e: (e["tid"], e["ts"], -e["dur"]))
    events += slices

    if log.regions:
        events.append(_meta("thread_name", REGION_TID, "regions"))
        for r in log.regions:
            end = r.end_tick if r.end_tick is not None else log.end_tick
            events.append(
                _slice(
                    r.name, "region", REGION_TID, r.start_tick, end, {"open at the end": r.end_tick is None}
                )
            )
    window_ticks = (op_ticks[lo], op_end[hi]) if window is not None else None
    sizes: dict[str, int] = {}
    samples: dict[str, int] = {}
    for device, curve in analysis.curves.items():
        counter_events, samples[device] = _counters(analysis, device, curve, window_ticks)
        sizes[device] = len(curve)
        events += counter_events
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
    thinning = Thinning(
        ops=len(rows),
        op_slices=hi - lo + 1 if rows else 0,
        window=window,
        module_depth=depth_limit,
        events=sizes,
        samples=samples,
    )
    other: dict[str, Any] = {"tool": "memtrim", "clock": "event ticks"}
    if thinning.thinned:
        other["thinning"] = thinning.text()
    return {"traceEvents": events, "displayTimeUnit": "ns", "otherData": other}, thinning


def chrome_trace(analysis: Analysis) -> dict[str, Any]:
    """The trace as a Chrome trace-event object (``{"traceEvents": [...]}``)."""
    return thinned_trace(analysis)[0]


def save(analysis: Analysis, path: str) -> Thinning:
    """Write the Chrome trace JSON to ``path`` atomically (open it at ui.perfetto.dev); returns what
    of a long trace it kept."""
    with collector_paused():
        data, thinning = thinned_trace(analysis)
        write_text(path, json.dumps(data, separators=(",", ":"), allow_nan=False))
    return thinning
