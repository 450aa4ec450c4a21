"""The plan file: JSON with ``"schema": "memtrim.plan/1"``, written atomically, validated on load.

A plan records the budget it was made for, the unplanned (baseline) peak, the peak predicted with every
lever applied together, the peak measured when the plan was re-run (null until it is), each lever with
its target, parameters, what it keeps, the predicted peak after it and its cost, and the numeric check's
verdict with the largest differences it saw. Loading refuses anything else with one line naming the
field, as traces do (:class:`memtrim.trace.serialize.TraceFormatError`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from memtrim.doctor.diagnosis import KEEPS, Keeps
from memtrim.trace.serialize import atomic_file

SCHEMA = "memtrim.plan/1"
MAX_BYTES = 2**62
Verdict = Literal["pass", "fail", "not-run"]
VERDICTS: tuple[Verdict, ...] = ("pass", "fail", "not-run")

_UNIT_POWERS = {"": 0, "b": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
_BUDGET = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgtp]?)(i?)(b?)\s*", re.IGNORECASE)


class PlanFormatError(ValueError):
    """A plan file memtrim cannot read; the message names the field and what it should be."""


def parse_budget(text: str | int) -> int:
    """``"24GiB"`` -> 25,769,803,776 bytes. Binary units (KiB, MiB, GiB, TiB) count in 1024s, decimal
    ones (KB, MB, GB, TB) in 1000s; a bare number is bytes. Refuses zero, negatives and other text."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text <= 0:
            raise ValueError(f"a memory budget must be positive, got {text}")
        return text
    match = _BUDGET.fullmatch(str(text))
    if match is None or (match.group(3) and not match.group(2)):
        raise ValueError(f"not a memory budget: {text!r} (write it like 24GiB, 1500MiB, 8GB or 1048576)")
    number, prefix, binary, _ = match.groups()
    base = 1024 if binary or not prefix else 1000
    value = float(number) * base ** _UNIT_POWERS[prefix.lower()]
    if not 0 < value < MAX_BYTES:
        raise ValueError(f"a memory budget must be between 1 byte and 4 EiB, got {text!r}")
    return math.floor(value)


@dataclass(frozen=True)
class PlannedLever:
    """One change in a plan: which lever, applied to what, and what the plan predicted after it."""

    lever: str
    """The lever's registered name (``"checkpoint"``, ``"optimizer-fused"``...)."""
    target: str
    """What it is applied to, as the user would name it (``"model.transformer.h.0-5"``, ``"AdamW"``)."""
    params: dict[str, Any]
    """The lever's settings (JSON values: k micro-batches, block names...)."""
    keeps: Keeps
    predicted_peak_after: int
    """The replayed peak with this lever and every lever before it in the plan applied together."""
    cost: float
    """What it costs to run: extra FLOPs for a recompute, extra passes; 0 for a free lever."""


@dataclass(frozen=True)
class Numerics:
    """The numeric check: one step with and without the plan from the same state and seed."""

    verdict: Verdict
    max_differences: dict[str, float] = field(default_factory=dict)
    """The largest absolute difference per compared quantity (``"loss"``, a parameter's gradient)."""
    note: str = ""
    """Which program was checked, e.g. a small config of the model under ``--fake``."""


@dataclass
class Plan:
    """The levers that fit a program into ``budget`` bytes, predicted, then measured and checked."""

    budget: int
    baseline_peak: int
    predicted_peak: int
    levers: list[PlannedLever]
    measured_peak: int | None = None
    numerics: Numerics = field(default_factory=lambda: Numerics("not-run"))

    def code(self) -> str:
        """The code a user would paste to get the same changes without :func:`memtrim.applied`: one
        line per lever used, in plan order."""
        from memtrim.plan.levers import LEVERS  # the levers import the doctor; a plan file does not need it

        used: dict[str, list[dict[str, Any]]] = {}
        for lever in self.levers:
            used.setdefault(lever.lever, []).append(lever.params)
        return "\n".join(LEVERS[name].code(params) for name, params in used.items())

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "budget": self.budget,
            "baseline_peak": self.baseline_peak,
            "predicted_peak": self.predicted_peak,
            "measured_peak": self.measured_peak,
            "levers": [
                {
                    "lever": lever.lever,
                    "target": lever.target,
                    "params": lever.params,
                    "keeps": lever.keeps,
                    "predicted_peak_after": lever.predicted_peak_after,
                    "cost": lever.cost,
                }
                for lever in self.levers
            ],
            "numerics": {
                "verdict": self.numerics.verdict,
                "max_differences": self.numerics.max_differences,
                "note": self.numerics.note,
            },
        }

    def save(self, path: str) -> None:
        """Write the plan to ``path`` whole or not at all."""
        text = json.dumps(self.to_json(), indent=1, allow_nan=False)
        with atomic_file(path) as handle:
            handle.write(text + "\n")


