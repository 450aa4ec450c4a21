"""A trace file whose fields are each well-formed but contradict each other is refused with one line
naming the field (issue 23, item 7): the analysis replays ticks in order and bisects ops by tick, so a
free before its allocation or ops out of order would give a wrong peak, not an error."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import memtrim
from memtrim.trace import serialize

SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    layer = torch.nn.Linear(16, 16)
    x = torch.randn(4, 16)
    with memtrim.track() as trace, memtrim.region("step"):
        layer(x).relu().sum().backward()
    # the /2 layout (rows and objects), which the tamperings below edit; the checks are the same for /3
    # (tests/test_trace_columns.py tampers with a /3 file)
    return json.loads(json.dumps(serialize.log_to_dict_v2(trace.log)))


def _first_freed(data: dict[str, Any]) -> dict[str, Any]:
    return next(a for a in data["allocations"] if a["free_tick"] is not None and not a["preexisting"])


def _op_with_inputs(data: dict[str, Any]) -> list[Any]:
    return next(row for row in data["ops"] if row[-1])


def _free_before_alloc(d: dict[str, Any]) -> str:
    a = _first_freed(d)
    a["free_tick"] = a["alloc_tick"] - 1 if a["alloc_tick"] > 0 else 0
    return f"allocations[{a['id']}].free_tick"


def _alloc_after_end(d: dict[str, Any]) -> str:
    a = _first_freed(d)
    a["alloc_tick"], a["free_tick"] = d["end_tick"] + 5, d["end_tick"] + 6
    return f"allocations[{a['id']}].alloc_tick"


def _free_after_end(d: dict[str, Any]) -> str:
    a = _first_freed(d)
    a["free_tick"] = d["end_tick"] + 1
    return f"allocations[{a['id']}].free_tick"


def _reversed_region(d: dict[str, Any]) -> str:
    name, start, end = d["regions"][0]
    d["regions"][0] = [name, end, start]
    return "regions[0] end_tick"


def _ops_backwards(d: dict[str, Any]) -> str:
    d["ops"][2][1], d["ops"][3][1] = d["ops"][3][1], d["ops"][2][1]
    return "ops[3] tick"


def _input_names_no_allocation(d: dict[str, Any]) -> str:
    row = _op_with_inputs(d)
    row[-1] = [len(d["allocations"]) + 3]
    return f"ops[{row[0]}] inputs[0]"


def _preexisting_with_a_tick(d: dict[str, Any]) -> str:
    a = _first_freed(d)
    a["preexisting"] = True
    return f"allocations[{a['id']}].alloc_tick"


TAMPERINGS: dict[str, Callable[[dict[str, Any]], str]] = {
    "a free before its allocation": _free_before_alloc,
    "an allocation after the trace's end": _alloc_after_end,
    "a free after the trace's end": _free_after_end,
    "a region that ends before it starts": _reversed_region,
    "op ticks going backwards": _ops_backwards,
    "an input id that names no allocation": _input_names_no_allocation,
    "a pre-region storage with a tick": _preexisting_with_a_tick,
}


def test_the_untampered_trace_loads(recorded: dict[str, Any]) -> None:
    log = serialize.loads(json.dumps(recorded))
    assert len(log.ops) == len(recorded["ops"]) and log.regions[0].name == "step"


@pytest.mark.parametrize("tampering", TAMPERINGS, ids=list(TAMPERINGS))
def test_a_contradiction_is_refused_naming_the_field(recorded: dict[str, Any], tampering: str) -> None:
    data = copy.deepcopy(recorded)
    where = TAMPERINGS[tampering](data)
    with pytest.raises(memtrim.TraceFormatError, match=rf"^malformed memtrim trace: {re.escape(where)} "):
        serialize.loads(json.dumps(data))


def test_the_cli_says_it_in_one_line_with_exit_status_2(recorded: dict[str, Any], tmp_path: Path) -> None:
    data = copy.deepcopy(recorded)
    where = _free_before_alloc(data)
    path = tmp_path / "tampered.json"
    path.write_text(json.dumps(data))
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [sys.executable, "-m", "memtrim", "show", str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and where in lines[0] and "Traceback" not in done.stderr
