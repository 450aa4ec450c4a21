"""The memtrim command, run as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")


def memtrim(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-m", "memtrim", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


SCRIPT = textwrap.dedent(
    """
    import torch
    z = torch.randn(64, 12, 64)
    W_O = torch.randn(12, 64, 768)
    heads = (z[..., None] * W_O).sum(-2)
    """
)


def test_run_reports_the_line_and_writes_a_trace(tmp_path: Path) -> None:
    (tmp_path / "prog.py").write_text(SCRIPT)
    done = memtrim("run", "-o", "t.json", "prog.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "prog.py:5 in <module>" in done.stdout
    assert "144 MiB" in done.stdout  # 64*12*64*768*4 bytes
    shown = memtrim("show", "t.json", "--json", cwd=tmp_path)
    assert json.loads(shown.stdout)["largest_temporaries"][0]["bytes"] == 64 * 12 * 64 * 768 * 4


def test_run_of_a_failing_script_still_writes_the_trace(tmp_path: Path) -> None:
    (tmp_path / "boom.py").write_text(SCRIPT + "\nraise MemoryError('pretend OOM')\n")
    done = memtrim("run", "-o", "t.json", "boom.py", cwd=tmp_path)
    assert done.returncode == 1
    assert "pretend OOM" in done.stderr and "stopped with MemoryError" in done.stdout
    assert json.loads((tmp_path / "t.json").read_text())["error"] == "MemoryError: pretend OOM"


def test_bad_paths_get_clear_errors(tmp_path: Path) -> None:
    missing = memtrim("run", "nope.py", cwd=tmp_path)
    assert missing.returncode == 2 and "no such script" in missing.stderr
    (tmp_path / "x.json").write_text("{}")
    bad = memtrim("show", "x.json", cwd=tmp_path)
    assert bad.returncode == 2 and "schema" in bad.stderr
