"""memtrim.region: named spans in a trace, and `memtrim run --region` recording only inside them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import memtrim
from memtrim.report import memory_viz, perfetto
from memtrim.report.series import timeline

SRC = str(Path(__file__).resolve().parents[1] / "src")


def test_regions_are_spans_on_the_trace_clock_and_in_the_views() -> None:
    with memtrim.track() as trace:
        a = torch.ones(1024)
        with memtrim.region("step"):
            b = torch.ones(4096)
            with memtrim.region("inner"):
                c = torch.ones(256)
        d = torch.ones(64)
    regions = trace.log.regions
    assert [r.name for r in regions] == ["step", "inner"]
    ticks = {x.bytes: x.alloc_tick for x in trace.allocations}
    step, inner = regions
    assert step.end_tick is not None and inner.end_tick is not None
    assert (
        step.start_tick < ticks[4096 * 4] < inner.start_tick < ticks[256 * 4] < inner.end_tick < step.end_tick
    )
    assert ticks[1024 * 4] < step.start_tick and ticks[64 * 4] > step.end_tick
    tl = timeline(trace.analysis)
    assert [(r.name) for r in tl.regions] == ["step", "inner"]
    assert dict(tl.region_peaks)["step"] == (1024 + 4096 + 256) * 4  # alive while it was open
    slices = [e for e in perfetto.chrome_trace(trace.analysis)["traceEvents"] if e.get("cat") == "region"]
    assert [e["name"] for e in slices] == ["step", "inner"]
    cpu = memory_viz.device_indices(["cpu"])["cpu"]
    where = {
        e["size"]: e["user_metadata"].get("region")
        for e in memory_viz.snapshot(trace.analysis)["device_traces"][cpu]
        if e["action"] == "alloc"
    }
    assert where == {1024 * 4: None, 4096 * 4: "step", 256 * 4: "inner", 64 * 4: None}
    del a, b, c, d


def test_regions_survive_save_and_load(tmp_path: Path) -> None:
    with memtrim.track() as trace, memtrim.region("fwd"):
        x = torch.ones(16)
    trace.save(str(tmp_path / "t.json"))
    assert [r.name for r in memtrim.load(str(tmp_path / "t.json")).log.regions] == ["fwd"]
    del x


def test_a_region_outside_any_tracker_does_nothing_and_needs_a_name() -> None:
    with memtrim.region("untracked"):
        y = torch.ones(8) * 2
    assert y.sum().item() == 16
    with pytest.raises(ValueError, match="non-empty name"), memtrim.region(""):
        pass


PROGRAM = textwrap.dedent(
    """
    import torch, memtrim
    model = torch.randn(1024, 1024)          # 4 MiB built outside the region: not recorded
    for step in range({steps}):
        with memtrim.region("step"):
            x = torch.randn(256, 1024)       # 1 MiB
            y = x @ model                    # 1 MiB
            scratch = torch.ones({scratch} * (step + 1))
            del scratch
    after = torch.ones(4 * 1024 * 1024)      # 16 MiB after the region: not recorded
    """
)


def _run(tmp_path: Path, *args: str, steps: int = 1, scratch: int = 1024) -> subprocess.CompletedProcess[str]:
    (tmp_path / "train.py").write_text(PROGRAM.format(steps=steps, scratch=scratch))
    env = {**os.environ, "PYTHONPATH": SRC}
    return subprocess.run(
        [sys.executable, "-m", "memtrim", "run", *args, "train.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_run_region_records_only_inside_the_region(tmp_path: Path) -> None:
    done = _run(tmp_path, "-o", "t.json", "--region", "step")
    assert done.returncode == 0, done.stderr
    data = json.loads((tmp_path / "t.json").read_text())
    mib = 1024 * 1024
    # x and y alive, plus the scratch at its largest; nothing of the model or of `after`
    assert data["peak_bytes"] == 2 * mib + 1024 * 4
    assert [r[0] for r in data["regions"]] == ["step"]
    # what the region still held when it ended is output (the script keeps x and y)
    assert data["breakdown_at_peak"]["output"] == 2 * mib
    saved = memtrim.load(str(tmp_path / "t.json")).allocations
    assert all(a.bytes != 4 * mib or a.preexisting for a in saved)


def test_run_region_entered_several_times_reports_the_highest(tmp_path: Path) -> None:
    done = _run(tmp_path, "-o", "t.json", "--region", "step", steps=3, scratch=262144)
    assert done.returncode == 0, done.stderr
    assert "Region 'step' was entered 3 times; this report is entry 3" in done.stdout
    saved = memtrim.load(str(tmp_path / "t.json")).allocations
    largest = max(a.bytes for a in saved if not a.preexisting)
    assert largest == 3 * 262144 * 4


TRAINING_LOOP = textwrap.dedent(
    """
    import json, sys, torch, memtrim
    sys.path.insert(0, {tests!r})
    from groundtruth import profiler_memory

    MARK = 4099 * 8  # a block of a size nothing else has, allocated between the steps
    with profiler_memory() as measured:  # from before the model exists: every byte's life is seen
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Tanh(), torch.nn.Linear(512, 512))
        opt = torch.optim.AdamW(model.parameters(), foreach=False)
        for step in range(3):
            torch.empty(MARK, dtype=torch.uint8)  # made and dropped at once
            with memtrim.region("step"):
                x = torch.randn(512, 512)
                loss = model(x).tanh().square().sum()
                loss.backward()
                opt.step()
                opt.zero_grad()
                del x, loss
        torch.empty(MARK, dtype=torch.uint8)
    json.dump(measured.deltas, open("profiled.json", "w"))
    """
)


def test_run_region_reports_the_entry_that_sets_the_high_water_mark(tmp_path: Path) -> None:
    # AdamW's first step makes its state (the highest peak above its own start); the later steps start
    # with that state alive and their backward reaches a higher absolute peak: the one to report
    (tmp_path / "loop.py").write_text(TRAINING_LOOP.format(tests=str(Path(__file__).parent)))
    env = {**os.environ, "PYTHONPATH": SRC}
    done = subprocess.run(
        [sys.executable, "-m", "memtrim", "run", "-o", "t.json", "--region", "step", "loop.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    # the profiler's live bytes, from nothing, split into the steps by the marker blocks
    deltas = json.loads((tmp_path / "profiled.json").read_text())
    mark = 4099 * 8
    windows: list[int] = []
    live = 0
    for delta in deltas:
        if delta == mark:
            windows.append(live)
        elif delta != -mark:
            live += delta
            if windows:
                windows[-1] = max(windows[-1], live)
    steps = windows[:3]
    highest = steps.index(max(steps)) + 1
    above_start = [
        max_in - start for max_in, start in zip(steps, _starts(deltas, mark), strict=False)
    ]  # what the old report ranked by
    assert highest == 2 and above_start.index(max(above_start)) == 0, (steps, above_start)
    data = json.loads((tmp_path / "t.json").read_text())
    noted = data["metadata"]["region_entries"]
    assert noted["chosen"] == highest and noted["picked"] == "highest"
    # each entry's absolute peak is the profiler's high-water mark of that step, to the byte
    assert [e["absolute"] for e in noted["entries"]] == steps
    assert [e["peak"] for e in noted["entries"]] == above_start
    assert "this report is entry 2" in done.stdout
    assert "entry 1 created the optimizer's state" in done.stdout


def _starts(deltas: list[int], mark: int) -> list[int]:
    """The profiler's live bytes where each marker block was allocated (each step's start)."""
    starts, live = [], 0
    for delta in deltas:
        if delta == mark:
            starts.append(live)
        elif delta != -mark:
            live += delta
    return starts


def test_run_region_entry_picks_another_entry(tmp_path: Path) -> None:
    done = _run(tmp_path, "-o", "t.json", "--region", "step", "--entry", "1", steps=3, scratch=262144)
    assert done.returncode == 0, done.stderr
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["metadata"]["region_entries"]["chosen"] == 1
    saved = memtrim.load(str(tmp_path / "t.json")).allocations
    assert max(a.bytes for a in saved if not a.preexisting) == 262144 * 4
    assert "this report is entry 1 (as asked)" in done.stdout
    late = _run(tmp_path, "-o", "t.json", "--region", "step", "--entry", "7", steps=3, scratch=262144)
    assert late.returncode == 0 and "--entry 7: the region 'step' was entered 3 time(s)" in late.stderr
    unused = _run(tmp_path, "--entry", "2")
    assert unused.returncode == 2 and "--entry N picks an entry of --region NAME" in unused.stderr


def test_run_region_never_entered_says_so(tmp_path: Path) -> None:
    done = _run(tmp_path, "--region", "nope")
    assert done.returncode == 1
    assert "never entered memtrim.region('nope')" in done.stderr


def test_run_region_with_fake_tensors(tmp_path: Path) -> None:
    done = _run(tmp_path, "-o", "t.json", "--fake", "--region", "step")
    assert done.returncode == 0, done.stderr
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["fake"] is True and data["peak_bytes"] == 2 * 1024 * 1024 + 1024 * 4


def test_the_terminal_report_lists_each_region_entry_with_its_peak() -> None:
    with memtrim.track() as trace:
        for size in (1024, 8192, 2048):
            with memtrim.region("step"):
                x = torch.ones(size)  # the only tensor while the entry is open
                del x
        with memtrim.region("eval"):
            y = torch.ones(512)
    assert trace.analysis.region_peaks == (("step", 4096), ("step", 32768), ("step", 8192), ("eval", 2048))
    text = trace.report(top=3)
    section = text[text.index("Regions (memtrim.region), each entry:") :].splitlines()
    assert section[1].split() == ["region", "entry", "peak", "while", "open"]
    assert [line.split() for line in section[2:5]] == [
        ["step", "1", "4", "KiB"],
        ["step", "2", "32", "KiB"],
        ["step", "3", "8", "KiB"],
    ]
    assert section[5].strip() == "... and 1 more entries (memtrim show --top N)"
    del y
