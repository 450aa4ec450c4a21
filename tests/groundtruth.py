"""Independent ground truth for memory claims: torch.profiler's CPU allocation events.

The profiler sees every call into the CPU allocator. Two kinds of block never reach a dispatch mode
and are set aside here, each kept in its own list so a test can bound them:

- intra-op: an allocation whose alloc and free events both sit under the same outermost op
  (workspaces, scalar conversions inside a kernel). memtrim accounts at op boundaries. An op is an
  ``aten::`` op, a collective (``c10d::``, ``_c10d_functional::``), one of FSDP2's custom ops
  (``fsdp::``), or a collective's run on a gloo worker thread (``gloo:all_gather``: its flat staging
  copies); user ``record_function`` spans are not ops.
- wrapped numbers: torch's Python argument parser turns a Python number operand (``y * 2``) into an
  8-byte 0-dim tensor outside any op; the dispatch mode receives the plain number.

What remains must match memtrim event for event.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile

WRAPPED_NUMBER_BYTES = 8
OP_PREFIXES = ("aten::", "c10d::", "_c10d_functional::", "fsdp::", "gloo:")


def _peak(deltas: list[int]) -> int:
    live = best = 0
    for delta in deltas:
        live += delta
        best = max(best, live)
    return best


@dataclass
class ProfiledMemory:
    events: list[tuple[int, int]] = field(default_factory=list)  # (time ns, +bytes / -bytes), cross-op
    intra_op_bytes: list[int] = field(default_factory=list)
    wrapped_number_bytes: list[int] = field(default_factory=list)
    # ordinals (among the cross-op allocations, in order) of blocks whose free the profiler never saw:
    # kept to the end, or freed on a thread the profiler does not watch (a gloo worker thread that
    # drops a collective's last reference to its buffers after wait() returned)
    unfreed: list[int] = field(default_factory=list)
    # indices into ``events`` of frees of blocks allocated before the profile began
    prewindow_frees: list[int] = field(default_factory=list)
    # (time ns, -bytes): a free the profiler never saw, placed just before its block's address was
    # handed out again (it was freed no later than that)
    reuse_frees: list[tuple[int, int]] = field(default_factory=list)

    @property
    def deltas(self) -> list[int]:
        return [delta for _, delta in self.events]

    @property
    def deltas_in_window(self) -> list[int]:
        """:attr:`deltas` without the frees of blocks allocated before the profile began."""
        left_out = set(self.prewindow_frees)
        return [delta for i, (_, delta) in enumerate(self.events) if i not in left_out]

    @property
    def peak_in_window(self) -> int:
        return _peak(self.deltas_in_window)

    @property
    def peak_in_window_with_reuse_frees(self) -> int:
        """:attr:`peak_in_window` with each unseen free placed where its block's address was reused."""
        left_out = set(self.prewindow_frees)
        kept = [event for i, event in enumerate(self.events) if i not in left_out]
        return _peak([delta for _, delta in sorted(kept + self.reuse_frees)])

    @property
    def peak(self) -> int:
        return _peak(self.deltas)

    @property
    def allocated_sizes(self) -> list[int]:
        return sorted(d for d in self.deltas if d > 0)


def _allocation_events(prof: profile) -> list[tuple[int, int, int, int | None]]:
    """(time, ptr, delta, id of the outermost aten op around it or None) for every CPU alloc/free."""
    out: list[tuple[int, int, int, int | None]] = []
    stack: list[tuple[object, int | None]] = [
        (root, None) for root in prof.profiler.kineto_results.experimental_event_tree()
    ]
    while stack:
        node, op = stack.pop()
        if node.tag == torch._C._profiler._EventType.Allocation:
            fields = node.extra_fields
            if fields.device.type == "cpu":
                out.append((node.start_time_ns, fields.ptr, fields.alloc_size, op))
            continue
        if op is None and node.name.startswith(OP_PREFIXES):
            op = id(node)
        stack.extend((child, op) for child in node.children)
    out.sort(key=lambda e: e[0])
    return out


