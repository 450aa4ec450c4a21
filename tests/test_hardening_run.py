"""memtrim run of programs that fork, change folder or are interrupted (issue 23, items 1, 2 and 9):
only the process that started the region writes, paths mean what they meant when the command started,
and an interrupt ends memtrim as it ends python."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _memtrim(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-m", "memtrim", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


FORKS = """
import os, sys, torch
big = torch.ones(1024, 1024)          # 4 MiB in the parent, before the fork
pid = os.fork()
if pid == 0:
    small = torch.ones(16)            # the child runs a little torch and leaves the program
    {child_ends}
else:
    _, status = os.waitpid(pid, 0)
    bigger = torch.ones(2048, 1024)   # 8 MiB more, parent only
    print("child status", os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork here")
@pytest.mark.parametrize(
    ("child_ends", "child_status"),
    [("pass", 0), ("sys.exit(3)", 3), ("raise RuntimeError('child failed')", 1)],
)
def test_a_forked_child_never_writes_or_reports(child_ends: str, child_status: int, tmp_path: Path) -> None:
    (tmp_path / "forks.py").write_text(textwrap.dedent(FORKS.format(child_ends=child_ends)))
    done = _memtrim("run", "-o", "t.json", "forks.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"child status {child_status}" in done.stdout
    assert done.stderr.count("trace written to") == 1
    data = json.loads((tmp_path / "t.json").read_text())
    columns = data["allocations"]  # memtrim.trace/3: allocations as columns
    made = sorted(b for b, before in zip(columns["bytes"], columns["preexisting"], strict=True) if not before)
    # the parent's trace: its 8 MiB tensor (made after the child ended) is in it; the child's 16 floats
    # are not (each process records only its own ops)
    assert 2048 * 1024 * 4 in made and 16 * 4 not in made
    if child_status == 1:
        assert "RuntimeError: child failed" in done.stderr


def test_a_relative_output_path_means_the_folder_the_command_started_in(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "moves.py").write_text("import os, torch\nx = torch.ones(64)\nos.chdir('elsewhere')\n")
    done = _memtrim("run", "-o", "t.json", "--html", "t.html", "moves.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "t.json").is_file() and (tmp_path / "t.html").is_file()
    assert not list((tmp_path / "elsewhere").iterdir())
    assert "trace written to t.json" in done.stderr


def test_keyboard_interrupt_ends_memtrim_by_sigint_after_writing_the_trace(tmp_path: Path) -> None:
    (tmp_path / "stop.py").write_text("import torch\nx = torch.ones(64)\nraise KeyboardInterrupt\n")
    python = subprocess.run([sys.executable, "stop.py"], cwd=tmp_path, capture_output=True, text=True)
    done = _memtrim("run", "-o", "t.json", "stop.py", cwd=tmp_path)
    assert python.returncode == done.returncode == -signal.SIGINT, done.stderr
    assert "KeyboardInterrupt" in done.stderr
    assert json.loads((tmp_path / "t.json").read_text())["schema"].startswith("memtrim.trace/")
