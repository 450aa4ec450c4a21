"""What the doctor tests share: a program measured by memtrim and torch.profiler in one run, the check
that a finding's predicted drop is what applying its fix measures, and plain-PyTorch stand-ins for
the prescriptions (so these tests do not depend on ``memtrim.fixes``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from groundtruth import ProfiledMemory, profiler_memory

import memtrim
from memtrim.analysis import Edits
from memtrim.doctor import Diagnosis

PROFILER_SLACK = 64
"""Bytes torch.profiler sees that no dispatch mode can: Python numbers wrapped as 8-byte tensors by the
argument parser (``x / temperature``) and scalar conversions inside a kernel."""
RNG_STATE = 5056
"""The CPU generator's state, as ``torch.get_rng_state()`` returns it: made outside any aten op, so
the profiler sees it and memtrim cannot (GSQ keeps one per step; checkpoint one per block)."""


@dataclass
class Measured:
    trace: memtrim.Trace
    truth: ProfiledMemory

    @property
    def peak(self) -> int:
        return self.truth.peak


def measure(program: Callable[[], object], *, rng_states: int = 0) -> Measured:
    """Run ``program`` under memtrim and torch.profiler at once; memtrim's peak must be the profiler's,
    less what no dispatch mode sees (``rng_states`` generator states the program captures)."""
    with profiler_memory() as truth, memtrim.track() as trace:
        program()
    unseen = truth.peak - trace.peak_bytes
    assert 0 <= unseen <= PROFILER_SLACK + rng_states * RNG_STATE, (truth.peak, trace.peak_bytes)
    return Measured(trace, truth)


def only_removes_or_shrinks(edits: Edits) -> bool:
    return not (edits.alloc_at or edits.free_at or edits.add)


def assert_fix_measures(finding: Diagnosis, before: Measured, after: Measured) -> float:
    """The fix lowered the measured peak, and by what the finding predicted: within 1% of the measured
    drop for a fix that only removes or shrinks allocations, within 10% for one that moves them or adds
    its own. Both peaks are torch.profiler's; the prediction is the what-if of the traced timeline,
    whose peak before is the profiler's too. Returns the relative error."""
    assert finding.peak_before == before.trace.peak_bytes
    measured = before.peak - after.peak
    assert measured > 0, f"{finding.rule}: the fix did not lower the peak ({before.peak} -> {after.peak})"
    predicted = finding.peak_before - finding.peak_after
    tolerance = 0.01 if only_removes_or_shrinks(finding.edits) else 0.10
    error = abs(predicted - measured) / measured
    assert error <= tolerance, (finding.rule, predicted, measured, error)
    return error


def combined(findings: list[Diagnosis]) -> Edits:
    """The edits of several findings on disjoint allocations, applied together."""
    remove: set[int] = set()
    resize: dict[int, int] = {}
    free_at: dict[int, float | None] = {}
    added: list = []
    for d in findings:
        assert not (d.edits.touched() & (remove | set(resize) | set(free_at))), "findings overlap"
        remove |= d.edits.remove
        resize.update(d.edits.resize)
        free_at.update(d.edits.free_at)
        added += d.edits.add
    return Edits(remove=frozenset(remove), resize=resize, free_at=free_at, add=tuple(added))


def findings(trace: memtrim.Trace, rule: str) -> list[Diagnosis]:
    return [d for d in trace.diagnoses() if d.rule == rule]


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``F.cross_entropy(hidden @ weight.T + bias, target, ignore_index=-100)`` (mean) one
    ``[chunk, vocab]`` tile at a time, in plain PyTorch: a stand-in for
    ``memtrim.fixes.chunked_linear_cross_entropy`` with the same memory plan (one tile in forward, one in
    backward, the logits recomputed there, the softmax in fp32; for fp16/bf16 the weight's gradient in
    its own dtype where one tile holds every token, as the fix's do, and summed in fp32 otherwise, and
    the hidden states' gradient summed in fp32)."""

    @staticmethod
    def _logits(tile, low, hidden, weight, bias):  # type: ignore[no-untyped-def]
        rows = hidden.shape[0]
        out = tile[:rows] if low is None else low[:rows]
        if bias is None:
            torch.mm(hidden, weight.t(), out=out)
        else:
            torch.addmm(bias, hidden, weight.t(), out=out)
        return out if low is None else tile[:rows].copy_(out)

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, chunk):  # type: ignore[no-untyped-def, override]
        tokens, acc = hidden.shape[0], torch.float32
        valid = target != -100
        count = valid.sum()
        target = target.clamp(min=0)
        lse = torch.empty(tokens, dtype=acc)
        total = torch.zeros((), dtype=acc)
        tile = torch.empty(chunk, weight.shape[0], dtype=acc)
        low = torch.empty(chunk, weight.shape[0], dtype=hidden.dtype) if hidden.dtype != acc else None
        for s in range(0, tokens, chunk):
            e = min(s + chunk, tokens)
            t = ChunkedLinearCrossEntropy._logits(tile, low, hidden[s:e], weight, bias)
            lse[s:e] = torch.logsumexp(t, dim=1)
            picked = t.gather(1, target[s:e, None]).squeeze(1)
            total += ((lse[s:e] - picked) * valid[s:e]).sum()
        del tile, low
        ctx.save_for_backward(hidden, weight, bias, target, valid, lse, count)
        ctx.chunk = chunk
        return (total / count).to(hidden.dtype)

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def, override]
        hidden, weight, bias, target, valid, lse, count = ctx.saved_tensors
        tokens, chunk, acc = hidden.shape[0], ctx.chunk, torch.float32
        half = hidden.dtype != acc
        # the fix sums the hidden states' gradient over its tiles in fp32 for fp16/bf16
        grad_hidden = torch.empty(hidden.shape, dtype=acc) if half else torch.empty_like(hidden)
        one_tile = chunk >= tokens
        grad_weight = torch.empty(weight.shape, dtype=weight.dtype if one_tile else acc)
        grad_bias = None if bias is None else torch.zeros(bias.shape, dtype=acc)
        tile = torch.empty(chunk, weight.shape[0], dtype=acc)
        low = torch.empty(chunk, weight.shape[0], dtype=hidden.dtype) if hidden.dtype != acc else None
        scale = g.to(acc) / count
        for s in range(0, tokens, chunk):
            e = min(s + chunk, tokens)
            t = ChunkedLinearCrossEntropy._logits(tile, low, hidden[s:e], weight, bias)
            t.sub_(lse[s:e, None]).exp_()
            t[torch.arange(e - s), target[s:e]] -= 1
            t.mul_(valid[s:e, None] * scale)
            g_tile = t if low is None else low[: e - s].copy_(t)
            if half:
                grad_hidden[s:e] = torch.mm(g_tile, weight)
            else:
                torch.mm(g_tile, weight, out=grad_hidden[s:e])
            if one_tile:
                torch.mm(g_tile.t(), hidden, out=grad_weight)
            elif s == 0:
                torch.mm(t.t(), hidden[s:e].to(acc), out=grad_weight)
            else:
                grad_weight.addmm_(t.t(), hidden[s:e].to(acc))
            if grad_bias is not None:
                grad_bias += t.sum(0)
        grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
        return grad_hidden.to(hidden.dtype), grad_weight.to(weight.dtype), grad_bias, None, None


def chunk_from(finding: Diagnosis) -> int:
    """The ``chunk_size=`` a logits-cross-entropy finding prescribes."""
    import re

    match = re.search(r"chunk_size=(\d+)", finding.fix)
    assert match, finding.fix
    return int(match.group(1))
