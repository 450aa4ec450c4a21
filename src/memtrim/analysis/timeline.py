"""Live bytes over time, the peak, what was alive at the peak, and the largest temporaries."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from memtrim.analysis.allocator import charged_bytes
from memtrim.trace.model import Allocation, OpCall, OpRow, Site, Trace


@dataclass
class Peak:
    """The moment of highest live bytes (above the region's start) on one device."""

    bytes: int
    device: str | None = None
    tick: int | None = None
    allocation: Allocation | None = None
    op: OpCall | None = None

    @property
    def phase(self) -> str | None:
        return self.allocation.phase if self.allocation else None

    @property
    def site(self) -> Site | None:
        return self.allocation.site if self.allocation else None

    def describe(self) -> dict[str, Any]:
        site = self.site
        return {
            "bytes": self.bytes,
            "device": self.device,
            "tick": self.tick,
            "phase": self.phase,
            "op": self.allocation.op if self.allocation else None,
            "node": self.allocation.node if self.allocation else None,
            "file": site.file if site else None,
            "line": site.line if site else None,
            "function": site.function if site else None,
        }


@dataclass
class LineGroup:
    """Bytes alive at the peak that one source line made."""

    site: Site | None
    bytes: int = 0
    count: int = 0
    categories: dict[str, int] = field(default_factory=dict)
    ops: dict[str, int] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        return {
            "file": self.site.file if self.site else None,
            "line": self.site.line if self.site else None,
            "function": self.site.function if self.site else None,
            "bytes": self.bytes,
            "count": self.count,
            "categories": self.categories,
            "ops": self.ops,
        }


def live_curve(trace: Trace, device: str, charge_as: str | None = None) -> list[tuple[int, int, Allocation]]:
    """(tick, live bytes after the event, allocation) for every event on ``device``, in order.

    Bytes are what ``device``'s allocator charges, or ``charge_as``'s (e.g. ``"cuda"`` to predict a
    GPU peak from a trace recorded on the CPU or with fake tensors).
    """
    events: list[tuple[int, int, Allocation]] = []
    rule_device = charge_as or device
    for a in trace.allocations:
        if a.device != device:
            continue
        charge = charged_bytes(a.bytes, rule_device)
        if not a.preexisting:
            events.append((a.alloc_tick, charge, a))
        if a.free_tick is not None:
            events.append((a.free_tick, -charge, a))
    events.sort(key=lambda e: e[0])
    curve = []
    live = 0
    for tick, delta, a in events:
        live += delta
        curve.append((tick, live, a))
    return curve


def devices(trace: Trace) -> list[str]:
    return sorted({a.device for a in trace.allocations})


def _tick_of(row: OpRow) -> int:
    return row[0]


def _op_at(trace: Trace, tick: int) -> OpCall | None:
    index = bisect.bisect_right(trace.ops.rows, tick, key=_tick_of) - 1
    return trace.ops[index] if index >= 0 else None


def _peak_on(trace: Trace, device: str, charge_as: str | None = None) -> Peak:
    best = Peak(bytes=0, device=device)
    for tick, live, a in live_curve(trace, device, charge_as):
        if live > best.bytes:
            best = Peak(bytes=live, device=device, tick=tick, allocation=a)
    if best.tick is not None:
        best.op = _op_at(trace, best.tick)
    return best


def peaks_by_device(trace: Trace, charge_as: str | None = None) -> dict[str, Peak]:
    return {device: _peak_on(trace, device, charge_as) for device in devices(trace)}


def find_peak(trace: Trace, charge_as: str | None = None) -> Peak:
    """The peak on the device whose peak is largest (an accelerator wins a tie with the CPU).

    ``charge_as="cuda"`` counts every block as CUDA's caching allocator would (512-byte rounding).
    """
    peaks = peaks_by_device(trace, charge_as)
    if not peaks:
        return Peak(bytes=0)
    return max(peaks.values(), key=lambda p: (p.bytes, p.device != "cpu"))


def alive_at(trace: Trace, tick: int, device: str | None = None) -> list[Allocation]:
    """Allocations made inside the region and alive just after ``tick``."""
    return [
        a
        for a in trace.allocations
        if not a.preexisting
        and (device is None or a.device == device)
        and a.alloc_tick <= tick
        and (a.free_tick is None or a.free_tick > tick)
    ]


def group_by_line(allocations: list[Allocation]) -> list[LineGroup]:
    groups: dict[Site | None, LineGroup] = {}
    for a in allocations:
        group = groups.setdefault(a.site, LineGroup(site=a.site))
        group.bytes += a.bytes
        group.count += 1
        group.categories[a.category] = group.categories.get(a.category, 0) + a.bytes
        group.ops[a.op] = group.ops.get(a.op, 0) + a.bytes
    return sorted(groups.values(), key=lambda g: g.bytes, reverse=True)


def live_at_peak(trace: Trace) -> list[LineGroup]:
    """What was alive at the peak, grouped by the source line that made it, largest first."""
    peak = find_peak(trace)
    if peak.tick is None:
        return []
    return group_by_line(alive_at(trace, peak.tick, peak.device))


def largest_temporaries(trace: Trace, n: int = 10) -> list[Allocation]:
    """The n largest allocations made and freed in the same phase, largest first."""
    temps = [a for a in trace.allocations if a.category == "temporary"]
    temps.sort(key=lambda a: (-a.bytes, a.alloc_tick))
    return temps[:n]
