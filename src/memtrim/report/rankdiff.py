"""A :class:`~memtrim.analysis.rankdiff.RankSetDiff` for people: terminal text (100 columns), Markdown
for a pull request, JSON. Each shows the peak per rank, the job's peak (its highest rank's), what
changed by role at each rank's peak, then the one-trace diff of the rank that sets the job's peak."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from memtrim.analysis.rankdiff import RankChange, RankSetDiff
from memtrim.analysis.roles import Role
from memtrim.report import diff as one
from memtrim.report.escape import safe
from memtrim.units import format_bytes, format_change, format_delta

MAX_RANK_ROWS = 16
"""More ranks than this: the per-rank table lists the highest ranks and those whose peak moved most."""


def rank_list(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> 'ranks 0-2, 5, 7, 8'; [3] -> 'rank 3'."""
    spans: list[list[int]] = []
    for r in sorted(ranks):
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}, {b}" if b == a + 1 else f"{a}-{b}" for a, b in spans)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def _groups(d: RankSetDiff) -> list[tuple[list[int], dict[Role, tuple[int, int]]]]:
    """Ranks whose roles changed the same way, grouped, in order of their first rank."""
    groups: dict[tuple[tuple[Role, int, int], ...], list[int]] = {}
    changed: dict[tuple[tuple[Role, int, int], ...], dict[Role, tuple[int, int]]] = {}
    for r in d.ranks:
        roles = r.roles_changed
        if roles:
            key = tuple((role, b, a) for role, (b, a) in roles.items())
            groups.setdefault(key, []).append(r.rank)
            changed[key] = roles
    return [(ranks, changed[key]) for key, ranks in groups.items()]


def _shown(d: RankSetDiff) -> list[RankChange]:
    """The ranks the table lists: all of them, or past MAX_RANK_ROWS the highest before and after and
    then those whose peak moved most."""
    if len(d.ranks) <= MAX_RANK_ROWS:
        return list(d.ranks)
    keep = set(d.highest)
    for r in sorted(d.ranks, key=lambda r: (-abs(r.peak[1] - r.peak[0]), r.rank)):
        if len(keep) >= MAX_RANK_ROWS:
            break
        keep.add(r.rank)
    return [r for r in d.ranks if r.rank in keep]


def _mark(d: RankSetDiff, rank: int) -> str:
    sides = [side for i, side in enumerate(("before", "after")) if rank in d.at_job_peak(i)]
    return "highest " + " and ".join(sides) if sides else ""


def _highest(d: RankSetDiff, side: int) -> str:
    tied = d.at_job_peak(side)
    return rank_list(tied) + (" (tied)" if len(tied) > 1 else "")


def _given(d: RankSetDiff) -> str:
    return f"{len(d.ranks)} of {d.world_size} ranks" if d.partial else f"{len(d.ranks)} ranks"


def _focus_title(d: RankSetDiff) -> str:
    r = d.focus
    tied = len(d.at_job_peak(1)) > 1
    return (
        f"Rank {r.rank} {'shares' if tied else 'sets'} the job's peak after the change "
        f"({format_bytes(r.peak[1])}; {format_bytes(r.peak[0])} before); its diff:"
    )


def render_text(d: RankSetDiff, *, top: int = 10) -> str:
    """The comparison for a terminal."""
    if d.empty:
        return (
            f"memtrim diff: {_given(d)}; no differences on any rank (the job's peak "
            f"{format_bytes(d.peak[0])} in both)"
        )
    out = [
        f"memtrim diff: {_given(d)}; the job's peak (its highest rank's) {format_change(*d.peak)}",
        f"  highest: {_highest(d, 0)} before, {_highest(d, 1)} after",
        "",
        "Peak per rank:",
    ]
    shown = _shown(d)
    rows = [["rank", "before", "after", "change", ""]] + [
        [
            str(r.rank),
            format_bytes(r.peak[0]),
            format_bytes(r.peak[1]),
            format_delta(*r.peak),
            _mark(d, r.rank),
        ]
        for r in shown
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        out.append(
            ("  " + "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[4]).rstrip()
        )
    if len(shown) < len(d.ranks):
        out.append(f"  ({len(d.ranks) - len(shown)} more ranks; --json has all)")
    out += ["", "What changed at each rank's peak, by role:"]
    groups = _groups(d)
    if not groups:
        out.append("  no role's bytes at the peak changed on any rank")
    label = max((len(rank_list(ranks)) for ranks, _ in groups[:top]), default=0)
    name = max((len(role.value) for _, roles in groups[:top] for role in roles), default=0)
    for ranks, roles in groups[:top]:
        first = rank_list(ranks).ljust(label)
        for role, (b, a) in roles.items():
            out.append(f"  {first}  {safe(role.value).ljust(name)}  {format_change(b, a)}")
            first = " " * label
    if len(groups) > top:
        out.append(f"  ({len(groups) - top} more groups of ranks; --top to see them)")
    out += ["", _focus_title(d), "", one.render_text(d.focus.diff, top=top)]
    return "\n".join(out)


def render_markdown(d: RankSetDiff, *, top: int = 10) -> str:
    """The comparison as Markdown for a pull request."""
    if d.empty:
        return (
            f"**memtrim** ({_given(d)}): no memory differences on any rank "
            f"(the job's peak {format_bytes(d.peak[0])})."
        )
    out = [
        f"**memtrim** ({_given(d)}): the job's peak (its highest rank's) {format_bytes(d.peak[0])} → "
        f"{format_bytes(d.peak[1])} "
        f"({format_delta(*d.peak)})",
        "",
    ]
    out += ["| rank | peak before | peak after | change |", "|---:|---:|---:|---:|"]
    for r in _shown(d):
        out.append(
            f"| {r.rank} | {format_bytes(r.peak[0])} | {format_bytes(r.peak[1])} | {format_delta(*r.peak)} |"
        )
    out.append(
        f"| **job** (highest rank) | {format_bytes(d.peak[0])} ({_highest(d, 0)}) | "
        f"{format_bytes(d.peak[1])} ({_highest(d, 1)}) | {format_delta(*d.peak)} |"
    )
    groups = _groups(d)
    if groups:
        out += ["", "| ranks | role at the peak | before | after | change |", "|---|---|---:|---:|---:|"]
        for ranks, roles in groups[:top]:
            for role, (b, a) in roles.items():
                out.append(
                    f"| {rank_list(ranks).split(' ', 1)[1]} | {role.value} | {format_bytes(b)} | "
                    f"{format_bytes(a)} | {format_delta(b, a)} |"
                )
    out += ["", f"**{_focus_title(d)}**", "", one.render_markdown(d.focus.diff, top=top)]
    return "\n".join(out)


def _rank_json(r: RankChange) -> dict[str, Any]:
    return {
        "rank": r.rank,
        "peak": {"before": r.peak[0], "after": r.peak[1]},
        "by_role_at_peak": {role.value: {"before": b, "after": a} for role, (b, a) in r.diff.by_role.items()},
    }


def to_dict(d: RankSetDiff) -> dict[str, Any]:
    return {
        "empty": d.empty,
        "world_size": d.world_size,
        "peak": {"before": d.peak[0], "after": d.peak[1]},
        "highest_rank": {"before": d.highest[0], "after": d.highest[1]},
        "ranks": [_rank_json(r) for r in d.ranks],
        "focus": {
            "rank": d.focus.rank,
            "why": "its peak after the change is the job's peak",
            "diff": one.to_dict(d.focus.diff),
        },
    }
