"""Notebooks: Trace._repr_html_ and the %%memtrim cell magic, run in a real IPython shell."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import memtrim

IPython = pytest.importorskip(
    "IPython", reason="IPython is in the dev extra; pip install ipython to run these"
)


def test_trace_repr_html_is_the_compact_report_with_the_timeline() -> None:
    x = torch.randn(64, 12, 64)
    w = torch.randn(12, 64, 768)
    with memtrim.track() as trace:
        (x[..., None] * w).sum(-2)
    html = trace._repr_html_()
    assert "<svg" in html and "<script" not in html  # shows where scripts do not run
    assert "above the region's start" in html and "einsum" in html
    assert "test_jupyter.py" in html


@pytest.fixture
def shell() -> object:
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "memtrim")
    yield ip
    InteractiveShell.clear_instance()


def test_cell_magic_tracks_the_cell_in_the_notebook_namespace(shell: object, tmp_path: Path) -> None:
    report = tmp_path / "cell.html"
    result = shell.run_cell(  # type: ignore[attr-defined]
        f"%%memtrim --name t --html {report}\n"
        "import torch\nkept = torch.ones(1000)\ntmp = kept * 2\ndel tmp\n"
    )
    assert result.error_in_exec is None and result.error_before_exec is None
    trace = shell.user_ns["t"]  # type: ignore[attr-defined]
    assert isinstance(trace, memtrim.Trace)
    assert trace.peak_bytes == 2 * 1000 * 4
    assert shell.user_ns["kept"].shape == (1000,)  # type: ignore[attr-defined]  (the cell ran in the namespace)
    roles = {trace.role(a): a.bytes for a in trace.allocations}
    assert roles == {"output": 4000, "temporary": 4000}  # what the cell keeps is output
    assert trace.live_at_peak()[0].site.line == 2  # type: ignore[union-attr]  (the cell's own lines)
    assert report.read_text().startswith("<!DOCTYPE html>")
    shown = shell.run_cell_magic("memtrim", "--name t2", "import torch\ny = torch.ones(10)\n")  # type: ignore[attr-defined]
    assert "<svg" in shown._repr_html_() and "memtrim: peak 40 B" in repr(shown)


def test_cell_magic_keeps_the_trace_of_a_failing_cell(shell: object) -> None:
    result = shell.run_cell("%%memtrim\nimport torch\nx = torch.ones(256)\nraise RuntimeError('boom')\n")  # type: ignore[attr-defined]
    assert result.error_in_exec is None  # the inner cell's error was shown; the magic itself ran
    trace = shell.user_ns["memtrim_trace"]  # type: ignore[attr-defined]
    assert trace.error == "RuntimeError: boom" and trace.peak_bytes == 1024


def test_cell_magic_rejects_unknown_options(shell: object) -> None:
    result = shell.run_cell("%%memtrim --bogus\nx = 1\n")  # type: ignore[attr-defined]
    assert isinstance(result.error_in_exec, ValueError) and "%%memtrim options" in str(result.error_in_exec)
