"""Diagnoses: the advice names the right line, and its predicted peak matches the rewrite's real peak."""

from __future__ import annotations

import torch
from groundtruth import profiler_memory
from programs import ScaledDifference

import memtrim
from memtrim.cases.heads import head_results, head_results_broadcast
from memtrim.doctor.diagnosis import DIAGNOSES


class InPlace(ScaledDifference):
    """ScaledDifference with the seed-000 rewrite: the same ops in the same order, in place."""

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        s, d = ctx.saved_tensors  # type: ignore[attr-defined]
        a = g - d
        a.mul_(s)
        a.mul_(3.0)
        return a, None


def test_rules_are_a_registry() -> None:
    assert set(DIAGNOSES) == {
        "logits-cross-entropy",
        "all-gather-saved-for-backward",
        "upcast-copy",
        "kept-output",
        "cache-in-training",
        "broadcast-then-reduce",
        "out-of-place-chain",
        "checkpoint-candidates",
        "eager-attention",
        "optimizer-step",
        "optimizer-state",
        "fsdp-reshard-after-forward",
        "ddp-gradient-as-bucket-view",
    }


def test_in_place_advice_predicts_the_peak_of_the_in_place_rewrite() -> None:
    x = torch.randn(256, 1024, requires_grad=True)
    d = torch.randn(256, 1024)
    with memtrim.track() as before:
        ScaledDifference.apply(x, d).sum().backward()
    (finding,) = [f for f in before.diagnoses() if f.rule == "out-of-place-chain"]
    assert finding.site is not None and finding.site.function == "backward"
    assert len(finding.allocations) == 2
    original_grad, x.grad = x.grad, None
    with profiler_memory() as after:
        InPlace.apply(x, d).sum().backward()
    assert finding.peak_after == after.peak < before.peak_bytes
    assert torch.equal(x.grad, original_grad)  # same op order: bit-identical


def test_broadcast_advice_points_at_the_multiply_and_bounds_the_einsum_peak() -> None:
    z = torch.randn(64, 12, 64, requires_grad=True)
    W_O = torch.randn(12, 64, 768, requires_grad=True)
    with memtrim.track() as before:
        head_results_broadcast(z, W_O).sum().backward()
    (finding,) = [f for f in before.diagnoses() if f.rule == "broadcast-then-reduce"]
    assert finding.site == before.largest_temporaries(1)[0].site
    assert {a.bytes for a in finding.allocations} == {64 * 12 * 64 * 768 * 4}
    assert len(finding.allocations) == 3  # forward product and both backward products
    z.grad = W_O.grad = None
    with profiler_memory() as after:
        head_results(z, W_O).sum().backward()
    # the what-if keeps the result and gradients; einsum needs no more than that plus small buffers
    assert after.peak <= finding.peak_after * 2 < before.peak_bytes // 10
    assert "torch.einsum" in before.report()


def test_no_advice_for_a_lean_program() -> None:
    z = torch.randn(64, 12, 64, requires_grad=True)
    W_O = torch.randn(12, 64, 768, requires_grad=True)
    with memtrim.track() as trace:
        head_results(z, W_O).sum().backward()
    assert trace.diagnoses() == []


def test_the_proofs_first_lines_fit_a_100_column_report() -> None:
    """A report indents a proof by six columns (and ``memtrim show`` of ranks fits 100): each fixed first
    line, the one naming what the proof needs bound, is at most 94 characters."""
    from memtrim.doctor.diagnosis import LIVE_PROOF_NAMES, MODULE_PROOF_NAMES, PROOF_NAMES

    for line in (PROOF_NAMES, MODULE_PROOF_NAMES, LIVE_PROOF_NAMES):
        assert len(line) <= 94, (len(line), line)
