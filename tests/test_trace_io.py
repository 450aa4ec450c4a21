"""Traces round-trip through JSON, are written atomically, and bad files get clear errors."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

import memtrim
from memtrim.cases.heads import head_results_broadcast
from memtrim.trace import serialize


@pytest.fixture
def trace() -> memtrim.Trace:
    z = torch.randn(16, 4, 8, requires_grad=True)
    W_O = torch.randn(4, 8, 32, requires_grad=True)
    with memtrim.track() as recorded:
        head_results_broadcast(z, W_O).sum().backward()
    return recorded


def test_round_trip_keeps_every_figure(trace: memtrim.Trace, tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    trace.save(str(path))
    loaded = memtrim.load(str(path))
    assert loaded.to_dict() == trace.to_dict()
    assert loaded.peak_bytes == trace.peak_bytes
    assert loaded.report() == trace.report()


def test_json_has_the_documented_fields(trace: memtrim.Trace, tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    trace.save(str(path))
    data = json.loads(path.read_text())
    assert data["schema"] == "memtrim.trace/3"
    assert data["peak_bytes"] == trace.peak_bytes
    top = data["largest_temporaries"][0]
    assert {"bytes", "op", "shape", "dtype", "phase", "file", "line", "function"} <= set(top)
    assert top["bytes"] == 16 * 4 * 8 * 32 * 4 and top["op"] == "aten.mul.Tensor"


def test_save_is_atomic_and_leaves_no_temporary_files(trace: memtrim.Trace, tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    path.write_text("previous contents")
    trace.save(str(path))
    assert sorted(os.listdir(tmp_path)) == ["trace.json"]
    assert json.loads(path.read_text())["schema"] == "memtrim.trace/3"


def test_load_rejects_pickle_and_foreign_json(tmp_path: Path) -> None:
    pickled = tmp_path / "trace.pkl"
    pickled.write_bytes(pickle.dumps({"schema": "memtrim.trace/1"}))
    with pytest.raises(memtrim.TraceFormatError, match="memtrim traces are JSON"):
        memtrim.load(str(pickled))
    foreign = tmp_path / "other.json"
    foreign.write_text(json.dumps({"hello": 1}))
    with pytest.raises(memtrim.TraceFormatError, match="'schema' field"):
        memtrim.load(str(foreign))
    future = tmp_path / "future.json"
    future.write_text(json.dumps({"schema": "memtrim.trace/99"}))
    with pytest.raises(memtrim.TraceFormatError, match="re-record"):
        memtrim.load(str(future))
    truncated = tmp_path / "bad.json"
    truncated.write_text(json.dumps({"schema": "memtrim.trace/2", "sites": []}))
    with pytest.raises(memtrim.TraceFormatError, match="malformed"):
        memtrim.load(str(truncated))


def _saved_dict(trace: memtrim.Trace, tmp_path: Path) -> dict:
    path = tmp_path / "t.json"
    trace.save(str(path))
    return json.loads(path.read_text())


def _v2_dict(trace: memtrim.Trace) -> dict:
    """The trace in the memtrim.trace/2 layout (ops as rows, allocations as objects)."""
    return json.loads(json.dumps(serialize.log_to_dict_v2(trace.log)))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("alloc_tick", None, r"allocations\[0\]\.alloc_tick should be an integer"),
        ("bytes", "12", r"allocations\[0\]\.bytes should be an integer"),
        ("bytes", 10**400, r"allocations\[0\]\.bytes should be an integer from 0 to 2\*\*62"),
        ("bytes", 2**70, r"allocations\[0\]\.bytes should be an integer from 0 to 2\*\*62"),
        ("bytes", -5, r"allocations\[0\]\.bytes should be an integer from 0"),
        ("bytes", 12.0, r"allocations\[0\]\.bytes should be an integer"),
        ("bytes", True, r"allocations\[0\]\.bytes should be an integer"),
        ("phase", "sideways", r"allocations\[0\]\.phase should be one of 'forward', 'backward'"),
        ("shape", "4x4", r"allocations\[0\]\.shape should be (a list|a number in shapes)"),
        ("site", 10**6, r"allocations\[0\]\.site should be a site number below"),
        ("facts", ["weights"], r"allocations\[0\]\.facts\[0\] should be one of 'parameter'"),
    ],
)
@pytest.mark.parametrize("layout", ["/2", "/3"])
def test_wrong_field_types_are_one_clear_error_naming_the_field(
    trace: memtrim.Trace, tmp_path: Path, field: str, value: object, message: str, layout: str
) -> None:
    if layout == "/2":
        data = _v2_dict(trace)
        data["allocations"][0][field] = value
    else:
        data = _saved_dict(trace, tmp_path)
        data["allocations"][field][0] = value  # /3: allocations as columns
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(memtrim.TraceFormatError, match=message):
        memtrim.load(str(bad))


def test_nan_and_infinity_are_refused(trace: memtrim.Trace, tmp_path: Path) -> None:
    text = json.dumps(_saved_dict(trace, tmp_path))
    first = text.index('"bytes": ') + len('"bytes": ')
    end = text.index(",", first)
    for constant in ("NaN", "Infinity", "-Infinity"):
        bad = tmp_path / "nan.json"
        bad.write_text(text[:first] + constant + text[end:])
        with pytest.raises(memtrim.TraceFormatError, match=f"{constant} is not a number a trace can hold"):
            memtrim.load(str(bad))


def test_saved_files_honour_the_umask_like_open(trace: memtrim.Trace, tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        trace.save(str(tmp_path / "a.json"))
        with open(tmp_path / "b.json", "w") as handle:
            handle.write("{}")
    finally:
        os.umask(old)
    assert (
        (tmp_path / "a.json").stat().st_mode & 0o777 == (tmp_path / "b.json").stat().st_mode & 0o777 == 0o644
    )
    os.chmod(tmp_path / "a.json", 0o600)  # an existing file keeps its permissions
    trace.save(str(tmp_path / "a.json"))
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o600


def test_unwritable_paths_are_found_before_a_run(tmp_path: Path) -> None:
    from memtrim.trace import check_writable

    check_writable(str(tmp_path / "new.json"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_writable(str(tmp_path / "missing" / "t.json"))
    with pytest.raises(IsADirectoryError, match="is a folder"):
        check_writable(str(tmp_path))


def test_control_sequences_in_a_trace_never_reach_the_terminal(
    trace: memtrim.Trace, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from memtrim.cli import main

    data = _saved_dict(trace, tmp_path)
    data["sites"] = [["\x1b]0;owned\x07evil.py", line, "f\x1b[2J\u202e"] for _, line, _ in data["sites"]]
    data["strings"] = [s.replace("aten.", "aten.mul\x1b[31m") for s in data["strings"]]  # op names
    data["error"] = "RuntimeError: \x1b[2Jboom\r"
    bad = tmp_path / "evil.json"
    bad.write_text(json.dumps(data))
    assert main(["show", str(bad)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out and "\r" not in out
    assert "\\x1b]0;owned\\x07evil.py" in out and "\\u202e" in out


def test_a_file_that_names_the_first_schemas_op_columns_loads(trace: memtrim.Trace, tmp_path: Path) -> None:
    data = _v2_dict(trace)
    data["op_columns"] = data["op_columns"][:-1]
    data["ops"] = [row[:-1] for row in data["ops"]]
    data["failed_op"] = None
    path = tmp_path / "no-inputs.json"
    path.write_text(json.dumps(data))
    loaded = memtrim.load(str(path))
    assert [op.inputs for op in loaded.ops] == [()] * len(trace.ops)
    assert loaded.peak_bytes == trace.peak_bytes
    data["op_columns"] = ["tick", "op"]
    path.write_text(json.dumps(data))
    with pytest.raises(memtrim.TraceFormatError, match="op_columns should be"):
        memtrim.load(str(path))
