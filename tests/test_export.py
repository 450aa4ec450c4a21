"""memory_viz and Perfetto exports, and the PNG: read by the viewers' own rules and checked in bytes."""

from __future__ import annotations

import io
import json
import pickle
import pickletools
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.cuda import _memory_viz

import memtrim
from memtrim.analysis import analyze
from memtrim.report import memory_viz, perfetto
from memtrim.report.plot import MissingExtra, png_bytes
from memtrim.trace.model import Allocation, OpLog, OpRow, Phase, Site, TraceLog

# The opcodes the viewer's own unpickler (MemoryViz.js, `unpickle`) handles; anything else throws there.
VIEWER_OPCODES = {
    "PROTO",
    "FRAME",
    "STOP",
    "MARK",
    "MEMOIZE",
    "BINPUT",
    "LONG_BINPUT",
    "BINGET",
    "LONG_BINGET",
    "EMPTY_DICT",
    "DICT",
    "SETITEM",
    "SETITEMS",
    "EMPTY_LIST",
    "LIST",
    "APPEND",
    "APPENDS",
    "EMPTY_TUPLE",
    "TUPLE",
    "TUPLE1",
    "TUPLE2",
    "TUPLE3",
    "NONE",
    "NEWTRUE",
    "NEWFALSE",
    "BININT",
    "BININT1",
    "BININT2",
    "LONG1",
    "BINFLOAT",
    "SHORT_BINUNICODE",
    "BINUNICODE",
}
ACTIONS = {"alloc", "free_requested", "free_completed", "snapshot"}


def validate_snapshot(raw: bytes) -> dict[str, Any]:
    """Every rule pytorch.org/memory_viz needs of a snapshot (see memtrim.report.memory_viz)."""
    assert raw[:2] == b"\x80\x04", "pickle protocol 4 (the viewer rejects 5)"
    used = {op.name for op, _, _ in pickletools.genops(raw)}
    assert used <= VIEWER_OPCODES, f"opcodes the viewer cannot read: {used - VIEWER_OPCODES}"
    snap = pickle.loads(raw)
    assert set(snap) >= {"segments", "device_traces"}
    categories = set()
    for device, trace in enumerate(snap["device_traces"]):
        times = [e["time_us"] for e in trace]
        assert times == sorted(times), "time_us must be monotone"
        addrs_alive: dict[int, int] = {}
        seen_addrs: set[int] = set()
        for i, e in enumerate(trace):
            assert e["action"] in ACTIONS
            assert isinstance(e["addr"], int) and isinstance(e["size"], int) and e["stream"] == 0
            assert isinstance(e["time_us"], int)
            for f in e["frames"]:
                assert (
                    isinstance(f["filename"], str)
                    and isinstance(f["line"], int)
                    and isinstance(f["name"], str)
                )
            if "category" in e:
                categories.add(e["category"])
            if e["action"] == "snapshot":
                continue
            assert set(e["user_metadata"]) - {"region"} == {
                "op",
                "phase",
                "role",
                "node",
                "module",
                "shape",
                "dtype",
            }
            assert all(isinstance(v, str) for v in e["user_metadata"].values())
            if e["action"] == "alloc":
                assert e["addr"] not in seen_addrs, "addresses are unique"
                seen_addrs.add(e["addr"])
                addrs_alive[e["addr"]] = e["size"]
            elif e["action"] == "free_requested":
                assert trace[i + 1]["action"] == "free_completed" and trace[i + 1]["addr"] == e["addr"]
                seen_addrs.add(e["addr"])
        segments = [s for s in snap["segments"] if s["device"] == device]
        if not trace:
            continue
        assert len(segments) == 1, "one synthetic segment per device"
        seg = segments[0]
        start, end = seg["address"], seg["address"] + seg["total_size"]
        assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"], "blocks tile the segment"
        for e in trace:
            if e["action"] != "snapshot":
                assert start <= e["addr"] and e["addr"] + e["size"] <= end, (
                    "every block ever live is in the segment"
                )
    if categories:
        assert "unknown" in categories, "the viewer's loader needs an 'unknown' category"
    return snap


def running_max(trace: list[dict[str, Any]]) -> int:
    live = best = 0
    for e in trace:
        if e["action"] == "alloc":
            live += e["size"]
        elif e["action"] == "free_completed":
            live -= e["size"]
        best = max(best, live)
    return best


def _program(fake: bool = False) -> memtrim.Trace:
    x = torch.randn(256, 512, requires_grad=True)  # from before the region
    w = torch.randn(512, 512, requires_grad=True)
    with memtrim.track(fake=fake) as trace:
        y = (x @ w).exp()
        y.sum().backward()
    return trace


def _with_preexisting_free() -> memtrim.Trace:
    pre = torch.randn(64, 64)
    holder = [pre]
    del pre
    with memtrim.track() as trace:
        a = holder[0] * 2  # the region sees `pre` as an input
        holder.clear()  # ...and its free
        b = a.sum()
    del a, b
    return trace


