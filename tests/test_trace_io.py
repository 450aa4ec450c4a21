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
    assert data["schema"] == "memtrim.trace/2"
    assert data["peak_bytes"] == trace.peak_bytes
    top = data["largest_temporaries"][0]
    assert {"bytes", "op", "shape", "dtype", "phase", "file", "line", "function"} <= set(top)
    assert top["bytes"] == 16 * 4 * 8 * 32 * 4 and top["op"] == "aten.mul.Tensor"


def test_save_is_atomic_and_leaves_no_temporary_files(trace: memtrim.Trace, tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    path.write_text("previous contents")
    trace.save(str(path))
    assert sorted(os.listdir(tmp_path)) == ["trace.json"]
    assert json.loads(path.read_text())["schema"] == "memtrim.trace/2"


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
