"""Levers: changes memtrim can both predict on a recorded timeline and apply to a live program.

Each lever is registered once in :data:`LEVERS` (the one :class:`~memtrim.registry.Registry` idiom) and
offers :class:`Option` s for a recorded analysis — one per independent choice (one block to checkpoint),
each with the :class:`~memtrim.analysis.whatif.Edits` that predict it and its cost. A combination of
options is predicted by replaying their merged edits together, never by summing savings.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from memtrim.analysis.whatif import Added, Edits
from memtrim.doctor.diagnosis import Keeps
from memtrim.doctor.rules.checkpoint import block_recomputes
from memtrim.registry import Registry

if TYPE_CHECKING:
    from memtrim.analysis.analysis import Analysis


@dataclass(frozen=True)
class Option:
    """One choice a lever offers: applied to ``target`` with ``params``, costing ``cost``."""

    lever: str
    target: str
    params: dict[str, Any]
    keeps: Keeps
    cost: float
    """Extra work it makes (recompute FLOPs); 0 for a free change."""
    edits: Edits = field(repr=False, compare=False)


@dataclass(frozen=True)
class Lever:
    """A registered lever: what it keeps, the options it offers on a recording, and the code a user
    would paste to get the same change without memtrim."""

    name: str
    keeps: Keeps
    options: Callable[[Analysis], list[Option]]
    code: Callable[[Sequence[dict[str, Any]]], str]
    """The code for a plan's uses of this lever, from their ``params`` (in plan order)."""


LEVERS: Registry[str, Lever] = Registry("plan lever", "memtrim.plan.levers.LEVERS.add(name, Lever(...))")


def merged(edits: Iterable[Edits]) -> Edits:
    """One what-if from several: each lever's edits touch its own allocations, so they merge."""
    remove: set[int] = set()
    resize: dict[int, int] = {}
    alloc_at: dict[int, float] = {}
    free_at: dict[int, float | None] = {}
    add: list[Added] = []
    for e in edits:
        remove |= e.remove
        resize.update(e.resize)
        alloc_at.update(e.alloc_at)
        free_at.update(e.free_at)
        add += e.add
    return Edits(frozenset(remove), resize, alloc_at, free_at, tuple(add))


# -- activation checkpointing, block by block --------------------------------------------------------
def _checkpoint_options(analysis: Analysis) -> list[Option]:
    options = []
    for recomputes in block_recomputes(analysis).values():
        for r in recomputes:
            options.append(
                Option("checkpoint", r.attribute, {"module": r.attribute}, "exact", float(r.flops), r.edits)
            )
    return options


def _checkpoint_code(params: Sequence[dict[str, Any]]) -> str:
    names = [p["module"] for p in params]
    return f"memtrim.fixes.checkpoint_modules(model, {names!r})  # model: the module they are named in"


LEVERS.add("checkpoint", Lever("checkpoint", "exact", _checkpoint_options, _checkpoint_code))
