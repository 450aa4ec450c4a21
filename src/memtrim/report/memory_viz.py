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
"""

from __future__ import annotations

import pickle
from typing import Any

from memtrim.analysis import Analysis
from memtrim.report.files import write_bytes_atomically
from memtrim.trace.collector import collector_paused
from memtrim.trace.model import Allocation, shape_text

PROTOCOL = 4
BASE_ADDRESS = 0x7F0000000000
UNKNOWN = "unknown"


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


def dumps(analysis: Analysis) -> bytes:
    return pickle.dumps(snapshot(analysis), protocol=PROTOCOL)


def save(analysis: Analysis, path: str) -> None:
    """Write the snapshot pickle to ``path`` atomically (open it at pytorch.org/memory_viz)."""
    with collector_paused():
        write_bytes_atomically(path, dumps(analysis))
