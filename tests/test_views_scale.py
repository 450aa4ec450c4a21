"""Views of long traces: the downsampler keeps every bucket's lowest and highest value and the peak, and
the HTML timeline, the Perfetto trace and the memory_viz count of a long synthetic trace hold the trace's
own bytes (summed here from its allocations, not read from memtrim's curve)."""

from __future__ import annotations

import bisect
import itertools
import json
import random
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memtrim.analysis import analyze
from memtrim.report import downsample, memory_viz, perfetto, series
from memtrim.report.svg import plot_columns
from memtrim.trace.model import Allocation, OpLog, OpRow, Phase, Site, TraceLog

# -- the downsampler ------------------------------------------------------------------------------


def _buckets(n: int, starts: Sequence[int]) -> list[tuple[int, int]]:
    bounds = sorted({min(max(s, 0), n) for s in starts} | {0, n})
    return list(itertools.pairwise(bounds))


def _check_extremes(values: Sequence[int], starts: Sequence[int]) -> None:
    keep = downsample.extremes(values, starts)
    assert keep == sorted(set(keep)), "in order, without repeats"
    if not values:
        assert keep == []
        return
    assert keep[-1] == len(values) - 1, "the curve's end is kept"
    buckets = _buckets(len(values), starts)
    assert len(keep) <= 2 * len(buckets) + 1
    for lo, hi in buckets:
        inside = [values[k] for k in keep if lo <= k < hi]
        assert min(inside) == min(values[lo:hi]) and max(inside) == max(values[lo:hi]), (lo, hi)
    first_peak = values.index(max(values))
    assert first_peak in keep, "the peak's own sample, the first at that height"
    first_low = values.index(min(values))
    assert first_low in keep


def test_extremes_keep_each_buckets_exact_min_and_max_and_the_first_peak() -> None:
    rng = random.Random(0)
    for n in (0, 1, 2, 3, 10, 1000):
        # plateaus: the peak value repeats, and only its first sample is the peak's position
        values = [rng.choice((0, 5, 5, 9, 9, -3)) * 1000 + rng.randrange(3) for _ in range(n)]
        for count in (1, 2, 7, 50):
            starts = sorted(rng.sample(range(n + 1), min(count, n + 1)))
            _check_extremes(values, starts)
    # a spike one sample wide between two long flat stretches, in a bucket of its own or not
    spike = [7] * 500 + [10**12] + [7] * 499
    for starts in ([0, 250, 750], [0, 500, 501], [0]):
        keep = downsample.extremes(spike, starts)
        assert 500 in keep and spike[keep[-1]] == 7


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_extremes_property(data: st.DataObject) -> None:
    values = data.draw(st.lists(st.integers(-(2**62), 2**62), max_size=200))
    starts = data.draw(st.lists(st.integers(-3, len(values) + 3), max_size=40))
    _check_extremes(values, starts)


def test_sums_at_reads_each_slots_running_sum_after_the_kept_events() -> None:
    rng = random.Random(1)
    deltas = [rng.randrange(-100, 100) for _ in range(300)]
    slots = [rng.randrange(4) for _ in range(300)]
    keep = sorted(rng.sample(range(300), 40))
    sums = downsample.sums_at(deltas, slots, 4, keep)
    for slot in range(4):
        running = list(
            itertools.accumulate(d if s == slot else 0 for d, s in zip(deltas, slots, strict=True))
        )
        assert sums[slot] == [running[k] for k in keep]


# -- a long synthetic trace ---------------------------------------------------------------------------

SITE = Site("train.py", 7, "step")


