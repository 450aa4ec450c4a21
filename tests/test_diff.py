"""Comparing two traces: matched lines, what changed, and the seed's temporary gone at its line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import memtrim
from memtrim.analysis import analyze
from memtrim.analysis.diff import diff
from memtrim.cases.heads import head_results, head_results_broadcast
from memtrim.trace.model import Allocation, OpLog, OpRow, Phase, Site, TraceLog

SRC = str(Path(__file__).resolve().parents[1] / "src")


def test_a_trace_diffed_with_itself_is_empty() -> None:
    x = torch.randn(64, 64, requires_grad=True)
    with memtrim.track() as trace:
        (x.exp() * 2).sum().backward()
    result = memtrim.diff(trace, trace)
    assert result.empty and result.lines == ()
    assert "no differences" in result.report() and "no memory differences" in result.markdown()


def test_head_results_broadcast_vs_einsum_shows_the_temporary_gone_at_its_line() -> None:
    # the seed's full size, forward only under no_grad, with fake tensors: nothing is allocated
    z, W_O = torch.randn(512, 12, 64), torch.randn(12, 64, 768)
    product = 512 * 12 * 64 * 768 * 4
    assert product == 1_207_959_552
    with torch.no_grad(), memtrim.track(fake=True) as before:
        head_results_broadcast(z, W_O)
    with torch.no_grad(), memtrim.track(fake=True) as after:
        head_results(z, W_O)
    result = memtrim.diff(before, after)
    gone = [c for c in result.lines if c.largest_temporary == (product, 0)]
    assert len(gone) == 1 and gone[0].matched == "before only"
    assert gone[0].before is not None and gone[0].before.site is not None
    assert gone[0].before.site.function == "head_results_broadcast"
    assert gone[0].before.code == "return (z[..., None] * W_O).sum(-2)"
    assert result.lines[0] is gone[0]  # the largest change comes first
    assert result.peak[0] >= product > 50 * result.peak[1]
    text = result.report()
    assert "heads.py:" in text and "1.12 GiB mul.Tensor 512x12x64x768 -> none" in text
    assert all(len(line) <= 100 for line in text.splitlines())
    md = result.markdown()
    assert "| line | code |" in md and "1.12 GiB mul.Tensor 512x12x64x768 → none" in md


def _log(line: int, text: str, nbytes: int, function: str = "f", file: str = "prog.py") -> TraceLog:
    site = Site(file, line, function)
    ops = OpLog([OpRow(0, "aten.mul.Tensor", Phase.FORWARD, site, None, None)])
    allocations = [
        Allocation(
            0,
            nbytes,
            "float32",
            (nbytes // 4,),
            "cpu",
            "aten.mul.Tensor",
            Phase.FORWARD,
            1,
            2,
            Phase.FORWARD,
            site,
        )
    ]
    return TraceLog.of(allocations, ops, end_tick=3, metadata={"source_lines": {file: {str(line): text}}})


def test_a_line_that_moved_is_matched_by_function_and_text() -> None:
    moved = diff(analyze(_log(10, "y = x * w", 4096)), analyze(_log(14, "y = x * w", 1024)))
    assert [(c.matched, c.largest_temporary) for c in moved.lines] == [("moved", (4096, 1024))]
    edited = diff(analyze(_log(10, "y = x * w", 4096)), analyze(_log(10, "y = x.mul(w)", 1024)))
    assert [c.matched for c in edited.lines] == ["edited"]
    renamed = diff(analyze(_log(10, "y = x * w", 4096)), analyze(_log(3, "y = x * w", 1024, file="new.py")))
    assert [c.matched for c in renamed.lines] == ["renamed"]
    # a different function with the same text is another line
    other = diff(analyze(_log(10, "y = x * w", 4096)), analyze(_log(14, "y = x * w", 1024, function="g")))
    assert sorted(c.matched for c in other.lines) == ["after only", "before only"]


def test_diff_command_prints_text_markdown_json_and_html(tmp_path: Path) -> None:
    for name, text in (("a", "y = (x[..., None] * w).sum(-2)"), ("b", "y = torch.einsum('ij,jk->ik', x, w)")):
        (tmp_path / f"{name}.py").write_text(
            f"import torch\nx = torch.randn(64, 32)\nw = torch.randn(32, 48)\n{text}\n"
        )
    env = {**os.environ, "PYTHONPATH": SRC}

    def memtrim_cmd(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "memtrim", *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    assert memtrim_cmd("run", "-o", "a.json", "a.py").returncode == 0
    assert memtrim_cmd("run", "-o", "b.json", "b.py").returncode == 0
    shown = memtrim_cmd("diff", "a.json", "b.json")
    assert shown.returncode == 0, shown.stderr
    assert "a.py:4 in <module>" in shown.stdout and "memtrim diff: peak" in shown.stdout
    assert "**memtrim**" in memtrim_cmd("diff", "a.json", "b.json", "--markdown").stdout
    data = json.loads(memtrim_cmd("diff", "a.json", "b.json", "--json").stdout)
    assert data["peak"]["before"] > data["peak"]["after"]
    assert memtrim_cmd("diff", "a.json", "b.json", "--html", "d.html").returncode == 0
    assert "<svg" in (tmp_path / "d.html").read_text()
    same = memtrim_cmd("diff", "a.json", "a.json")
    assert same.returncode == 0 and "no differences" in same.stdout
