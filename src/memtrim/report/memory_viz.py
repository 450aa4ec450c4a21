"""Export to PyTorch's memory viewer (pytorch.org/memory_viz): a snapshot pickle in the format
``torch.cuda.memory._dump_snapshot`` writes, made from a memtrim trace — so CPU and fake-tensor runs,
which PyTorch's own recorder cannot capture, open there too, with memtrim's source lines.

What the viewer needs, and how it is met:

- pickle protocol 4 (its unpickler rejects 5) of dicts, lists, strings, ints and floats only;
- top-level ``segments`` and ``device_traces``, both present (one trace list per device index);
- trace entries with ``action`` (``alloc``, then ``free_requested`` and ``free_completed``), a synthetic
  unique ``addr``, ``size``, ``stream`` 0, ``frames`` (``filename``/``line``/``name``, strings and ints,
  never None), a monotone ``time_us`` (memtrim's event clock, not wall time), and ``user_metadata``
  (op, phase, role, node, module, shape, dtype, and the innermost ``memtrim.region``); a backward
  op's frames start at the forward line;
- one synthetic segment per device whose blocks tile every block ever live (its "Allocator State
  History" looks each block up in a segment);
- entries carry their role as ``category``; blocks alive at the end come from the segment without
  one, and the viewer files those under ``unknown``, which must then be a category: a final
  ``snapshot`` entry carries it;
- a tensor from before the region freed inside it is a free with no alloc.

Long traces: the viewer keeps every event in the page, and issue 22 reports it dropping events past about
:data:`VIEWER_EVENT_LIMIT`; :func:`save` returns how many events it will list per device
(:func:`viewer_events`, counted by its own rule: a ``free_requested`` followed by the same block's
``free_completed`` is one ``free``), and ``memtrim export --memory-viz`` prints it (:func:`viewer_note`).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

from memtrim.analysis import Analysis
from memtrim.report.files import write_bytes_atomically
from memtrim.trace.collector import collector_paused
from memtrim.trace.model import Allocation, shape_text

PROTOCOL = 4
BASE_ADDRESS = 0x7F0000000000
UNKNOWN = "unknown"
VIEWER_EVENT_LIMIT = 600_000
"""Events per device past which pytorch.org/memory_viz is known to drop events (issue 22's figure: the
viewer holds every event, and its page gives out near there; MemoryViz.js has no such constant)."""
VIEWER_DRAWN_ALLOCATIONS = 15_000
"""Allocations its Active Memory Timeline draws by default, the largest (``create_trace_view``'s
``max_entries`` in MemoryViz.js; the rest are summed into one band, its Detail slider draws more)."""


@dataclass(frozen=True)
class ViewerEvents:
    """What the viewer will list for one device of a snapshot."""

    device: str
    index: int
    """The device number the viewer's device menu shows (:func:`device_indices`)."""
    events: int
    """Entries after its own merging of each ``free_requested``/``free_completed`` pair into a ``free``."""
    allocations: int
    """``alloc`` entries: blocks its Active Memory Timeline can draw."""


def device_indices(devices: list[str]) -> dict[str, int]:
    """``cuda:N`` keeps index N; other devices (the CPU, ``meta``) follow the highest CUDA index."""
    indices: dict[str, int] = {}
    for device in devices:
        kind, _, number = device.partition(":")
        if kind == "cuda":
            indices[device] = int(number or 0)
    following = max(indices.values(), default=-1) + 1
    for device in sorted(devices):
        if device not in indices:
            indices[device] = following
            following += 1
    return indices


def _frames(a: Allocation) -> list[dict[str, Any]]:
    frames = []
    for site in (a.site, a.call_site):
        if site is not None:
            frames.append(
                {"filename": site.file or "?", "line": int(site.line), "name": site.function or "?"}
            )
    if not frames and not a.preexisting:
        frames.append({"filename": "(no user frame)", "line": 0, "name": a.op})
    return frames


def regions_at_alloc(analysis: Analysis) -> dict[int, str]:
    """Allocation id -> the innermost ``memtrim.region`` open when it was made (if any)."""
    log = analysis.log
    spans = sorted(
        (r.start_tick, r.end_tick if r.end_tick is not None else log.end_tick, r.name) for r in log.regions
    )
    found: dict[int, str] = {}
    if not spans:
        return found
    open_spans: list[tuple[int, int, str]] = []
    following = 0
    for a in sorted((a for a in analysis.allocations if not a.preexisting), key=lambda a: a.alloc_tick):
        while following < len(spans) and spans[following][0] <= a.alloc_tick:
            open_spans.append(spans[following])
            following += 1
        open_spans = [s for s in open_spans if s[1] > a.alloc_tick]
        if open_spans:
            found[a.id] = open_spans[-1][2]
    return found


def _metadata(analysis: Analysis, a: Allocation, region: str | None) -> dict[str, str]:
    extra = {"region": region} if region else {}
    return {
        **extra,
        "op": a.op,
        "phase": a.phase.value,
        "role": analysis.role(a).value,
        "node": a.node or "",
        "module": a.module or "",
        "shape": shape_text(a.shape),
        "dtype": a.dtype,
    }


