"""A set of per-rank traces (one per process of a torchrun job) as one report: a table with each
rank's peak, the phase it was reached in and its bytes by role at that moment; the worst rank's full
report; and the roles whose bytes differ between ranks at their peaks."""

from __future__ import annotations

from collections.abc import Sequence

from memtrim.analysis import Analysis, Breakdown
from memtrim.report import terminal
from memtrim.report.escape import safe
from memtrim.trace.ranks import recorded_rank
from memtrim.units import format_bytes


def rank_of(analysis: Analysis, fallback: int) -> int:
    """The rank recorded in the trace (``fallback``, its place in the list, when none was)."""
    found = recorded_rank(analysis.log.metadata)
    return found.rank if found is not None else fallback


def _roles_at_peak(breakdown: Breakdown) -> dict[str, int]:
    found: dict[str, int] = {}
    for part in (breakdown.made, breakdown.preexisting):
        for role, n in part.items():
            found[str(role)] = found.get(str(role), 0) + n
    return {role: n for role, n in found.items() if n}


def render(analyses: Sequence[Analysis], top: int = 5) -> str:
    """The per-rank table, what differs between ranks, then the worst rank's report."""
    ranked = sorted(((rank_of(a, i), a) for i, a in enumerate(analyses)), key=lambda pair: pair[0])
    roles = [_roles_at_peak(a.breakdown_at_peak) for _, a in ranked]
    names = sorted(
        {role for found in roles for role in found}, key=lambda r: -max(f.get(r, 0) for f in roles)
    )
    peaks = [format_bytes(a.peak.bytes) for _, a in ranked]
    phases = [str(a.peak.phase) if a.peak.phase else "-" for _, a in ranked]
    lines = [
        f"{len(ranked)} ranks; bytes by role alive at each rank's peak (made in the region or before it)"
    ]
    # few ranks: one column per rank, one row per role (every role fits); many: one row per rank, and
    # as many of the largest roles as fit in the report's width
    columns = [["", "peak", "phase", *names]]
    columns += [
        [f"rank {rank}", peak, phase, *(format_bytes(found.get(role, 0)) for role in names)]
        for (rank, _), peak, phase, found in zip(ranked, peaks, phases, roles, strict=True)
    ]
    widths = [max(len(cell) for cell in column) for column in columns]
    if 2 + sum(widths) + 2 * (len(widths) - 1) <= terminal.WIDTH:
        for i in range(len(columns[0])):
            cells = [columns[0][i].ljust(widths[0])]
            cells += [column[i].rjust(w) for column, w in zip(columns[1:], widths[1:], strict=True)]
            lines.append("  " + "  ".join(cells).rstrip())
    else:
        table = [["rank", "peak", "phase"]] + [
            [str(rank), peak, phase] for (rank, _), peak, phase in zip(ranked, peaks, phases, strict=True)
        ]
        for role in names:
            column = [role] + [format_bytes(found.get(role, 0)) for found in roles]
            trial = [[*row, cell] for row, cell in zip(table, column, strict=True)]
            trial_widths = [max(len(row[i]) for row in trial) for i in range(len(trial[0]))]
            if 2 + sum(trial_widths) + 2 * (len(trial_widths) - 1) > terminal.WIDTH:
                break
            table = trial
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
        lines += [
            "  " + "  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in table
        ]
        if len(table[0]) - 3 < len(names):
            lines.append(
                f"  (the {len(table[0]) - 3} largest of {len(names)} roles; memtrim show --json has all)"
            )
    worst = max(range(len(ranked)), key=lambda i: ranked[i][1].peak.bytes)
    lines.append("")
    differing = [r for r in names if len({found.get(r, 0) for found in roles}) > 1]
    if len({a.peak.bytes for _, a in ranked}) == 1 and not differing:
        lines.append("Every rank peaks at the same bytes, with the same bytes by role.")
    else:
        lines.append("What differs between ranks at their peaks:")
        spread = [(r, [found.get(r, 0) for found in roles]) for r in differing]
        for role, values in sorted(spread, key=lambda rv: -(max(rv[1]) - min(rv[1])))[:top]:
            lo, hi = min(values), max(values)
            lines.append(
                f"  {safe(role)}: {format_bytes(lo)} to {format_bytes(hi)} "
                f"(most on rank {ranked[values.index(hi)][0]})"
            )
        if not differing:
            lines.append("  the same bytes by role; the peaks differ in what else was alive")
    lines += ["", f"Rank {ranked[worst][0]} peaks highest; its report:", ""]
    lines.append(terminal.render(ranked[worst][1], top=top))
    return "\n".join(lines)