def test_memory_viz_snapshot_follows_every_viewer_rule_and_its_running_max_is_the_peak(
    tmp_path: Path,
) -> None:
    trace = _program()
    path = tmp_path / "snap.pickle"
    memory_viz.save(trace.analysis, str(path))
    snap = validate_snapshot(path.read_bytes())
    cpu = memory_viz.device_indices(["cpu"])["cpu"]
    assert running_max(snap["device_traces"][cpu]) == trace.peak_bytes
    # PyTorch's own readers take it
    assert "entries" in _memory_viz.trace(snap)
    assert "total_reserved" in _memory_viz.segsum(snap)
    assert _memory_viz.memory(snap, format_flamegraph=lambda lines: lines)
    assert _memory_viz.segments(snap, format_flamegraph=lambda lines: lines)
    assert "snapshot.pickle" in _memory_viz.trace_plot(snap)
    filtered = _memory_viz.filter_alloc_free_pairs(pickle.loads(path.read_bytes()))
    assert all(e["action"] != "free_requested" for e in filtered["device_traces"][cpu])
    # backward rows carry the forward line first
    backward = [
        e for e in snap["device_traces"][cpu] if e.get("user_metadata", {}).get("phase") == "backward"
    ]
    exp_line = next(a for a in trace.allocations if a.op == "aten.exp.default").site
    assert exp_line is not None
    assert any(e["frames"][0]["line"] == exp_line.line and e["user_metadata"]["node"] for e in backward)


def test_memory_viz_of_a_fake_trace_and_a_pre_region_free(tmp_path: Path) -> None:
    fake = _program(fake=True)
    snap = validate_snapshot(memory_viz.dumps(fake.analysis))
    cpu = memory_viz.device_indices(["cpu"])["cpu"]
    assert running_max(snap["device_traces"][cpu]) == fake.peak_bytes > 0
    freed_before = _with_preexisting_free()
    pre = [a for a in freed_before.allocations if a.preexisting and a.free_tick is not None]
    assert [a.bytes for a in pre] == [64 * 64 * 4]
    snap = validate_snapshot(memory_viz.dumps(freed_before.analysis))
    events = snap["device_traces"][cpu]
    frees = [e for e in events if e["action"] == "free_completed" and e["size"] == 64 * 64 * 4]
    allocs = {e["addr"] for e in events if e["action"] == "alloc"}
    assert any(e["addr"] not in allocs for e in frees), (
        "a pre-region tensor freed inside is a free with no alloc"
    )
    assert running_max(events) == freed_before.peak_bytes


def test_memory_viz_device_indices_follow_cuda() -> None:
    assert memory_viz.device_indices(["cpu", "cuda:1", "cuda:0"]) == {"cuda:0": 0, "cuda:1": 1, "cpu": 2}
    site = Site("prog.py", 1, "f")
    log = TraceLog.of(
        [Allocation(0, 1000, "float32", (250,), "cuda:1", "aten.empty", Phase.FORWARD, 1, None, None, site)],
        OpLog([OpRow(0, "aten.empty", Phase.FORWARD, site, None, None)]),
        end_tick=2,
    )
    snap = validate_snapshot(memory_viz.dumps(analyze(log)))
    assert snap["device_traces"][0] == [] and snap["device_traces"][1][0]["size"] == 1024  # 512-byte blocks
    assert snap["segments"][0]["device"] == 1


def test_perfetto_counter_maximum_is_the_peak_and_roles_sum_to_the_curve(tmp_path: Path) -> None:
    trace = _with_preexisting_free()
    path = tmp_path / "t.perfetto.json"
    perfetto.save(trace.analysis, str(path))
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    live = [e["args"]["bytes"] for e in events if e["ph"] == "C" and e["name"] == "live above start cpu"]
    assert max(live) == trace.peak_bytes
    roles = [e["args"] for e in events if e["ph"] == "C" and e["name"] == "memory cpu"]
    assert [sum(a.values()) for a in roles] == live  # the freed pre-region bytes count negative
    slices = [e for e in events if e["ph"] == "X" and e["cat"] == "forward"]
    assert len(slices) == sum(1 for op in trace.ops if op.phase is Phase.FORWARD) > 0
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"ops: forward", "ops: backward"} <= names
    big = _program()
    data = perfetto.chrome_trace(big.analysis)
    live = [
        e["args"]["bytes"]
        for e in data["traceEvents"]
        if e["ph"] == "C" and e["name"] == "live above start cpu"
    ]
    assert max(live) == big.peak_bytes


def test_png_is_drawn_and_a_missing_matplotlib_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    trace = _program()
    data = png_bytes(trace.analysis)
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    from PIL import Image  # matplotlib's own dependency

    assert Image.open(io.BytesIO(data)).size == (1100, 420)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingExtra, match=r"memtrim\[plots\]"):
        png_bytes(trace.analysis)
