"""The search: the cheapest combination of lever options whose replayed peak is at or under a budget.

Every subset of up to :data:`EXHAUSTIVE` options is replayed (each combination's edits merged and
replayed on the one live curve: exact); beyond that, options are added greedily by bytes saved per unit
of cost until the budget is met. The Pareto front (peak vs cost) comes from the same replays.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from memtrim.plan.levers import LEVERS, Option, merged

if TYPE_CHECKING:
    from memtrim.analysis.analysis import Analysis

EXHAUSTIVE = 10
"""Up to this many options every subset is replayed (1,024 replays); more are searched greedily."""


@dataclass(frozen=True)
class Candidate:
    """A combination of options and its replayed peak."""

    options: tuple[Option, ...]
    peak: int

    @property
    def cost(self) -> float:
        return sum(o.cost for o in self.options)


@dataclass(frozen=True)
class Search:
    baseline: int
    best: Candidate | None
    """The cheapest candidate at or under the budget (None: none fits)."""
    lowest: Candidate
    """The lowest peak any searched combination reaches."""
    front: tuple[Candidate, ...]
    """Pareto front, by cost: no other candidate is at most as costly, with at most as many levers,
    keeping as much and at most as high, being better in one (so the chosen plan is on it)."""


def options_of(analysis: Analysis, allow: frozenset[str] = frozenset({"exact", "reference"})) -> list[Option]:
    """Every option each registered lever offers on ``analysis``, limited to what ``allow`` keeps."""
    return [o for lever in LEVERS.values() for o in lever.options(analysis) if o.keeps in allow]


def _peak(analysis: Analysis, options: tuple[Option, ...]) -> int:
    return analysis.peak_with(merged(o.edits for o in options)) if options else analysis.peak.bytes


def _compatible(options: tuple[Option, ...]) -> bool:
    keys = [o.exclusive for o in options if o.exclusive is not None]
    levers = {o.lever for o in options}
    return len(keys) == len(set(keys)) and not any(o.excludes & levers for o in options)


_KEEPS_ORDER = {"exact": 0, "reference": 1, "changes-training": 2}


def _kept(candidate: Candidate) -> int:
    """How much the candidate changes: its least-keeping option's rank (0: every option exact)."""
    return max((_KEEPS_ORDER[o.keeps] for o in candidate.options), default=0)


def _best(candidates: list[Candidate], budget: int) -> Candidate | None:
    """The cheapest at or under ``budget``; at the same cost the fewest changes (a free lever the budget
    does not need stays out), then the one that keeps most (bit for bit before no less accurate), then
    the lowest."""
    fits = [c for c in candidates if c.peak <= budget]
    return min(fits, key=lambda c: (c.cost, len(c.options), _kept(c), c.peak)) if fits else None


def _pareto(candidates: list[Candidate]) -> tuple[Candidate, ...]:
    front: list[Candidate] = []
    # in this order a candidate's dominators come before it, and each is dominated by one on the front
    for c in sorted(candidates, key=lambda c: (c.cost, len(c.options), _kept(c), c.peak)):
        if not any(
            d.peak <= c.peak and len(d.options) <= len(c.options) and _kept(d) <= _kept(c) for d in front
        ):
            front.append(c)
    return tuple(front)


def search(analysis: Analysis, budget: int, options: list[Option]) -> Search:
    baseline = analysis.peak.bytes
    candidates = [Candidate((), baseline)]
    if len(options) <= EXHAUSTIVE:
        for n in range(1, len(options) + 1):
            for combo in itertools.combinations(options, n):
                if _compatible(combo):
                    candidates.append(Candidate(combo, _peak(analysis, combo)))
    else:
        chosen: tuple[Option, ...] = ()
        current = baseline
        left = list(options)
        while left and current > budget:
            scored = [(o, _peak(analysis, (*chosen, o))) for o in left if _compatible((*chosen, o))]
            if not scored:
                break
            option, peak = max(scored, key=lambda s: (current - s[1]) / (s[0].cost + 1.0))
            if peak >= current:
                break
            chosen, current = (*chosen, option), peak
            left.remove(option)
            candidates.append(Candidate(chosen, peak))
    best = _best(candidates, budget)
    lowest = min(candidates, key=lambda c: (c.peak, c.cost))
    return Search(baseline, best, lowest, _pareto(candidates))