# -- validation ------------------------------------------------------------------------------------
def _fail(where: str, expected: str, value: Any) -> PlanFormatError:
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return PlanFormatError(f"malformed memtrim plan: {where} should be {expected}, got {shown}")


def _field(data: dict[str, Any], name: str, where: str) -> Any:
    if name not in data:
        raise PlanFormatError(f"malformed memtrim plan: {where} has no {name!r} field")
    return data[name]


def _bytes(value: Any, where: str, *, nullable: bool = False) -> Any:
    if value is None and nullable:
        return None
    if type(value) is not int or not 0 <= value < MAX_BYTES:
        raise _fail(
            where, "a byte count (an integer from 0 to 2**62)" + (" or null" if nullable else ""), value
        )
    return value


def _number(value: Any, where: str) -> float:
    if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
        raise _fail(where, "a finite number at or above 0", value)
    return float(value)


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise _fail(where, "an object", value)
    return cast(dict[str, Any], value)


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise _fail(where, "a non-empty string", value)
    return value


def _lever(data: Any, where: str) -> PlannedLever:
    data = _object(data, where)
    keeps = _field(data, "keeps", where)
    if keeps not in KEEPS:
        raise _fail(where + ".keeps", "one of " + ", ".join(repr(k) for k in KEEPS), keeps)
    return PlannedLever(
        lever=_string(_field(data, "lever", where), where + ".lever"),
        target=_string(_field(data, "target", where), where + ".target"),
        params=_object(_field(data, "params", where), where + ".params"),
        keeps=keeps,
        predicted_peak_after=_bytes(
            _field(data, "predicted_peak_after", where), where + ".predicted_peak_after"
        ),
        cost=_number(_field(data, "cost", where), where + ".cost"),
    )


def _numerics(data: Any) -> Numerics:
    data = _object(data, "numerics")
    verdict = _field(data, "verdict", "numerics")
    if verdict not in VERDICTS:
        raise _fail("numerics.verdict", "one of " + ", ".join(repr(v) for v in VERDICTS), verdict)
    differences = _object(_field(data, "max_differences", "numerics"), "numerics.max_differences")
    note = data.get("note", "")
    if not isinstance(note, str):
        raise _fail("numerics.note", "a string", note)
    return Numerics(
        verdict=verdict,
        max_differences={k: _number(v, f"numerics.max_differences[{k!r}]") for k, v in differences.items()},
        note=note,
    )


def plan_from_json(data: Any) -> Plan:
    """A :class:`Plan` from parsed JSON, every field checked; :class:`PlanFormatError` names the first
    wrong one."""
    if not isinstance(data, dict) or "schema" not in data:
        raise PlanFormatError("not a memtrim plan: expected a JSON object with a 'schema' field")
    if data["schema"] != SCHEMA:
        raise PlanFormatError(
            f"not a memtrim plan this version reads: schema is {data['schema']!r}, expected {SCHEMA!r}"
        )
    levers = _field(data, "levers", "the plan")
    if not isinstance(levers, list):
        raise _fail("levers", "a list", levers)
    return Plan(
        budget=_bytes(_field(data, "budget", "the plan"), "budget"),
        baseline_peak=_bytes(_field(data, "baseline_peak", "the plan"), "baseline_peak"),
        predicted_peak=_bytes(_field(data, "predicted_peak", "the plan"), "predicted_peak"),
        measured_peak=_bytes(_field(data, "measured_peak", "the plan"), "measured_peak", nullable=True),
        levers=[_lever(lever, f"levers[{i}]") for i, lever in enumerate(levers)],
        numerics=_numerics(_field(data, "numerics", "the plan")),
    )


def load_plan(path: str) -> Plan:
    """Read a plan saved by :meth:`Plan.save`; a file that is not one raises :class:`PlanFormatError`."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except json.JSONDecodeError as error:
        raise PlanFormatError(
            f"not a memtrim plan: {path} is not JSON ({error.msg} at line {error.lineno})"
        ) from None
    return plan_from_json(data)
