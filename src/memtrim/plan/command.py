"""``memtrim fit``: record a program, find the cheapest plan for a budget, re-run it with the plan, check it.

The command line hands :func:`fit_program` a callable that runs the user's program once from its start
(recorded as ``memtrim run`` records it, ``--region`` included) and returns the analysis of what it
recorded. Everything else is here:

1. seeded, recorded, and watched (:class:`~memtrim.plan.numerics.StepCapture`): the unplanned run;
2. the search (:func:`~memtrim.plan.fit.fit_analysis`); no plan: the floor paragraph, exit status 3;
3. the plan printed: each lever, its target, what it keeps, the predicted peak after it, its cost; the
   Pareto front; the code that does the same without memtrim;
4. seeded again, recorded and watched inside :func:`~memtrim.plan.apply.applied`: the measured peak
   next to the prediction and the budget, and the numeric check against run 1; where it differs, a
   third run without the plan tells a plan that changes training from a program that is not
   deterministic.

Exit status: 0 when the measured peak is within the budget and the numeric check did not fail; 3 when
no plan fits or the measured peak is over the budget; 1 when the plan changed the numbers.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TextIO

from memtrim.doctor.diagnosis import Keeps
from memtrim.plan.apply import applied
from memtrim.plan.file import Numerics, Plan
from memtrim.plan.fit import fit_analysis
from memtrim.plan.numerics import StepCapture, compare, identical, reference_check, seed_everything
from memtrim.plan.search import Search
from memtrim.units import format_bytes

if TYPE_CHECKING:
    from memtrim.analysis.analysis import Analysis
    from memtrim.plan.levers import Option

NO_PLAN = 3
"""Exit status when no plan fits the budget, or the plan's measured peak is over it."""
CHANGED_NUMBERS = 1
"""Exit status when the plan fits but the numeric check failed."""

RunProgram = Callable[[], "Analysis | None"]
"""Runs the program once from its start and returns what was recorded (None: it failed, and said so)."""


def format_cost(cost: float) -> str:
    return "free" if cost == 0 else f"{cost:.3g} FLOP"


def _table(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]


def _levers_in_short(options: Sequence[Option]) -> str:
    """A front row's levers: each by its target, a lever used more than three times by its count and
    first and last targets (28 checkpointed blocks make one short cell, not a line per block)."""
    if not options:
        return "(none)"
    by_lever: dict[str, list[str]] = {}
    for o in options:
        by_lever.setdefault(o.lever, []).append(o.target)
    cells = []
    for lever, targets in by_lever.items():
        if len(targets) > 3:
            cells.append(f"{lever} x{len(targets)} ({targets[0]} ... {targets[-1]})")
        else:
            cells += [f"{lever} {target}" for target in targets]
    return ", ".join(cells)


def render_plan(plan: Plan, found: Search, held_before: int = 0) -> str:
    """The plan as text: the levers in order, the Pareto front, the code without memtrim.
    ``held_before``: bytes the recording saw alive at its start, which its peaks do not count."""
    lines = [
        f"memtrim fit: budget {format_bytes(plan.budget)}; unplanned peak {format_bytes(plan.baseline_peak)}",
    ]
    if held_before:
        lines.append(
            "(peaks and budget count what the recorded code allocates: "
            f"{format_bytes(held_before)} of tensors it used were alive before it started — parameters, "
            "optimizer state — and come on top)"
        )
    lines += [
        "",
        f"plan: {len(plan.levers)} lever(s), predicted peak {format_bytes(plan.predicted_peak)}",
    ]
    if plan.levers:
        rows = [("lever", "target", "keeps", "peak after", "cost")]
        rows += [
            (lv.lever, lv.target, lv.keeps, format_bytes(lv.predicted_peak_after), format_cost(lv.cost))
            for lv in plan.levers
        ]
        lines += _table(rows)
    else:
        lines.append("  nothing to change: the unplanned peak is within the budget")
    lines += ["", "Pareto front (lowest peak for each cost and number of levers):"]
    front = [("peak", "cost", "levers")]
    front += [
        (
            format_bytes(c.peak),
            format_cost(c.cost),
            _levers_in_short(c.options),
        )
        for c in found.front
    ]
    lines += _table(front)
    if plan.levers:
        lines += ["", "the same without memtrim.applied (paste into the program):"]
        lines += ["  " + line for line in plan.code().splitlines()]
    return "\n".join(lines)


def render_result(plan: Plan) -> str:
    measured = plan.measured_peak
    assert measured is not None
    verdict = "within" if measured <= plan.budget else "OVER"
    off = (measured - plan.predicted_peak) / plan.predicted_peak * 100 if plan.predicted_peak else 0.0
    numerics = plan.numerics
    shown = ", ".join(f"{k} {v:.3g}" for k, v in numerics.max_differences.items())
    return "\n".join(
        [
            f"re-run with the plan: measured peak {format_bytes(measured)} ({measured:,} bytes), "
            f"predicted {format_bytes(plan.predicted_peak)} ({off:+.1f}%), "
            f"budget {format_bytes(plan.budget)}: {verdict} budget",
            f"numeric check: {numerics.verdict} — {numerics.note}"
            + (f"; largest differences: {shown}" if shown and numerics.verdict == "fail" else ""),
        ]
    )


