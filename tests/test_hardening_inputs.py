"""Files memtrim reads or writes that are hostile or left over: pipes and devices, numbers too long for
Python, huge strings, a save killed half way (issue 23, items 3-6 and 8)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import memtrim
from memtrim.trace import serialize

SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.fixture
def saved(tmp_path: Path) -> dict:
    x = torch.randn(8, 4, requires_grad=True)
    with memtrim.track() as recorded:
        (x * 2).sum().backward()
    path = tmp_path / "t.json"
    recorded.save(str(path))
    return json.loads(path.read_text())


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-m", "memtrim", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    # a writer that never comes: were load to wait, the test would hang; the timer ends it regardless
    opener = threading.Timer(20, lambda: os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)))
    opener.start()
    try:
        with pytest.raises(memtrim.TraceFormatError, match="not a regular file"):
            memtrim.load(str(fifo))
    finally:
        opener.cancel()


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
def test_devices_are_one_line_and_exit_status_2(device: str, tmp_path: Path) -> None:
    if not os.path.exists(device):
        pytest.skip(f"no {device} here")
    result = _cli("show", device, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "not a regular file" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_what_is_read_is_capped_before_parsing(
    saved: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "big.json"
    path.write_text(json.dumps(saved))
    monkeypatch.setattr(serialize, "MAX_TRACE_BYTES", path.stat().st_size - 1)
    with pytest.raises(memtrim.TraceFormatError, match="too large for a trace"):
        memtrim.load(str(path))
    monkeypatch.setattr(serialize, "MAX_TRACE_BYTES", path.stat().st_size)
    assert memtrim.load(str(path)).peak_bytes > 0


def test_a_5000_digit_integer_is_one_line_and_exit_status_2(saved: dict, tmp_path: Path) -> None:
    text = json.dumps(saved).replace('"end_tick": ', '"end_tick": ' + "9" * 5000 + ', "_was": ', 1)
    path = tmp_path / "long.json"
    path.write_text(text)
    with pytest.raises(memtrim.TraceFormatError, match="number too long"):
        memtrim.load(str(path))
    result = _cli("show", str(path), cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_huge_schema_string_is_quoted_by_a_short_prefix(tmp_path: Path) -> None:
    path = tmp_path / "schema.json"
    path.write_text(json.dumps({"schema": "x" * 5_000_000}))
    with pytest.raises(memtrim.TraceFormatError, match="re-record") as raised:
        memtrim.load(str(path))
    assert len(str(raised.value)) < 300 and "5000002 characters" in str(raised.value)


def test_a_killed_saves_temporary_is_removed_by_the_next_save(tmp_path: Path) -> None:
    target = tmp_path / "t.json"
    # a save killed before its rename (kill -9): the writer is gone, its temporary stays
    writer = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    dead_pid = int(writer.stdout)
    left_over = tmp_path / f".t.json.{dead_pid}-0123abcd.memtrim-tmp"
    left_over.write_text('{"schema": "memtrim.tr')
    live = tmp_path / f".t.json.{os.getpid()}-89abcdef.memtrim-tmp"  # a save still writing: kept
    live.write_text("")
    other_target = tmp_path / f".other.json.{dead_pid}-0123abcd.memtrim-tmp"  # not this target: kept
    other_target.write_text("")
    serialize.write_text_atomically(str(target), "done\n")
    assert target.read_text() == "done\n"
    assert not left_over.exists() and live.exists() and other_target.exists()


def test_a_save_killed_by_sigkill_leaves_nothing_after_the_next_save(tmp_path: Path) -> None:
    target = tmp_path / "t.json"
    target.write_text("old\n")
    script = textwrap.dedent(
        f"""
        import os, signal
        from memtrim.trace.serialize import atomic_file
        with atomic_file({str(target)!r}) as handle:
            handle.write("half")
            handle.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    env = {**os.environ, "PYTHONPATH": SRC}
    killed = subprocess.run([sys.executable, "-c", script], env=env, timeout=60)
    assert killed.returncode == -signal.SIGKILL
    assert target.read_text() == "old\n" and len(list(tmp_path.glob(".t.json.*.memtrim-tmp"))) == 1
    serialize.write_text_atomically(str(target), "new\n")
    assert target.read_text() == "new\n" and list(tmp_path.iterdir()) == [target]


def test_a_current_schema_trace_whose_ops_read_nothing_is_not_called_the_first_schema() -> None:
    with memtrim.track() as recorded:
        kept = torch.zeros(256, 256)  # factory ops: no op reads a tensor
    del kept
    report = recorded.report()
    assert "no op in this trace records a tensor it read" in report
    assert "(memtrim.trace/1);" not in report
