"""The loader's fast row readers accept exactly what the field-by-field checks accept: for every field of
an op row and of an allocation, replaced by each of a set of wrong (and some unusual but valid) values,
``log_from_dict(fast=True)`` gives the same log, or the same error, as ``fast=False``."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import torch

import memtrim
from memtrim.trace import serialize

ODD_VALUES: list[Any] = [
    None,
    -2,
    -1,
    0,
    1,
    2**62 - 1,
    2**62,
    True,
    False,
    1.5,
    "",
    "forward",
    "backward",
    "nonsense",
    [],
    [1, 2],
    [True],
    [-1],
    [1.0],
    ["x"],
    {},
    {"a": 1},
]


@pytest.fixture(scope="module")
def recorded() -> dict[str, Any]:
    layer = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)
    opt = torch.optim.Adam(layer.parameters())
    with memtrim.track() as trace, memtrim.region("step"):
        for _ in range(2):
            layer(x).relu().sum().backward()
            opt.step()
            opt.zero_grad()
    data = json.loads(json.dumps(serialize.log_to_dict_v2(trace.log)))  # the fast readers read /1 and /2
    assert any(a["facts"] for a in data["allocations"]), "the fixture must hold allocations with facts"
    assert any(a["free_tick"] is not None for a in data["allocations"])
    assert any(a["preexisting"] for a in data["allocations"])
    return data


def _outcome(data: dict[str, Any], *, fast: bool) -> tuple[str, Any]:
    try:
        log = serialize.log_from_dict(copy.deepcopy(data), fast=fast)
    except serialize.TraceFormatError as exc:
        return "error", str(exc)
    return "log", serialize.log_to_dict_v2(log)


def _same_either_way(data: dict[str, Any]) -> tuple[str, Any]:
    fast, slow = _outcome(data, fast=True), _outcome(data, fast=False)
    assert fast == slow
    return fast


def test_a_good_trace_reads_the_same_either_way(recorded: dict[str, Any]) -> None:
    kind, read = _same_either_way(recorded)
    assert kind == "log"
    assert read["ops"] == recorded["ops"] and read["allocations"] == recorded["allocations"]


def test_every_op_field_replaced_by_odd_values_reads_or_fails_the_same(recorded: dict[str, Any]) -> None:
    errors = 0
    middle = len(recorded["ops"]) // 2
    for column in range(len(recorded["op_columns"])):
        for value in ODD_VALUES:
            data = copy.deepcopy(recorded)
            data["ops"][middle][column] = value
            errors += _same_either_way(data)[0] == "error"
    for row in ([], [0] * 7, "row", None, [0] * 9):
        data = copy.deepcopy(recorded)
        data["ops"][middle] = row
        assert _same_either_way(data)[0] == "error"
    assert errors > len(recorded["op_columns"]) * 10  # most odd values are refused


def test_every_allocation_field_replaced_or_dropped_reads_or_fails_the_same(recorded: dict[str, Any]) -> None:
    freed = next(a for a in recorded["allocations"] if a["free_tick"] is not None and a["facts"])
    index = recorded["allocations"].index(freed)
    errors = 0
    for field in freed:
        for value in [*ODD_VALUES, ["parameter"], ["gradient", "parameter"], ["no-such-fact"]]:
            data = copy.deepcopy(recorded)
            data["allocations"][index][field] = value
            errors += _same_either_way(data)[0] == "error"
        data = copy.deepcopy(recorded)
        del data["allocations"][index][field]
        _same_either_way(data)
    assert errors > len(freed) * 10
