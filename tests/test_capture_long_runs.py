"""Long runs: a trace saved in bounded memory that memtrim.load reads, and recording only chosen
training steps, with the rest of the run untracked."""

from __future__ import annotations

import io
import json
import tracemalloc
from pathlib import Path

import pytest
import torch
from groundtruth import ProfiledMemory, profiled_memory
from torch.profiler import ProfilerActivity, profile

import memtrim
from memtrim.capture.steps import STEPS_KEY
from memtrim.report import json as report_json
from memtrim.trace import serialize, stream
from memtrim.trace.model import Allocation, OpLog, OpRow, Phase, Site, TraceLog


def long_log(ops: int) -> TraceLog:
    """A hand-built finished trace of ``ops`` ops, each making one allocation freed by the next."""
    sites = [Site(f"train_{i}.py", i, "step") for i in range(50)]
    rows = OpLog(
        [OpRow(2 * i, "aten.mul.Tensor", Phase.FORWARD, sites[i % 50], None, "Net.fc") for i in range(ops)]
    )
    allocations = [
        Allocation(
            i,
            4096,
            "float32",
            (32, 32),
            "cpu",
            "aten.mul.Tensor",
            Phase.FORWARD,
            2 * i + 1,
            2 * i + 3,
            Phase.FORWARD,
            sites[i % 50],
        )
        for i in range(ops)
    ]
    return TraceLog.of(allocations, rows, end_tick=2 * ops + 4, metadata={"pid": 1})


def test_a_streamed_trace_is_the_same_json_and_loads() -> None:
    x = torch.randn(64, 64, requires_grad=True)
    with memtrim.track() as trace:
        (x.exp() * 2).sum().backward()
    summary = report_json.summary(trace.analysis)
    handle = io.StringIO()
    stream.write(trace.log, handle, summary)
    assert json.loads(handle.getvalue()) == json.loads(serialize.dumps(trace.log, summary))
    loaded = serialize.loads(handle.getvalue())
    assert loaded.allocations == trace.allocations and loaded.ops.rows == trace.ops.rows


def test_saving_holds_one_chunk_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Python memory while saving, traced: the same for a trace four times longer (bounded), and a
    # small part of the file (serialize.save held about 4 KiB per op: 406 MiB for 100k ops).
    monkeypatch.setattr(stream, "CHUNK", 256)
    peaks, sizes = [], []
    for ops in (1000, 4000):
        log = long_log(ops)
        path = tmp_path / f"{ops}.json"
        tracemalloc.start()
        try:
            stream.save(log, str(path))
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
        sizes.append(path.stat().st_size)
        again = memtrim.load(str(path))
        assert len(again.ops) == ops and again.allocations == log.allocations
    assert peaks[1] < peaks[0] * 1.25
    assert peaks[1] * 4 < sizes[1]


def _training(steps: int, window: range | None) -> tuple[memtrim.Trace | None, ProfiledMemory, list[int]]:
    """``steps`` training steps; with ``window``, tracked with track(steps=window) and profiled over
    the same steps (the profiler entered and left where each step's optimizer.step() returns)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.Adam(model.parameters())
    data = [torch.randn(16, 32) for _ in range(steps)]
    depth: list[int] = []
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    first, stop = (window.start, window.stop) if window is not None else (-1, -1)

    def run() -> None:
        for i, x in enumerate(data):
            if i == first:
                prof.__enter__()
            depth.append(torch._C._len_torch_dispatch_stack())
            model(x).square().mean().backward()
            opt.step()
            if i + 1 == stop:
                prof.__exit__(None, None, None)
            opt.zero_grad()

    if window is None:
        run()
        return None, ProfiledMemory(), depth
    with memtrim.track(steps=window) as trace:
        run()
    return trace, profiled_memory(prof), depth


def test_steps_records_only_the_chosen_steps() -> None:
    trace, truth, depth = _training(6, range(2, 4))
    assert trace is not None
    assert depth == [0, 0, 1, 1, 0, 0]  # untracked outside the window: no mode at all
    assert trace.log.metadata[STEPS_KEY] == [2, 4, 2]
    assert trace.finished
    # what the window made and freed, event for event, against the profiler over the same steps
    events = []
    for a in trace.allocations:
        if not a.preexisting:
            events.append((a.alloc_tick, a.bytes))
            if a.free_tick is not None:
                events.append((a.free_tick, -a.bytes))
    assert [d for _, d in sorted(events)] == truth.deltas
    assert {op.phase for op in trace.ops} == {"forward", "backward", "optimizer"}


def test_steps_that_never_come_leave_an_empty_finished_trace() -> None:
    x = torch.randn(4)
    with memtrim.track(steps=range(5, 6)) as trace:
        y = x * 2
    assert trace.finished and len(trace.ops) == 0 and trace.peak_bytes == 0
    assert trace.log.metadata[STEPS_KEY] == [5, 6, 0]
    del y


def test_bad_steps_name_the_fix() -> None:
    with pytest.raises(ValueError, match="non-empty range"), memtrim.track(steps=range(3, 3)):
        pass
