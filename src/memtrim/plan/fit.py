"""From a recorded analysis and a budget to a :class:`~memtrim.plan.file.Plan` (or the reason none fits)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from memtrim.doctor.diagnosis import Keeps
from memtrim.plan.file import Plan, PlannedLever
from memtrim.plan.levers import Option, merged
from memtrim.plan.search import Search, options_of, search
from memtrim.units import format_bytes

if TYPE_CHECKING:
    from memtrim.analysis.analysis import Analysis


class NoPlanFits(Exception):
    """No combination of the allowed levers brings the predicted peak to the budget."""


@dataclass(frozen=True)
class Fitted:
    plan: Plan | None
    search: Search
    floor_text: str


def _planned(analysis: Analysis, options: tuple[Option, ...]) -> list[PlannedLever]:
    levers = []
    for n, o in enumerate(options, 1):
        after = analysis.peak_with(merged(p.edits for p in options[:n]))
        levers.append(PlannedLever(o.lever, o.target, dict(o.params), o.keeps, after, o.cost))
    return levers


def _floor(analysis: Analysis, found: Search, budget: int) -> str:
    """One paragraph: what stays at the lowest reachable peak, by role, and what the budget misses by."""
    lowest = found.lowest
    roles: dict[str, int] = {}
    for ident in analysis.alive_ids_at_peak:
        a = analysis.allocations[ident]
        if a.preexisting:
            continue  # the headline peak counts what the step made; so does the budget it is compared to
        role = analysis.role(a).value
        roles[role] = roles.get(role, 0) + a.bytes
    held = ", ".join(f"{role} {format_bytes(b)}" for role, b in sorted(roles.items(), key=lambda kv: -kv[1]))
    return (
        f"no plan fits {format_bytes(budget)}: the unplanned peak is {format_bytes(found.baseline)} and the "
        f"lowest the allowed levers reach is {format_bytes(lowest.peak)}"
        + (f" (with {len(lowest.options)} lever(s))" if lowest.options else " (no lever lowers it)")
        + (f"; at the unplanned peak memory holds {held}" if held else "")
        + f"; {format_bytes(lowest.peak)} or more would fit."
        + _beyond_levers(roles, budget)
    )


def _beyond_levers(roles: dict[str, int], budget: int) -> str:
    """Where parameters and optimizer state alone exceed the budget, what could: no recomputation,
    loss or optimizer-step lever removes them."""
    kept = roles.get("parameter", 0) + roles.get("optimizer_state", 0)
    if kept <= budget:
        return ""
    return (
        f" Parameters and optimizer state alone are {format_bytes(kept)}, over the budget whatever is "
        "recomputed: shard them over several ranks (FSDP2; predict a rank's peak with "
        "memtrim.fake_world(N)), "
        "or keep a smaller optimizer state (torch.optim.Adafactor, which changes training; see the doctor's "
        "optimizer-state finding)."
    )


def _if_allowed(analysis: Analysis, budget: int, allow: frozenset[Keeps]) -> str:
    """Where levers that change training, not allowed, would fit: which, and what they change."""
    if "changes-training" in allow:
        return ""
    wider = search(analysis, budget, options_of(analysis, frozenset({*allow, "changes-training"})))
    if wider.best is None:
        return ""
    changing = sorted({o.lever for o in wider.best.options if o.keeps == "changes-training"})
    levers = ", ".join(f"{o.lever} {o.target}" for o in wider.best.options)
    return (
        f" With --allow changes-training a plan fits: {levers}, predicted {format_bytes(wider.best.peak)}"
        f" ({', '.join(changing)} {'changes' if len(changing) == 1 else 'change'} training: see "
        "docs/fit.md#levers)."
    )


def fit_analysis(
    analysis: Analysis, budget: int, allow: frozenset[Keeps] = frozenset({"exact", "reference"})
) -> Fitted:
    found = search(analysis, budget, options_of(analysis, frozenset(allow)))
    if found.best is None:
        return Fitted(None, found, _floor(analysis, found, budget) + _if_allowed(analysis, budget, allow))
    levers = _planned(analysis, found.best.options)
    plan = Plan(budget=budget, baseline_peak=found.baseline, predicted_peak=found.best.peak, levers=levers)
    return Fitted(plan, found, "")
