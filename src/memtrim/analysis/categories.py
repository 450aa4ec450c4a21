"""Why an allocation was alive, from its lifetime: a registry of small rules tried in order, first
match wins.

``temporary`` means made and freed in the same phase — it spans ops. (torch.profiler's TEMPORARY means
"freed inside one op"; the seed problems live in the former kind, which the profiler does not name.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import Enum

from memtrim.registry import Registry
from memtrim.trace.model import Allocation, Phase


class Category(str, Enum):
    """What an allocation's lifetime says about it."""

    PREEXISTING = "preexisting"
    """Existed before the region (first seen as an op's input)."""
    SAVED = "saved"
    """Autograd saved it for backward."""
    GRADIENT = "gradient"
    """Made in backward and alive after it."""
    OUTPUT = "output"
    """Alive at the end of the region."""
    TEMPORARY = "temporary"
    """Made and freed in the same phase."""
    KEPT = "kept"
    """Outlived its phase without autograd saving it."""

    def __str__(self) -> str:
        return self.value


CategoryRule = Callable[[Allocation], "Category | None"]

CATEGORY_RULES: Registry[str, CategoryRule] = Registry(
    "category rule", "memtrim.analysis.categories.CATEGORY_RULES.register(name)"
)
"""Tried in registration order; the first rule that answers decides. Unanswered: ``kept``."""


@CATEGORY_RULES.register("preexisting")
def _preexisting(a: Allocation) -> Category | None:
    return Category.PREEXISTING if a.preexisting else None


@CATEGORY_RULES.register("saved")
def _saved(a: Allocation) -> Category | None:
    return Category.SAVED if a.saved else None


@CATEGORY_RULES.register("gradient")
def _gradient(a: Allocation) -> Category | None:
    survives_backward = a.free_tick is None or a.free_phase is not Phase.BACKWARD
    return Category.GRADIENT if a.phase is Phase.BACKWARD and survives_backward else None


@CATEGORY_RULES.register("output")
def _output(a: Allocation) -> Category | None:
    return Category.OUTPUT if a.free_tick is None else None


@CATEGORY_RULES.register("temporary")
def _temporary(a: Allocation) -> Category | None:
    return Category.TEMPORARY if a.free_phase is a.phase else None


def categorize(a: Allocation) -> Category:
    for rule in CATEGORY_RULES.values():
        found = rule(a)
        if found is not None:
            return found
    return Category.KEPT


# What the built-in rules read. While only they are registered, allocations alike in these fields get
# one answer, computed once: a million-allocation trace has a few dozen kinds, and a rule call per
# allocation was most of the time analyze() took on long traces.
_BUILT_IN = frozenset(CATEGORY_RULES.values())


def categorize_all(allocations: Sequence[Allocation]) -> tuple[Category, ...]:
    """:func:`categorize` of each allocation, in order."""
    if not set(CATEGORY_RULES.values()) <= _BUILT_IN:
        return tuple(map(categorize, allocations))
    known: dict[tuple[object, ...], Category] = {}
    found = []
    for a in allocations:
        key = (a.preexisting, a.saved, a.phase, a.free_phase, a.free_tick is None)
        category = known.get(key)
        if category is None:
            category = known[key] = categorize(a)
        found.append(category)
    return tuple(found)
