"""The memtrim.trace/3 layout (ops and allocations as columns, string, shape and site tables): a
recorded trace round-trips, the same trace in the /2 layout loads to the same log, and every corrupted
column, table or count is one TraceFormatError naming the field and the row."""

from __future__ import annotations

import copy
import io
import json
import re
from typing import Any

import pytest
import torch

import memtrim
from memtrim.trace import serialize, stream
from memtrim.trace.model import TraceLog

ODD_VALUES: list[Any] = [None, -2, -1, 0, 1, 2**62, True, 1.5, "", "forward", [], [1], {}, 10**6]


@pytest.fixture(scope="module")
def log() -> TraceLog:
    layer = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)
    opt = torch.optim.Adam(layer.parameters())
    with memtrim.track() as trace, memtrim.region("step"):
        for _ in range(2):
            (layer(x).relu() / 3.0).sum().backward()
            opt.step()
            opt.zero_grad()
    return trace.log


@pytest.fixture
def data(log: TraceLog) -> dict[str, Any]:
    return json.loads(serialize.dumps(log))


def _load(data: dict[str, Any]) -> TraceLog:
    return serialize.loads(json.dumps(data))


def test_the_file_is_columns_and_tables(data: dict[str, Any], log: TraceLog) -> None:
    assert data["schema"] == "memtrim.trace/3"
    assert data["ops"]["count"] == len(log.ops) and len(data["ops"]["tick"]) == len(log.ops)
    assert data["allocations"]["count"] == len(log.allocations)
    assert set(data["allocations"]) == {"count", *serialize_fields()}
    assert all(type(s) is str for s in data["strings"]) and len(set(data["strings"])) == len(data["strings"])


def serialize_fields() -> tuple[str, ...]:
    from memtrim.trace.columns import ALLOCATION_FIELDS

    return ALLOCATION_FIELDS


def test_a_recorded_trace_round_trips(data: dict[str, Any], log: TraceLog) -> None:
    loaded = _load(data)
    assert loaded.ops.rows == log.ops.rows and loaded.allocations == log.allocations
    assert loaded.regions == log.regions and loaded.scalars == log.scalars and loaded.scalars
    assert any(a.facts for a in loaded.allocations) and any(a.preexisting for a in loaded.allocations)
    assert any(a.free_tick is not None for a in loaded.allocations)
    assert any(row.inputs for row in loaded.ops.rows) and any(row.node for row in loaded.ops.rows)
    assert serialize.log_to_dict(loaded) == data  # and saves again to the same file


def test_the_streamed_file_is_the_same_json(
    log: TraceLog, data: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stream, "CHUNK", 3)  # many chunks per column
    handle = io.StringIO()
    stream.write(log, handle)
    assert json.loads(handle.getvalue()) == data


def test_the_same_trace_in_the_second_schema_loads_to_the_same_log(log: TraceLog) -> None:
    old = json.loads(json.dumps(serialize.log_to_dict_v2(log)))
    assert old["schema"] == "memtrim.trace/2"
    loaded = serialize.loads(json.dumps(old))
    assert loaded.ops.rows == log.ops.rows and loaded.allocations == log.allocations
    assert serialize.log_to_dict(loaded) == serialize.log_to_dict(log)


def test_a_failed_op_round_trips(log: TraceLog) -> None:
    failed = copy.copy(log)
    failed.failed_op = log.ops[3]
    failed.failed_op.tick = log.end_tick - 1
    loaded = _load(json.loads(serialize.dumps(failed)))
    assert loaded.failed_op == failed.failed_op


def _outcome(data: dict[str, Any]) -> str | None:
    """None when ``data`` loads, else the error; any other exception fails the test."""
    try:
        _load(data)
    except memtrim.TraceFormatError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("section", ["ops", "allocations"])
