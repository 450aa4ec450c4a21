"""The plan file (memtrim.plan/1): what is saved loads back equal; anything malformed is refused by field;
a write that fails leaves the old file whole; budgets parse to bytes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from memtrim.plan import SCHEMA, Numerics, Plan, PlanFormatError, PlannedLever, load_plan, parse_budget


def _plan() -> Plan:
    return Plan(
        budget=24 * 2**30,
        baseline_peak=31 * 2**30,
        predicted_peak=23 * 2**30,
        measured_peak=None,
        levers=[
            PlannedLever("optimizer-fused", "AdamW", {"fused": True}, "reference", 30 * 2**30, 0.0),
            PlannedLever("checkpoint", "model.layers.0-11", {"blocks": [0, 11]}, "exact", 23 * 2**30, 1.5e12),
        ],
        numerics=Numerics("pass", {"loss": 0.0, "model.layers.0.mlp.weight.grad": 0.0}, "same program"),
    )


def test_a_saved_plan_loads_back_equal(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    plan = _plan()
    plan.save(str(path))
    assert json.loads(path.read_text())["schema"] == SCHEMA
    assert load_plan(str(path)) == plan


def _saved(tmp_path: Path, edit: Any) -> str:
    data = _plan().to_json()
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(schema="memtrim.plan/9"), "schema is 'memtrim.plan/9'"),
        (lambda d: d.pop("budget"), "has no 'budget' field"),
        (lambda d: d.update(budget=-1), "budget should be a byte count"),
        (lambda d: d.update(measured_peak="1GiB"), "measured_peak should be a byte count"),
        (lambda d: d["levers"][1].update(keeps="mostly"), "levers[1].keeps should be one of"),
        (lambda d: d["levers"][0].update(cost=float("inf")), "levers[0].cost should be a finite number"),
        (lambda d: d["levers"][0].pop("target"), "levers[0] has no 'target' field"),
        (lambda d: d["numerics"].update(verdict="ok"), "numerics.verdict should be one of"),
    ],
)
def test_a_malformed_plan_is_refused_naming_the_field(tmp_path: Path, edit: Any, message: str) -> None:
    with pytest.raises(PlanFormatError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_plan(_saved(tmp_path, edit))


def test_a_file_that_is_not_json_or_not_a_plan_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_text("{not json")
    with pytest.raises(PlanFormatError, match="is not JSON"):
        load_plan(str(path))
    path.write_text("[1, 2]")
    with pytest.raises(PlanFormatError, match="not a memtrim plan"):
        load_plan(str(path))


def test_a_failed_save_leaves_the_old_plan_whole(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    _plan().save(str(path))
    before = path.read_text()
    broken = _plan()
    broken.levers[0].params["bad"] = object()  # not JSON: the write fails before anything is replaced
    with pytest.raises(TypeError):
        broken.save(str(path))
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24GiB", 24 * 2**30),
        ("1500MiB", 1500 * 2**20),
        ("8GB", 8 * 10**9),
        ("1.5 KiB", 1536),
        ("4096", 4096),
        (12345, 12345),
        ("2g", 2 * 10**9),
    ],
)
def test_budgets_parse_to_bytes(text: str | int, expected: int) -> None:
    assert parse_budget(text) == expected


@pytest.mark.parametrize("text", ["", "0", "-1GiB", "24 gibibytes", "iB", "1e9", "GiB"])
def test_a_budget_that_is_not_one_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="budget"):
        parse_budget(text)