def profiled_memory(prof: profile) -> ProfiledMemory:
    events = _allocation_events(prof)
    opened: dict[int, tuple[int, int | None]] = {}
    intra: set[int] = set()  # indices of events set aside
    # allocations whose address was handed out again before their free was seen: freed on a thread
    # the profiler does not watch (a gloo worker thread dropping a comm hook's compressed bucket)
    reused: set[int] = set()
    result = ProfiledMemory()
    for i, (_, ptr, delta, op) in enumerate(events):
        if delta > 0:
            if ptr in opened:
                reused.add(opened[ptr][0])
                result.reuse_frees.append((events[i][0] - 1, -events[opened[ptr][0]][2]))
            opened[ptr] = (i, op)
        elif ptr in opened:
            j, alloc_op = opened.pop(ptr)
            if op is not None and op == alloc_op:
                intra.update((i, j))
                result.intra_op_bytes.append(-delta)
            elif alloc_op is None and -delta == WRAPPED_NUMBER_BYTES:
                intra.update((i, j))
                result.wrapped_number_bytes.append(-delta)
    result.events = [(t, delta) for i, (t, _, delta, _) in enumerate(events) if i not in intra]
    allocated: set[int] = set()
    kept = 0
    for i, (_, ptr, delta, _) in enumerate(events):
        if i in intra:
            continue
        if delta > 0:
            allocated.add(ptr)
        elif ptr in allocated:
            allocated.discard(ptr)
        else:
            result.prewindow_frees.append(kept)
        kept += 1
    still_open = {i for i, _ in opened.values()} | reused
    kept_allocations = [i for i, (_, _, delta, _) in enumerate(events) if i not in intra and delta > 0]
    result.unfreed = [n for n, i in enumerate(kept_allocations) if i in still_open]
    return result


@contextlib.contextmanager
def profiler_memory() -> Iterator[ProfiledMemory]:
    """Profile the block's CPU allocations; the yielded object is filled in when the block exits.

    Garbage left by earlier code is collected first: a collection that ran inside the block would free
    storages the block never used, which the profiler sees and a tracker of the block rightly does not.
    """
    gc.collect()
    result = ProfiledMemory()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield result
    measured = profiled_memory(prof)
    result.events = measured.events
    result.intra_op_bytes = measured.intra_op_bytes
    result.wrapped_number_bytes = measured.wrapped_number_bytes
    result.unfreed = measured.unfreed
    result.prewindow_frees = measured.prewindow_frees
    result.reuse_frees = measured.reuse_frees


def memtrim_deltas(trace: object, *, preexisting_frees: bool = True) -> list[int]:
    """memtrim's allocation and free events in order, as +bytes / -bytes (``preexisting_frees``: with
    the frees of storages from before the region)."""
    events = []
    for a in trace.allocations:  # type: ignore[attr-defined]
        if a.device != "cpu":
            continue
        if not a.preexisting:
            events.append((a.alloc_tick, a.bytes))
        if a.free_tick is not None and (preexisting_frees or not a.preexisting):
            events.append((a.free_tick, -a.bytes))
    return [delta for _, delta in sorted(events)]


def memtrim_deltas_as_profiled(
    trace: object, unfreed: list[int], *, preexisting_frees: bool = True
) -> list[int]:
    """memtrim's events as the profiler could see them: without the frees of the allocations (by
    ordinal, :attr:`ProfiledMemory.unfreed`) whose free the profiler never saw."""
    made = sorted(
        (a for a in trace.allocations if a.device == "cpu" and not a.preexisting),  # type: ignore[attr-defined]
        key=lambda a: a.alloc_tick,
    )
    hidden = {made[n].id for n in unfreed if n < len(made)}
    events = []
    for a in trace.allocations:  # type: ignore[attr-defined]
        if a.device != "cpu":
            continue
        if not a.preexisting:
            events.append((a.alloc_tick, a.bytes))
        if a.free_tick is not None and a.id not in hidden and (preexisting_frees or not a.preexisting):
            events.append((a.free_tick, -a.bytes))
    return [delta for _, delta in sorted(events)]
