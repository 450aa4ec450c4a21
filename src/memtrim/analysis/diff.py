"""Two traces compared: the peak, per-phase peaks, bytes by role at the peak, and per source line the
bytes alive at the peak (by op) and the largest temporary — lines matched across the two traces.

A line that moved between two versions of a file is matched by its function and its code text (the
text each trace recorded when it was made, ``log.metadata["source_lines"]``), not only by its number.
Passes, each over what is still unmatched: the same line with the same text; the same file, function
and text (moved); the same file, function and number (edited in place); the same function and text
in another file (renamed). What is left appears on one side only.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Literal

from memtrim.analysis.analysis import Analysis
from memtrim.analysis.roles import Role
from memtrim.trace.model import Allocation, Phase, Site

SOURCE_LINES = "source_lines"
Match = Literal["same line", "moved", "edited", "renamed", "before only", "after only"]


@dataclass(frozen=True)
class LineFigures:
    """What one line made in one trace."""

    site: Site | None
    code: str | None
    at_peak: int
    """Bytes it made that were alive at the peak."""
    ops_at_peak: Mapping[str, int]
    largest_temporary: Allocation | None


@dataclass(frozen=True)
class LineChange:
    """One line in both traces (or in one of them), and how the two were matched."""

    before: LineFigures | None
    after: LineFigures | None
    matched: Match

    @property
    def at_peak(self) -> tuple[int, int]:
        return (self.before.at_peak if self.before else 0, self.after.at_peak if self.after else 0)

    @property
    def largest_temporary(self) -> tuple[int, int]:
        def size(f: LineFigures | None) -> int:
            return f.largest_temporary.bytes if f and f.largest_temporary else 0

        return (size(self.before), size(self.after))

    @property
    def change(self) -> int:
        """The larger of the two changes (bytes at the peak, largest temporary), by size."""
        (pb, pa), (tb, ta) = self.at_peak, self.largest_temporary
        return max(abs(pa - pb), abs(ta - tb))

    @property
    def site(self) -> Site | None:
        figures = self.after or self.before
        return figures.site if figures else None

    @property
    def code(self) -> str | None:
        figures = self.after or self.before
        return figures.code if figures else None


@dataclass(frozen=True)
class TraceDiff:
    """``before`` against ``after``; only what changed is listed."""

    before: Analysis
    after: Analysis
    peak: tuple[int, int]
    by_phase: Mapping[Phase, tuple[int, int]]
    by_role: Mapping[Role, tuple[int, int]]
    """Bytes by role alive at each trace's peak (made in the region and from before it)."""
    lines: tuple[LineChange, ...]
    """Lines whose figures changed, largest change first."""

    @property
    def empty(self) -> bool:
        """True when nothing differs: peaks, phases, roles and every line."""
        same = self.peak[0] == self.peak[1]
        same = same and all(b == a for b, a in self.by_phase.values())
        same = same and all(b == a for b, a in self.by_role.values())
        return same and not self.lines


def _code(analysis: Analysis, site: Site | None) -> str | None:
    if site is None:
        return None
    table = analysis.log.metadata.get(SOURCE_LINES)
    if not isinstance(table, dict):
        return None
    lines = table.get(site.file)
    text = lines.get(str(site.line)) if isinstance(lines, dict) else None
    return text if isinstance(text, str) else None


def line_figures(analysis: Analysis) -> list[LineFigures]:
    """Per line that made bytes alive at the peak or a temporary: its figures."""
    at_peak: dict[Site | None, tuple[int, dict[str, int]]] = {
        g.site: (g.bytes, dict(g.ops)) for g in analysis.lines_at_peak
    }
    temps: dict[Site | None, Allocation] = {}
    for t in analysis.temporaries:  # largest first
        temps.setdefault(t.site, t)
    sites = list(dict.fromkeys([*at_peak, *temps]))
    return [
        LineFigures(
            site,
            _code(analysis, site),
            at_peak.get(site, (0, {}))[0],
            at_peak.get(site, (0, {}))[1],
            temps.get(site),
        )
        for site in sites
    ]


def _key_same(f: LineFigures) -> Hashable:
    return (f.site, f.code)


def _key_moved(f: LineFigures) -> Hashable | None:
    return None if f.site is None or f.code is None else (f.site.file, f.site.function, f.code)


def _key_edited(f: LineFigures) -> Hashable | None:
    return None if f.site is None else (f.site.file, f.site.function, f.site.line)


def _key_renamed(f: LineFigures) -> Hashable | None:
    return None if f.site is None or f.code is None else (f.site.function, f.code)


_PASSES: tuple[tuple[Match, Callable[[LineFigures], Hashable | None]], ...] = (
    ("same line", _key_same),
    ("moved", _key_moved),
    ("edited", _key_edited),
    ("renamed", _key_renamed),
)


def match_lines(before: list[LineFigures], after: list[LineFigures]) -> list[LineChange]:
    """Every line of both sides, paired where a pass finds exactly one partner on each side."""
    left, right = list(before), list(after)
    pairs: list[LineChange] = []
    for how, key in _PASSES:
        by_key: dict[Hashable, list[LineFigures]] = {}
        for f in right:
            k = key(f)
            if k is not None:
                by_key.setdefault(k, []).append(f)
        counts: dict[Hashable, int] = {}
        for f in left:
            k = key(f)
            if k is not None:
                counts[k] = counts.get(k, 0) + 1
        unmatched = []
        for f in left:
            k = key(f)
            partners = by_key.get(k, []) if k is not None else []
            if k is not None and counts[k] == 1 and len(partners) == 1:
                pairs.append(LineChange(f, partners[0], how))
                right.remove(partners[0])
            else:
                unmatched.append(f)
        left = unmatched
    pairs += [LineChange(f, None, "before only") for f in left]
    pairs += [LineChange(None, f, "after only") for f in right]
    return pairs


def diff(before: Analysis, after: Analysis) -> TraceDiff:
    """What changed from ``before`` to ``after``."""
    phases = {p: (before.peak_by_phase.get(p, 0), after.peak_by_phase.get(p, 0)) for p in Phase}
    phases = {p: v for p, v in phases.items() if any(v)}
    b, a = before.breakdown_at_peak, after.breakdown_at_peak
    roles = {role: (b.total(role), a.total(role)) for role in Role}
    roles = {role: v for role, v in roles.items() if any(v)}
    changes = [c for c in match_lines(line_figures(before), line_figures(after)) if c.change]
    changes.sort(key=lambda c: -c.change)
    return TraceDiff(before, after, (before.peak.bytes, after.peak.bytes), phases, roles, tuple(changes))