def _long_trace(ops: int, seed: int = 0) -> TraceLog:
    """``ops`` ops, three ticks each: the op, one allocation of a random size, and most of the time the
    free of a random live tensor; forward then backward, in modules ``net.layers.K``."""
    rng = random.Random(seed)
    rows, allocations = [], []
    alive: list[int] = []
    for k in range(ops):
        tick = 3 * k
        phase = Phase.FORWARD if k < ops // 2 else Phase.BACKWARD
        module = f"net.layers.{(k // 50) % 4}" if k % 200 < 180 else None
        rows.append(OpRow(tick, "aten.mul.Tensor", phase, SITE, None, module))
        ident = len(allocations)
        size = rng.choice((64, 256, 4096, 65536)) * rng.randrange(1, 5)
        allocations.append(
            Allocation(
                ident, size, "float32", (size // 4,), "cpu", "aten.mul.Tensor", phase, tick + 1, site=SITE
            )
        )
        alive.append(ident)
        if len(alive) > 20 or (alive and rng.random() < 0.45):
            gone = alive.pop(rng.randrange(len(alive)))
            a = allocations[gone]
            allocations[gone] = Allocation(
                a.id,
                a.bytes,
                a.dtype,
                a.shape,
                a.device,
                a.op,
                a.phase,
                a.alloc_tick,
                tick + 2,
                phase,
                site=SITE,
            )
    return TraceLog.of(allocations, OpLog(rows), end_tick=3 * ops)


def _truth(log: TraceLog) -> tuple[list[int], list[int]]:
    """Ticks of the allocation events and the live bytes just after each, from the allocations."""
    events = sorted(
        [(a.alloc_tick, a.bytes) for a in log.allocations]
        + [(a.free_tick, -a.bytes) for a in log.allocations if a.free_tick is not None]
    )
    ticks = [t for t, _ in events]
    return ticks, list(itertools.accumulate(d for _, d in events))


def test_timeline_of_a_long_trace_keeps_every_buckets_extremes_and_the_peak_at_its_op() -> None:
    log = _long_trace(6000)
    ticks, live = _truth(log)
    op_ticks = [row.tick for row in log.ops.rows]
    peak = max(live)
    peak_op = bisect.bisect_right(op_ticks, ticks[live.index(peak)]) - 1
    buckets = 60
    tl = series.timeline(analyze(log), buckets=buckets)
    assert len(tl.x) <= 2 * buckets + 2 < len(live)
    assert tl.peak_bytes == peak == max(tl.total)
    assert tl.peak_x == peak_op
    assert any(x == peak_op and total == peak for x, total in zip(tl.x, tl.total, strict=True))
    truth_at = dict(zip(ticks, live, strict=True))
    assert all(truth_at[t] == v for t, v in zip(tl.ticks[1:], tl.total[1:], strict=True)), (
        "the curve's own values"
    )
    ops_of = [bisect.bisect_right(op_ticks, t) - 1 for t in ticks]
    for b in range(buckets):
        first, end = -(-b * len(op_ticks) // buckets), -(-(b + 1) * len(op_ticks) // buckets)
        inside = [v for o, v in zip(ops_of, live, strict=True) if first <= o < end]
        drawn = [v for x, v in zip(tl.x[1:], tl.total[1:], strict=True) if first <= x < end]
        assert (min(drawn), max(drawn)) == (min(inside), max(inside)), b
    for i in range(len(tl.x)):
        assert sum(layer.values[i] for layer in tl.by_role) == tl.total[i]
    # a picture's bucket is a pixel column; a short trace keeps every event
    assert plot_columns() == 866
    small = _long_trace(300)
    assert len(series.timeline(analyze(small), buckets=plot_columns()).x) == len(_truth(small)[1]) + 1


def _counter(events: list[dict], name: str) -> list[tuple[int, int]]:
    return [(e["ts"], e["args"]["bytes"]) for e in events if e["ph"] == "C" and e["name"] == name]


def test_perfetto_of_a_short_trace_has_a_slice_per_op_and_every_counter_sample() -> None:
    log = _long_trace(400)
    data, thinning = perfetto.thinned_trace(analyze(log))
    events = data["traceEvents"]
    assert not thinning.thinned and "thinning" not in data["otherData"]
    rows = log.ops.rows
    ops = [e for e in events if e["ph"] == "X" and e["cat"] in ("forward", "backward")]
    ends = [r.tick for r in rows[1:]] + [log.end_tick]
    assert [(e["args"]["seq"], e["ts"], e["dur"]) for e in ops] == [
        (i, r.tick, end - r.tick) for i, (r, end) in enumerate(zip(rows, ends, strict=True))
    ]
    assert _counter(events, "live above start cpu") == list(zip(*_truth(log), strict=True))
    # each op lies inside its phase's slice and its module's slices, on the same track
    spans = [e for e in events if e["ph"] == "X" and e["cat"] in ("phase", "module")]
    for e in ops:
        module = e["args"].get("module")
        holders = [s for s in spans if s["tid"] == e["tid"] and s["ts"] <= e["ts"] < s["ts"] + s["dur"]]
        assert [s["name"] for s in holders if s["cat"] == "phase"] == [rows[e["args"]["seq"]].phase.value]
        paths = {s["args"]["module"] for s in holders if s["cat"] == "module"}
        assert paths == ({".".join(module.split(".")[:d]) for d in (1, 2, 3)} if module else set())
    assert sum(s["args"]["ops"] for s in spans if s["cat"] == "phase") == len(rows)


def test_perfetto_of_a_long_trace_keeps_the_peak_and_the_ops_around_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(perfetto, "OP_SLICES", 1000)
    monkeypatch.setattr(perfetto, "PEAK_WINDOW_OPS", 30)
    monkeypatch.setattr(perfetto, "COUNTER_BUCKETS", 100)
    log = _long_trace(6000)
    ticks, live = _truth(log)
    op_ticks = [row.tick for row in log.ops.rows]
    peak_op = bisect.bisect_right(op_ticks, ticks[live.index(max(live))]) - 1
    path = tmp_path / "long.perfetto.json"
    thinning = perfetto.save(analyze(log), str(path))
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    seqs = [e["args"]["seq"] for e in events if e["ph"] == "X" and e["cat"] in ("forward", "backward")]
    assert seqs == list(range(peak_op - 30, peak_op + 31))
    assert thinning.window == (peak_op - 30, peak_op + 30) and thinning.thinned
    assert "around the peak" in data["otherData"]["thinning"]
    counter = _counter(events, "live above start cpu")
    truth_at = dict(zip(ticks, live, strict=True))
    assert all(truth_at[t] == v for t, v in counter), "every sample is the curve's own"
    assert max(v for _, v in counter) == max(live) and (ticks[live.index(max(live))], max(live)) in counter
    window = [
        (t, v)
        for t, v in zip(ticks, live, strict=True)
        if op_ticks[peak_op - 30] <= t < op_ticks[peak_op + 31]
    ]
    assert set(window) <= set(counter) and len(window) > 61, "every event of the ops around the peak"
    assert len(counter) == thinning.samples["cpu"] < len(live) == thinning.events["cpu"]
    assert len(counter) <= 2 * 100 + 1 + 3 * 61  # the buckets, and every event of the ops around the peak
    phases = [e for e in events if e["ph"] == "X" and e["cat"] == "phase"]
    assert sum(e["args"]["ops"] for e in phases) == 6000, "the phase slices still cover every op"


# -- memory_viz ------------------------------------------------------------------------------------


def _entry(action: str, addr: int) -> dict:
    return {"action": action, "addr": addr, "size": 512}


def test_memory_viz_counts_events_as_its_viewer_lists_them(monkeypatch: pytest.MonkeyPatch) -> None:
    log = _long_trace(500)
    snap = memory_viz.snapshot(analyze(log))
    counts = memory_viz.viewer_events(snap, {0: "cpu"})
    frees = sum(a.free_tick is not None for a in log.allocations)
    assert counts == [
        memory_viz.ViewerEvents("cpu", 0, len(log.allocations) + frees + 1, len(log.allocations))
    ]
    assert (
        memory_viz.viewer_note(counts)
        == f"memory_viz will list cpu (device 0): {len(log.allocations) + frees + 1:,} events"
    )
    # the viewer merges a free_requested into the free_completed right after it, of the same block only
    interleaved = {
        "device_traces": [
            [
                _entry(action, addr)
                for action, addr in (
                    ("alloc", 1),
                    ("alloc", 2),
                    ("free_requested", 1),
                    ("free_requested", 2),
                    ("free_completed", 1),
                    ("free_completed", 2),
                    ("free_requested", 3),
                    ("free_completed", 3),
                )
            ],
            [],
        ]
    }
    assert memory_viz.viewer_events(interleaved, {0: "cuda:0", 1: "cpu"}) == [
        memory_viz.ViewerEvents("cuda:0", 0, 7, 2)
    ]
    monkeypatch.setattr(memory_viz, "VIEWER_EVENT_LIMIT", 900)
    monkeypatch.setattr(memory_viz, "VIEWER_DRAWN_ALLOCATIONS", 100)
    note = memory_viz.viewer_note(counts)
    assert ", more than the about 900 past which its viewer is known to drop events (" in note
    assert (
        "memtrim.track(steps=N)" in note
        and f"the 100 largest of {len(log.allocations):,} allocations" in note
    )


def test_perfetto_leaves_out_the_deepest_module_levels_past_its_slice_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    log = _long_trace(400)
    full, _ = perfetto.thinned_trace(analyze(log))
    spans = [e for e in full["traceEvents"] if e["ph"] == "X" and e["cat"] in ("phase", "module")]
    depth = {e["args"].get("module", "").count(".") + 1 if e["cat"] == "module" else 0 for e in spans}
    assert depth == {0, 1, 2, 3}
    shallow = sum(1 for e in spans if e["cat"] == "phase" or "." not in e["args"]["module"])
    monkeypatch.setattr(perfetto, "STRUCTURE_SLICES", shallow)
    data, thinning = perfetto.thinned_trace(analyze(log))
    kept = [e for e in data["traceEvents"] if e["ph"] == "X" and e["cat"] in ("phase", "module")]
    assert thinning.module_depth == 1 and thinning.thinned and len(kept) == shallow
    assert {e["args"]["module"] for e in kept if e["cat"] == "module"} == {"net"}
    assert ", module slices to depth 1;" in data["otherData"]["thinning"]
    ops = [e for e in data["traceEvents"] if e["ph"] == "X" and e["cat"] in ("forward", "backward")]
    assert len(ops) == len(log.ops), "every op keeps its slice"