def test_every_value_of_every_column_replaced_is_a_log_or_an_error_naming_the_row(
    data: dict[str, Any], section: str
) -> None:
    row = data[section]["count"] // 2
    errors = 0
    for field in data[section]:
        if field == "count":
            continue
        for value in ODD_VALUES:
            bad = copy.deepcopy(data)
            bad[section][field][row] = value
            error = _outcome(bad)
            if error is not None:
                errors += 1
                # the value's row (or, for a tick out of order, the next op's), and a field of it
                named = rf"malformed memtrim trace: {section}\[({row}|{row + 1})\][ .]"
                if field == "inputs":  # a flat column: the error names the op holding that value
                    assert re.match(r"malformed memtrim trace: ops\[\d+\] inputs\[\d+\] ", error), error
                elif field == "input_count" and "ops.inputs should be a list of" in error:
                    pass  # a count that no longer adds up to the inputs column's length
                else:
                    assert re.match(named, error), (field, value, error)
        for cut in (bad_column for bad_column in ([], "column", None, {"0": 1})):
            bad = copy.deepcopy(data)
            bad[section][field] = cut
            error = _outcome(bad)
            assert error is not None and f"{section}.{field}" in error, error
        bad = copy.deepcopy(data)
        del bad[section][field]
        assert f"has no {field!r} field" in (_outcome(bad) or "")
    assert errors > 5 * len(data[section])


def test_counts_and_tables_are_checked(data: dict[str, Any]) -> None:
    cases: list[tuple[str, Any, str]] = [
        ("strings", ["ok", 3], "strings[1] should be a string"),
        ("strings", "abc", "strings should be a list"),
        ("shapes", [[1, 2], [-1]], r"shapes[1][0] should be an integer"),
        ("shapes", [[1], "2"], "shapes[1] should be a list"),
        ("sites", [["a.py", "1", "f"]], "sites[0] line should be an integer"),
        ("ops", [], "ops should be an object of columns"),
    ]
    for key, value, message in cases:
        bad = copy.deepcopy(data)
        bad[key] = value
        assert message in (_outcome(bad) or ""), (key, value)
    for section in ("ops", "allocations"):
        for count in (-1, "3", data[section]["count"] + 1, None):
            bad = copy.deepcopy(data)
            bad[section]["count"] = count
            assert section in (_outcome(bad) or ""), (section, count)
    bad = copy.deepcopy(data)
    bad["ops"]["inputs"].append(0)
    assert "ops.inputs should be a list of" in (_outcome(bad) or "")


def test_a_tampered_column_is_refused_naming_the_contradiction(data: dict[str, Any]) -> None:
    bad = copy.deepcopy(data)
    ticks = bad["ops"]["tick"]
    ticks[2], ticks[3] = ticks[3], ticks[2]
    assert (_outcome(bad) or "").startswith("malformed memtrim trace: ops[3] tick ")
    bad = copy.deepcopy(data)
    freed = next(i for i, t in enumerate(bad["allocations"]["free_tick"]) if t is not None)
    bad["allocations"]["free_tick"][freed] = bad["allocations"]["alloc_tick"][freed]
    assert (_outcome(bad) or "").startswith(f"malformed memtrim trace: allocations[{freed}].free_tick ")
    bad = copy.deepcopy(data)
    bad["allocations"]["free_phase"][freed] = None
    assert (_outcome(bad) or "").startswith(f"malformed memtrim trace: allocations[{freed}].free_phase ")
    bad = copy.deepcopy(data)
    bad["ops"]["inputs"][-1] = data["allocations"]["count"]
    assert re.match(
        r"malformed memtrim trace: ops\[\d+\] inputs\[\d+\] should be an allocation id", _outcome(bad) or ""
    )
    bad = copy.deepcopy(data)
    new = next(i for i, p in enumerate(bad["allocations"]["preexisting"]) if not p)
    bad["allocations"]["alloc_tick"][new] = -1
    assert (_outcome(bad) or "").startswith(f"malformed memtrim trace: allocations[{new}].alloc_tick ")
