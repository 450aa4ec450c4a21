"""JSON round trip for traces. Files are written atomically and read as JSON only (never pickle)."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from memtrim.trace.model import SCHEMA, Allocation, OpCall, OpLog, Site, Trace


class TraceFormatError(ValueError):
    """A file that is not a memtrim trace, or one written by an incompatible version."""


def _site_table(trace: Trace) -> tuple[list[Site], dict[Site, int]]:
    sites: list[Site] = []
    index: dict[Site, int] = {}

    def add(site: Site | None) -> None:
        if site is not None and site not in index:
            index[site] = len(sites)
            sites.append(site)

    for op in trace.ops:
        add(op.site)
    for alloc in trace.allocations:
        add(alloc.site)
        add(alloc.call_site)
    if trace.failed_op is not None:
        add(trace.failed_op.site)
    return sites, index


def trace_to_dict(trace: Trace) -> dict[str, Any]:
    """The raw event log as plain JSON data (derived figures are added by memtrim.report.json)."""
    sites, index = _site_table(trace)

    def ref(site: Site | None) -> int | None:
        return None if site is None else index[site]

    def op_row(op: OpCall) -> list[Any]:
        return [op.seq, op.tick, op.op, op.phase, ref(op.site), op.node, op.module]

    return {
        "schema": SCHEMA,
        "fake": trace.fake,
        "finished": trace.finished,
        "error": trace.error,
        "cuda_max_allocated": trace.cuda_max_allocated,
        "end_tick": trace.end_tick,
        "sites": [[s.file, s.line, s.function] for s in sites],
        "op_columns": ["seq", "tick", "op", "phase", "site", "node", "module"],
        "ops": [op_row(op) for op in trace.ops],
        "failed_op": None if trace.failed_op is None else op_row(trace.failed_op),
        "allocations": [
            {
                "id": a.id,
                "bytes": a.bytes,
                "dtype": a.dtype,
                "shape": list(a.shape),
                "device": a.device,
                "op": a.op,
                "phase": a.phase,
                "alloc_tick": a.alloc_tick,
                "free_tick": a.free_tick,
                "free_phase": a.free_phase,
                "site": ref(a.site),
                "call_site": ref(a.call_site),
                "node": a.node,
                "module": a.module,
                "saved": a.saved,
                "preexisting": a.preexisting,
            }
            for a in trace.allocations
        ],
    }


def trace_from_dict(data: Any) -> Trace:
    if not isinstance(data, dict) or "schema" not in data:
        raise TraceFormatError("not a memtrim trace: expected a JSON object with a 'schema' field")
    if data["schema"] != SCHEMA:
        raise TraceFormatError(
            f"trace schema {data['schema']!r} is not supported by this memtrim (reads {SCHEMA!r}); "
            "re-record the trace with this version"
        )
    try:
        sites = [Site(str(f), int(ln), str(fn)) for f, ln, fn in data["sites"]]

        def site(i: int | None) -> Site | None:
            return None if i is None else sites[i]

        def op_from_row(row: list[Any]) -> OpCall:
            seq, tick, op, phase, site_index, node, module = row
            return OpCall(seq, tick, op, phase, site(site_index), node, module)

        allocations = [
            Allocation(
                id=a["id"],
                bytes=a["bytes"],
                dtype=a["dtype"],
                shape=tuple(a["shape"]),
                device=a["device"],
                op=a["op"],
                phase=a["phase"],
                alloc_tick=a["alloc_tick"],
                free_tick=a["free_tick"],
                free_phase=a["free_phase"],
                site=site(a["site"]),
                call_site=site(a["call_site"]),
                node=a["node"],
                module=a["module"],
                saved=a["saved"],
                preexisting=a["preexisting"],
            )
            for a in data["allocations"]
        ]
        ops = OpLog()
        for row in data["ops"]:
            ops.append(op_from_row(row))
        return Trace(
            ops=ops,
            allocations=allocations,
            end_tick=data["end_tick"],
            fake=data["fake"],
            error=data["error"],
            failed_op=None if data["failed_op"] is None else op_from_row(data["failed_op"]),
            cuda_max_allocated=dict(data["cuda_max_allocated"]),
            finished=data["finished"],
        )
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise TraceFormatError(f"malformed memtrim trace: {type(exc).__name__}: {exc}") from exc


def write_text_atomically(path: str, text: str) -> None:
    """Write via a temporary file in the same folder and rename, so a crash never leaves half a file."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".memtrim-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save(trace: Trace, path: str) -> None:
    write_text_atomically(path, json.dumps(trace.to_dict(), indent=1) + "\n")


def load(path: str) -> Trace:
    """Read a trace written by :meth:`Trace.save`."""
    with open(path, "rb") as handle:
        raw = handle.read()
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TraceFormatError(f"{path} is not JSON ({exc}); memtrim traces are JSON files") from exc
    return trace_from_dict(data)
