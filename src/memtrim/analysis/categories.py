"""Why an allocation was alive: a registry of small rules tried in order, first match wins.

``temporary`` means made and freed in the same phase — it spans ops. (torch.profiler's TEMPORARY means
"freed inside one op"; the seed problems live in the former kind, which the profiler does not name.)
"""

from __future__ import annotations

from collections.abc import Callable

from memtrim.trace.model import Allocation

CategoryRule = Callable[[Allocation], "str | None"]

CATEGORY_RULES: list[CategoryRule] = []


def category_rule(rule: CategoryRule) -> CategoryRule:
    CATEGORY_RULES.append(rule)
    return rule


@category_rule
def _preexisting(a: Allocation) -> str | None:
    return "preexisting" if a.preexisting else None


@category_rule
def _saved(a: Allocation) -> str | None:
    return "saved" if a.saved else None


@category_rule
def _gradient(a: Allocation) -> str | None:
    survives_backward = a.free_tick is None or a.free_phase != "backward"
    return "gradient" if a.phase == "backward" and survives_backward else None


@category_rule
def _output(a: Allocation) -> str | None:
    return "output" if a.free_tick is None else None


@category_rule
def _temporary(a: Allocation) -> str | None:
    return "temporary" if a.free_phase == a.phase else None


def categorize(a: Allocation) -> str:
    for rule in CATEGORY_RULES:
        found = rule(a)
        if found is not None:
            return found
    return "kept"
