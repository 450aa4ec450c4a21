"""Two torchrun jobs compared rank by rank: one set of per-rank traces before a change, one after.

Ranks are paired by the rank each trace recorded (``log.metadata["distributed"]["rank"]``), never by
the order the traces were given in. Each pair gets the one-trace :func:`~memtrim.analysis.diff.diff`;
the job's peak is its highest rank's peak (the rank that runs out of memory first). A set that cannot
be paired raises :class:`RankSetError`, whose message names the fix.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from memtrim.analysis.analysis import Analysis
from memtrim.analysis.diff import TraceDiff, diff
from memtrim.analysis.roles import Role
from memtrim.trace.ranks import RecordedRank, recorded_rank

SIDES = ("before", "after")


class RankSetError(ValueError):
    """Two sets of traces that cannot be paired rank by rank; the message says what to give instead."""


@dataclass(frozen=True)
class RankChange:
    """One rank in both jobs."""

    rank: int
    diff: TraceDiff

    @property
    def peak(self) -> tuple[int, int]:
        return self.diff.peak

    @property
    def roles_changed(self) -> dict[Role, tuple[int, int]]:
        """Bytes by role alive at this rank's peak, where before and after differ."""
        return {role: v for role, v in self.diff.by_role.items() if v[0] != v[1]}


@dataclass(frozen=True)
class RankSetDiff:
    """The ranks of the ``before`` job against the same ranks of the ``after`` job."""

    ranks: tuple[RankChange, ...]
    """In rank order."""
    world_size: int
    """As the traces recorded it (more than ``len(ranks)`` when only some ranks were given)."""
    peak: tuple[int, int]
    """The job's peak before and after: its highest rank's."""
    highest: tuple[int, int]
    """The rank with the highest peak before, and after (:func:`highest_rank`)."""

    @property
    def focus(self) -> RankChange:
        """The rank whose one-trace diff is shown in full: the highest rank after the change, because
        its peak is the job's peak, the one that decides whether the job fits on its devices. (The rank
        whose peak moved most can sit far below the job's peak, where a change costs nothing.)"""
        return next(r for r in self.ranks if r.rank == self.highest[1])

    def at_job_peak(self, side: int) -> list[int]:
        """Every rank whose peak on ``side`` (0 before, 1 after) is the job's peak (ties included)."""
        return [r.rank for r in self.ranks if r.peak[side] == self.peak[side]]

    @property
    def empty(self) -> bool:
        """True when no rank differs."""
        return all(r.diff.empty for r in self.ranks)

    @property
    def partial(self) -> bool:
        """True when fewer ranks were given than the jobs had."""
        return len(self.ranks) < self.world_size


def rank_and_world(analysis: Analysis) -> RecordedRank | None:
    """(rank, world size, run id) as the trace recorded them; None for a trace of one process."""
    return recorded_rank(analysis.log.metadata)


def _ranks(text: Sequence[int]) -> str:
    return ", ".join(str(r) for r in text)


def _side(analyses: Sequence[Analysis], names: Sequence[str], side: str) -> tuple[dict[int, Analysis], int]:
    """One job's traces by rank, and its world size; every trace must be a distinct rank of one job."""
    by_rank: dict[int, Analysis] = {}
    named: dict[int, str] = {}
    sizes: dict[int, str] = {}
    runs: dict[str, str] = {}
    for analysis, name in zip(analyses, names, strict=True):
        found = rank_and_world(analysis)
        if found is None:
            raise RankSetError(
                f"{name} records no rank: it is the trace of one process, not of one rank of a torchrun "
                "job; give the rank traces (trace.rank0.json, trace.rank1.json, ...) on both sides"
            )
        rank, size, run = found
        if rank in by_rank:
            raise RankSetError(
                f"{named[rank]} and {name} are both rank {rank} of the {side} job; "
                "give each rank's trace once"
            )
        by_rank[rank], named[rank] = analysis, name
        if size is not None:
            sizes.setdefault(size, name)
        if run is not None:
            runs.setdefault(run, name)
    if len(runs) > 1:
        (run_a, a), (run_b, b) = list(runs.items())[:2]
        raise RankSetError(
            f"{a} and {b} come from different runs ({run_a!r}, {run_b!r}); give the traces of one job "
            f"on the {side} side"
        )
    if len(sizes) > 1:
        (size_a, a), (size_b, b) = list(sizes.items())[:2]
        raise RankSetError(
            f"{a} is from a {size_a}-rank job and {b} from a {size_b}-rank job; give the traces of one "
            f"job on the {side} side"
        )
    world_size = next(iter(sizes), max(by_rank) + 1)
    outside = [r for r in by_rank if r >= world_size]
    if outside:
        raise RankSetError(
            f"{named[outside[0]]} is rank {outside[0]} of a {world_size}-rank job, which has no such "
            "rank; the trace file may be damaged or renamed"
        )
    return by_rank, world_size