def snapshot(analysis: Analysis) -> dict[str, Any]:
    """The snapshot as plain data (what :func:`save` pickles)."""
    allocations = analysis.allocations
    devices = sorted({a.device for a in allocations})
    indices = device_indices(devices)
    traces: list[list[dict[str, Any]]] = [[] for _ in range(max(indices.values(), default=-1) + 1)]
    segments = []
    for device in devices:
        curve = analysis.curve(device)
        charged = curve.charged
        index = indices[device]
        entries: list[tuple[int, int, dict[str, Any]]] = []
        blocks: list[dict[str, Any]] = []
        regions = regions_at_alloc(analysis)
        address = BASE_ADDRESS
        for a in allocations:
            if a.device != device:
                continue
            size = charged.get(a.id, a.bytes)
            frames = _frames(a)
            metadata = _metadata(analysis, a, regions.get(a.id))
            common = {
                "addr": address,
                "size": size,
                "stream": 0,
                "frames": frames,
                "category": metadata["role"],
                "user_metadata": metadata,
            }
            if not a.preexisting:
                entries.append((a.alloc_tick, 0, {"action": "alloc", **common}))
            if a.free_tick is not None:
                entries.append((a.free_tick, 0, {"action": "free_requested", **common}))
                entries.append((a.free_tick, 1, {"action": "free_completed", **common}))
            alive = a.free_tick is None
            blocks.append(
                {
                    "address": address,
                    "size": size,
                    "requested_size": a.bytes if alive else 0,
                    "state": "active_allocated" if alive else "inactive",
                    "frames": frames if alive else [],
                }
            )
            address += size
        entries.sort(key=lambda e: (e[0], e[1]))
        trace = traces[index]
        for tick, half, entry in entries:
            trace.append({**entry, "time_us": 2 * tick + half})
        trace.append(
            {
                "action": "snapshot",
                "addr": 0,
                "size": 0,
                "stream": 0,
                "frames": [],
                "category": UNKNOWN,
                "time_us": 2 * analysis.log.end_tick,
                "user_metadata": {},
            }
        )
        active = [b for b in blocks if b["state"] == "active_allocated"]
        segments.append(
            {
                "device": index,
                "address": BASE_ADDRESS,
                "total_size": address - BASE_ADDRESS,
                "allocated_size": sum(b["size"] for b in active),
                "active_size": sum(b["size"] for b in active),
                "requested_size": sum(b["requested_size"] for b in active),
                "stream": 0,
                "segment_type": "large",
                "segment_pool_id": (0, 0),
                "is_expandable": False,
                "frames": [],
                "blocks": blocks,
            }
        )
    return {"segments": segments, "device_traces": traces, "allocator_settings": {}}


def viewer_events(snap: dict[str, Any], devices: dict[int, str]) -> list[ViewerEvents]:
    """Per device with events, what the viewer lists, counted by its own rule (``annotate_snapshot`` in
    MemoryViz.js): a ``free_completed`` right after a ``free_requested`` of the same address is merged
    into it, every other entry is one event. ``devices`` names each device index."""
    found = []
    for index, trace in enumerate(snap["device_traces"]):
        events = allocations = 0
        previous: dict[str, Any] | None = None
        for entry in trace:
            action = entry["action"]
            merged = (
                action == "free_completed"
                and previous is not None
                and previous["action"] == "free_requested"
                and previous["addr"] == entry["addr"]
            )
            if not merged:
                events += 1
                allocations += action == "alloc"
                previous = entry
            else:
                previous = None  # the pair is one "free" now; nothing merges into it
        if trace:
            found.append(ViewerEvents(devices.get(index, str(index)), index, events, allocations))
    return found


def viewer_note(counts: list[ViewerEvents]) -> str:
    """What ``memtrim export --memory-viz`` prints: per device, the events the viewer will list, and
    what to do when they pass :data:`VIEWER_EVENT_LIMIT`."""
    parts = []
    for c in counts:
        over = (
            f", more than the about {VIEWER_EVENT_LIMIT:,} past which its viewer is known to drop events "
            "(record fewer steps with memtrim.track(steps=N), or a smaller memtrim.region, to see them all)"
            if c.events > VIEWER_EVENT_LIMIT
            else ""
        )
        drawn = (
            f"; its Active Memory Timeline draws the {VIEWER_DRAWN_ALLOCATIONS:,} largest of "
            f"{c.allocations:,} allocations at first (its Detail slider draws more)"
            if c.allocations > VIEWER_DRAWN_ALLOCATIONS
            else ""
        )
        parts.append(f"{c.device} (device {c.index}): {c.events:,} events{over}{drawn}")
    return "memory_viz will list " + ("; ".join(parts) if parts else "no events")


def dumps(analysis: Analysis) -> bytes:
    return pickle.dumps(snapshot(analysis), protocol=PROTOCOL)


def save(analysis: Analysis, path: str) -> list[ViewerEvents]:
    """Write the snapshot pickle to ``path`` atomically (open it at pytorch.org/memory_viz); returns
    what the viewer will list per device (:func:`viewer_events`)."""
    with collector_paused():
        snap = snapshot(analysis)
        write_bytes_atomically(path, pickle.dumps(snap, protocol=PROTOCOL))
        names = device_indices(sorted({a.device for a in analysis.allocations}))
        devices = {index: device for device, index in names.items()}
        return viewer_events(snap, devices)
