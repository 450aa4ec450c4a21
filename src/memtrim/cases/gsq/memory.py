"""Backward-peak measurements for the GSQ case, from a memtrim trace and from torch.profiler.

*Backward peak*: during ``loss.backward()``, the highest live bytes minus the bytes live when the backward
starts. Everything made before (parameters, the forward's soft weight and activations, optimizer state) is
in the baseline; everything backward makes (the incoming gradient of the soft weight, the recomputed soft
assignment, every temporary, the logits' gradient itself) counts. Reported in *buffers*: one
``(4, out, in)`` tensor in the logits' dtype, the unit GSQ's memory is made of.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from memtrim.api import Trace, track
from memtrim.trace.model import Phase

from .module import GumbelQuantizer2Bit

__all__ = [
    "BACKWARD_MARK",
    "StepMemory",
    "backward_peak",
    "buffer_bytes",
    "measure_step",
    "profiler_backward_peak",
]

#: ``record_function`` label around ``loss.backward()``, which the profiler measurement keys on.
BACKWARD_MARK = "memtrim.gsq.backward"


def buffer_bytes(q: GumbelQuantizer2Bit) -> int:
    """Bytes of one ``(4, out, in)`` buffer in the logits' dtype."""
    return q.quant_logits.numel() * q.quant_logits.element_size()


def backward_peak(trace: Trace, device: str | None = None) -> int:
    """The backward peak (see module doc) on ``device`` (default: the device with most allocations)."""
    ticks = [op.tick for op in trace.ops if op.phase is Phase.BACKWARD]
    if not ticks:
        raise ValueError("the trace has no backward ops; track a region that calls loss.backward()")
    if device is None:
        counts: dict[str, int] = {}
        for a in trace.allocations:
            counts[a.device] = counts.get(a.device, 0) + 1
        device = max(counts, key=lambda d: counts[d])
    # From the first backward op to the first op after the backward (or the region's end): what the last
    # backward op allocates, and frees that follow it, come after its own tick and still belong here.
    start = ticks[0]
    end = next(
        (op.tick for op in trace.ops if op.tick > ticks[-1] and op.phase is not Phase.BACKWARD),
        trace.log.end_tick,
    )
    base = peak = None
    curve = trace.analysis.curve(device)
    for tick, live in zip(curve.ticks, curve.live, strict=True):
        if tick < start:
            base = live
            continue
        if tick >= end:
            break
        peak = live if peak is None else max(peak, live)
    base = base or 0
    return 0 if peak is None else max(0, peak - base)


def profiler_backward_peak(prof: profile, mark: str = BACKWARD_MARK) -> int:
    """The same figure from the profiler's CPU allocator events inside the ``mark`` range."""
    window = None
    events: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())  # type: ignore[union-attr]
    while stack:
        node = stack.pop()
        if node.tag == torch._C._profiler._EventType.Allocation:
            if node.extra_fields.device.type == "cpu":
                events.append((node.start_time_ns, node.extra_fields.alloc_size))
            continue
        if node.name == mark:
            window = (node.start_time_ns, node.end_time_ns)
        stack.extend(node.children)
    if window is None:
        raise ValueError(
            f"no {mark!r} range in the profile; wrap loss.backward() in record_function({mark!r})"
        )
    events.sort(key=lambda e: e[0])
    live = 0
    base = peak = None
    for t, delta in events:
        if t < window[0]:
            live += delta
            continue
        if base is None:
            base = live
        if t > window[1]:
            break
        live += delta
        peak = live if peak is None else max(peak, live)
    return 0 if peak is None or base is None else max(0, peak - base)


@dataclass
class StepMemory:
    variant: str
    buffer_bytes: int
    backward_peak: int
    step_peak: int
    profiler_backward_peak: int | None
    trace: Trace

    @property
    def backward_buffers(self) -> float:
        return self.backward_peak / self.buffer_bytes


def _step(
    q: GumbelQuantizer2Bit,
    x: torch.Tensor,
    temperature: float,
    scale: float,
    optimizer: torch.optim.Optimizer | None,
) -> None:
    w = q(temperature, scale)
    loss = (x @ w.T).float().square().mean()
    del w
    with record_function(BACKWARD_MARK):
        loss.backward()
    del loss
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def measure_step(
    q: GumbelQuantizer2Bit,
    x: torch.Tensor,
    temperature: float = 0.5,
    scale: float = 100.0,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    with_profiler: bool = False,
) -> StepMemory:
    """Track one forward+backward of ``q`` on a linear layer with inputs ``x`` (tokens, in), then the
    ``optimizer`` step and ``zero_grad(set_to_none=True)`` if one is given.

    With ``with_profiler`` the same run is also profiled (CPU only) for an independent figure.
    Call it inside ``memtrim.track(fake=True)`` with fake ``q`` and ``x`` to measure without allocating.
    """
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True) if with_profiler else None
    with prof if prof is not None else contextlib.nullcontext(), track() as trace:
        _step(q, x, temperature, scale, optimizer)
    return StepMemory(
        variant=q.backward_variant,
        buffer_bytes=buffer_bytes(q),
        backward_peak=backward_peak(trace),
        step_peak=trace.peak_bytes,
        profiler_backward_peak=profiler_backward_peak(prof) if prof is not None else None,
        trace=trace,
    )