FAKE_NOTE = (
    "measured on fake tensors, which hold no values: give a small config of the same model to check the "
    "numbers on (memtrim fit --fake --check-args ARGS, or memtrim.fit(step, budget, fake=True, check=small))"
)


def _watched(
    run: RunProgram, plan: Plan | None, *, fake: bool = False
) -> tuple[Analysis | None, StepCapture]:
    seed_everything()
    with StepCapture(values=not fake) as capture:  # fake tensors hold no values to copy
        if plan is None:
            analysis = run()
        else:
            with applied(plan):
                analysis = run()
    if plan is not None:
        capture.release()
    return analysis, capture


_UNSEEDED = (
    "two runs without the plan, seeded alike, computed different numbers, so a run with it cannot be "
    "compared (seed it, or fix its data order)"
)


def small_config_check(plan: Plan, check: RunProgram, label: str) -> Numerics:
    """The numeric check of a plan fitted on fake tensors, run on real ones: ``check`` runs a small
    config of the same model (``label`` says which) without the plan and with it, compared as
    :func:`fit_program` compares the program itself; the note says where it ran and what the plan did to
    that run's peak (a lever whose target the small config lacks, a block past its last layer, is not
    applied there, and its numbers are not checked)."""
    exact = all(lever.keeps == "exact" for lever in plan.levers)
    unplanned_analysis, unplanned = _watched(check, None)
    if unplanned_analysis is None:
        return Numerics("not-run", note=f"the small config ({label}) did not run to the end")
    checked = None if exact else reference_check(plan, unplanned)
    planned_analysis, planned = _watched(check, plan)
    if planned_analysis is None:
        return Numerics("fail", note=f"the small config ({label}) did not run to the end with the plan")
    where = "that run"
    numerics = checked or compare(plan, unplanned.captured, planned.captured, where=where)
    before, after = unplanned_analysis.peak.bytes, planned_analysis.peak.bytes
    unplanned.release()
    if exact and numerics.verdict == "fail":
        _, again = _watched(check, None)
        again.release()
        if not identical(unplanned.captured, again.captured):
            text = f"the small config ({label}) is not deterministic: {_UNSEEDED}"
            return Numerics("not-run", numerics.max_differences, text)
    peaks = f"its peak {format_bytes(before)} without the plan, {format_bytes(after)} with it"
    note = (
        f"on real tensors of the small config ({label}), not the full-size program ({peaks}); {numerics.note}"
    )
    return Numerics(numerics.verdict, numerics.max_differences, note)


def fit_program(
    run: RunProgram,
    budget: int,
    *,
    allow: frozenset[Keeps] = frozenset({"exact", "reference"}),
    output: str | None = None,
    out: TextIO | None = None,
    fake: bool = False,
    check: RunProgram | None = None,
    check_label: str = "",
) -> int:
    """Fit the program ``run`` runs into ``budget`` bytes; print the plan and its check; the exit status.
    ``fake``: ``run`` records under FakeTensorMode; the plan is re-measured so, and the numeric check
    runs on ``check`` (a small config of the same program, ``check_label`` says which:
    :func:`small_config_check`) or, without one, not at all (fake tensors hold no values)."""
    stream = out or sys.stdout
    analysis, unplanned = _watched(run, None, fake=fake)
    if analysis is None:
        return 1
    fitted = fit_analysis(analysis, budget, allow)
    if fitted.plan is None:
        print(fitted.floor_text, file=stream)
        return NO_PLAN
    plan = fitted.plan
    held = analysis.known_at_start.get(analysis.peak.device or "", 0)
    print(render_plan(plan, fitted.search, held), file=stream, flush=True)
    exact = all(lever.keeps == "exact" for lever in plan.levers)
    checked = None if exact or fake else reference_check(plan, unplanned)
    unplanned.release()  # the first run's models go before the second run starts
    measured, planned = _watched(run, plan, fake=fake)
    if measured is None:
        return 1
    plan.measured_peak = measured.peak.bytes
    if fake:
        numerics = (
            Numerics("not-run", {}, FAKE_NOTE)
            if check is None
            else small_config_check(plan, check, check_label)
        )
    else:
        numerics = checked or compare(plan, unplanned.captured, planned.captured, where="the program")
    if exact and numerics.verdict == "fail" and not fake:
        _, again = _watched(run, None)
        if not identical(unplanned.captured, again.captured):
            numerics = Numerics(
                "not-run",
                numerics.max_differences,
                f"the program is not deterministic: {_UNSEEDED}",
            )
    plan.numerics = numerics
    print("", render_result(plan), sep="\n", file=stream)
    if output is not None:
        plan.save(output)
        print(f"plan written to {output} (memtrim run --plan {output} SCRIPT)", file=stream)
    if plan.measured_peak > budget:
        return NO_PLAN
    return CHANGED_NUMBERS if numerics.verdict == "fail" else 0