def _check_not_mixed(sets: Sequence[Sequence[Analysis]], names: Sequence[Sequence[str]]) -> None:
    """A single trace on one side and rank traces on the other: say how to compare them."""
    ranked = [any(rank_and_world(a) is not None for a in s) for s in sets]
    for i in (0, 1):
        if ranked[1 - i] and not ranked[i]:
            raise RankSetError(
                f"the {SIDES[i]} side ({', '.join(names[i])}) has no rank traces while the {SIDES[1 - i]} "
                "side has the ranks of a torchrun job; give every rank of both jobs, or compare one rank "
                f"with the single trace: memtrim diff {names[0][0]} {names[1][0]}"
            )


def highest_rank(ranks: Sequence[RankChange], side: int) -> RankChange:
    """The rank with the highest peak on ``side`` (0 before, 1 after); on a tie, the one whose peak
    changed most, then the lowest rank."""
    return min(ranks, key=lambda r: (-r.peak[side], -abs(r.peak[1] - r.peak[0]), r.rank))


def diff_rank_sets(
    before: Sequence[Analysis],
    after: Sequence[Analysis],
    names: tuple[Sequence[str], Sequence[str]] | None = None,
) -> RankSetDiff:
    """Pair the two jobs' traces by recorded rank and compare each pair. ``names`` (file names, in the
    order of the traces) are what error messages call the traces."""
    given = names or tuple(
        [f"{side} trace {i + 1}" for i in range(len(s))]
        for side, s in zip(SIDES, (before, after), strict=True)
    )
    if not before or not after:
        raise RankSetError("give at least one trace on each side (the ranks of the job before, and after)")
    _check_not_mixed((before, after), given)
    b, size_b = _side(before, given[0], "before")
    a, size_a = _side(after, given[1], "after")
    if size_b != size_a:
        raise RankSetError(
            f"the before job has {size_b} ranks and the after job {size_a}: ranks are paired by number, so "
            "both jobs need the same world size; to compare one rank of each, diff the two files alone "
            "(memtrim diff BEFORE.rank0.json AFTER.rank0.json)"
        )
    for here, there, side, other in ((b, a, 0, 1), (a, b, 1, 0)):
        missing = sorted(set(here) - set(there))
        if missing:
            which = "rank" if len(missing) == 1 else "ranks"
            # the file to add, named as the other job's files are (trace.rank1.json where unknown)
            like = re.sub(r"\.rank\d+(?=\.[^.]*$|$)", f".rank{missing[0]}", given[other][0])
            file = like if like != given[other][0] else f"trace.rank{missing[0]}.json"
            raise RankSetError(
                f"{which} {_ranks(missing)} given for the {SIDES[side]} job but not for the {SIDES[other]} "
                f"job; give the same ranks of both (the {SIDES[other]} job's {file})"
            )
    ranks = tuple(RankChange(r, diff(b[r], a[r])) for r in sorted(b))
    highest = (highest_rank(ranks, 0), highest_rank(ranks, 1))
    peak = (highest[0].peak[0], highest[1].peak[1])
    return RankSetDiff(ranks, size_b, peak, (highest[0].rank, highest[1].rank))
