"""What-if: the peak the same trace would have had without some allocations."""

from __future__ import annotations

from collections.abc import Iterable

from memtrim.analysis.allocator import charged_bytes
from memtrim.trace.model import Allocation, Trace


def peak_without(trace: Trace, removed: Iterable[Allocation], device: str | None = None) -> int:
    """Peak live bytes on ``device`` (default: the peak's device) if ``removed`` were never allocated.

    This is a lower bound on what a rewrite saves only if the rewrite adds nothing else; a fused op
    still needs its output, which stays in the trace.
    """
    from memtrim.analysis.timeline import find_peak

    device = device or find_peak(trace).device
    gone = {a.id for a in removed}
    events = []
    for a in trace.allocations:
        if a.device != device or a.id in gone:
            continue
        charge = charged_bytes(a.bytes, device)
        if not a.preexisting:
            events.append((a.alloc_tick, charge))
        if a.free_tick is not None:
            events.append((a.free_tick, -charge))
    events.sort()
    live = best = 0
    for _, delta in events:
        live += delta
        best = max(best, live)
    return best
