"""One :class:`Analysis` per trace: every derived figure, computed once.

``analyze(log)`` sweeps each device's allocation events once (:mod:`~memtrim.analysis.timeline`),
decides every allocation's category once (:mod:`~memtrim.analysis.categories`), and answers the rest
from those: peaks, per-phase peaks, the live set at the peak, temporaries; diagnoses are computed on
first use and kept. Reporters and the public ``Trace`` read from it; nothing here calls back into
the trace's objects for derived facts.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from memtrim.analysis.categories import Category, categorize
from memtrim.analysis.diagnoses import Diagnosis, diagnose
from memtrim.analysis.timeline import LiveCurve, Peak, alive_at, headline, peak_of, peaks_by_phase, sweep
from memtrim.analysis.whatif import Edits, replay
from memtrim.trace.model import Allocation, Phase, Site, TraceLog


@dataclass(frozen=True)
class LineGroup:
    """Bytes alive at one moment that one source line made."""

    site: Site | None
    bytes: int
    count: int
    categories: Mapping[Category, int]
    """Bytes per category, largest first."""
    ops: Mapping[str, int]
    """Bytes per op, largest first."""


def group_by_line(allocations: Iterable[Allocation], categories: tuple[Category, ...]) -> list[LineGroup]:
    """``allocations`` grouped by the line that made them, largest first."""
    members: dict[Site | None, list[Allocation]] = {}
    for a in allocations:
        members.setdefault(a.site, []).append(a)
    groups = []
    for site, allocs in members.items():
        by_category: dict[Category, int] = {}
        by_op: dict[str, int] = {}
        for a in allocs:
            by_category[categories[a.id]] = by_category.get(categories[a.id], 0) + a.bytes
            by_op[a.op] = by_op.get(a.op, 0) + a.bytes
        groups.append(
            LineGroup(
                site,
                sum(a.bytes for a in allocs),
                len(allocs),
                dict(sorted(by_category.items(), key=lambda kv: -kv[1])),
                dict(sorted(by_op.items(), key=lambda kv: -kv[1])),
            )
        )
    return sorted(groups, key=lambda g: g.bytes, reverse=True)


@dataclass(frozen=True)
class Analysis:
    """Everything memtrim derives from one finished trace log. Build it with :func:`analyze`."""

    log: TraceLog
    categories: tuple[Category, ...]
    """Indexed by allocation id."""
    curves: Mapping[str, LiveCurve]
    """Per device, the one sweep every figure below is read from."""
    peaks: Mapping[str, Peak]
    """Per device."""
    peak: Peak
    """The headline: the peak of the device whose peak is largest."""
    peak_by_phase: Mapping[Phase, int]
    """On the headline device: the highest live bytes while each phase ran."""
    live_at_peak: tuple[Allocation, ...]
    """Made inside the region and alive at the headline peak, on its device."""
    lines_at_peak: tuple[LineGroup, ...]
    temporaries: tuple[Allocation, ...]
    """Made and freed in the same phase, largest first."""
    _charged_peaks: dict[str, Peak] = field(default_factory=dict, repr=False, compare=False)

    @property
    def allocations(self) -> list[Allocation]:
        return self.log.allocations

    def category(self, allocation: Allocation) -> Category:
        return self.categories[allocation.id]

    def largest_temporaries(self, n: int = 10) -> list[Allocation]:
        return list(self.temporaries[: max(n, 0)])

    def curve(self, device: str | None = None) -> LiveCurve:
        """The live curve of ``device`` (default: the headline peak's)."""
        device = device or self.peak.device
        if device is None or device not in self.curves:
            return LiveCurve(device or "cpu")
        return self.curves[device]

    def alive_at(self, tick: int, device: str | None = None) -> list[Allocation]:
        """Allocations made inside the region and alive just after ``tick`` (on ``device``, or all)."""
        return alive_at(self.log.allocations, tick, device)

    def lines_alive_at(self, tick: int, device: str | None = None) -> list[LineGroup]:
        return group_by_line(self.alive_at(tick, device), self.categories)

    def peak_with(self, edits: Edits, device: str | None = None) -> int:
        """The peak on ``device`` (default: the headline's) had the recorded timeline been ``edits``."""
        return replay(self.curve(device), edits)

    def peak_without(self, removed: Iterable[Allocation], device: str | None = None) -> int:
        """The peak on ``device`` (default: the headline's) had ``removed`` never been allocated."""
        return replay(self.curve(device), Edits.removing(a.id for a in removed))

    def peak_as(self, allocator: str) -> Peak:
        """The headline peak if every block were charged by ``allocator``'s rule (``"cuda"``: 512-byte
        blocks): a GPU prediction from a trace recorded on the CPU or with fake tensors."""
        if allocator not in self._charged_peaks:
            allocations = self.log.allocations
            peaks = [
                peak_of(sweep(allocations, d, allocator), allocations, self.log.ops) for d in self.curves
            ]
            self._charged_peaks[allocator] = headline(peaks)
        return self._charged_peaks[allocator]

    @functools.cached_property
    def diagnoses(self) -> tuple[Diagnosis, ...]:
        """Every diagnosis rule's findings that would lower the peak, largest saving first."""
        return tuple(diagnose(self))


def analyze(log: TraceLog) -> Analysis:
    """Compute every derived figure of ``log`` once."""
    allocations = log.allocations
    categories = tuple(categorize(a) for a in allocations)
    devices = sorted({a.device for a in allocations})
    curves = {device: sweep(allocations, device) for device in devices}
    peaks = {device: peak_of(curve, allocations, log.ops) for device, curve in curves.items()}
    peak = headline(peaks.values())
    if peak.tick is not None and peak.device is not None:
        live = tuple(alive_at(allocations, peak.tick, peak.device))
        by_phase = peaks_by_phase(curves[peak.device])
    else:
        live, by_phase = (), dict.fromkeys(Phase, 0)
    temporaries = sorted(
        (a for a in allocations if categories[a.id] is Category.TEMPORARY),
        key=lambda a: (-a.bytes, a.alloc_tick),
    )
    return Analysis(
        log=log,
        categories=categories,
        curves=curves,
        peaks=peaks,
        peak=peak,
        peak_by_phase=by_phase,
        live_at_peak=live,
        lines_at_peak=tuple(group_by_line(live, categories)),
        temporaries=tuple(temporaries),
    )
