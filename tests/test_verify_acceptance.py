"""Issue 3's acceptance list for memtrim.verify, verbatim: what it must catch, and what it must pass."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from memtrim.verify import VerifyReport, verify
from memtrim.verify.cases import contiguous_strides

FAST: dict[str, Any] = {"memory": False, "progress": False, "seeds": (0,)}


# -- the callables ----------------------------------------------------------------------------------
def head_results_broadcast(z: torch.Tensor, W_O: torch.Tensor) -> torch.Tensor:
    return (z[..., None] * W_O).sum(-2)


def head_results_einsum(z: torch.Tensor, W_O: torch.Tensor) -> torch.Tensor:
    return torch.einsum("...hd,hdm->...hm", z, W_O)


def _values(like: torch.Tensor) -> torch.Tensor:
    return torch.tensor([-1.5, -0.5, 0.5, 1.5], dtype=like.dtype, device=like.device).view(4, 1, 1)


Tail = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def gumbel_function(tail: Tail) -> Any:
    """A GumbelSoftmaxFunction-like autograd.Function whose backward ends in ``tail`` (seed 000)."""

    class GumbelSoftmax(torch.autograd.Function):
        @staticmethod
        def forward(
            ctx: Any, quant_logits: torch.Tensor, scale: torch.Tensor, temperature: float
        ) -> torch.Tensor:
            soft_quant = torch.softmax(quant_logits / temperature, dim=0)
            ctx.save_for_backward(soft_quant, scale)
            ctx.temperature = temperature
            return (soft_quant * _values(soft_quant)).sum(0) * scale

        @staticmethod
        def backward(ctx: Any, g_soft_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
            soft_quant, scale = ctx.saved_tensors
            g_q = g_soft_output.unsqueeze(0) * _values(g_soft_output)  # fresh, contiguous, local
            dot = (soft_quant * g_q).sum(0, keepdim=True)
            grad = tail(g_q, dot, soft_quant, scale, ctx.temperature)
            return grad.to(soft_quant.dtype), None, None

    return GumbelSoftmax


def tail_before(
    g_q: torch.Tensor, dot: torch.Tensor, soft: torch.Tensor, scale: torch.Tensor, t: float
) -> Any:
    grad_z = soft * (g_q - dot)
    return grad_z * scale / t


def tail_after(
    g_q: torch.Tensor, dot: torch.Tensor, soft: torch.Tensor, scale: torch.Tensor, t: float
) -> Any:
    g_q.sub_(dot)  # g_q - dot
    g_q.mul_(soft)  # soft_quant * (g_q - dot) == grad_z
    g_q.mul_(scale)
    g_q.div_(t)  # grad_z * scale / temperature
    return g_q


def tail_folded(
    g_q: torch.Tensor, dot: torch.Tensor, soft: torch.Tensor, scale: torch.Tensor, t: float
) -> Any:
    g_q.sub_(dot)
    g_q.mul_(soft)
    g_q.mul_(scale / t)  # one multiply: perturbs bf16 rounding (seed 000)
    return g_q


Original, InPlace, Folded = (gumbel_function(t) for t in (tail_before, tail_after, tail_folded))


def gumbel_inputs() -> tuple[torch.Tensor, torch.Tensor, float]:
    return torch.randn(4, 12, 20, requires_grad=True), torch.rand(12, 1) + 0.5, 0.7


def xw() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(6, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)


def failed_with(report: VerifyReport, *needles: str) -> str:
    """Assert the report failed and its first failure names the case and every needle; return it."""
    assert not report.passed
    assert report.failures
    msg = report.failures[0].message
    assert f"(case {report.failures[0].case})" in msg
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"
    with pytest.raises(AssertionError, match=r"memtrim\.verify failed in case"):
        report.assert_ok()
    return msg


# -- catches, with a clear message ------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["auto", "exact", "reference"])
def test_catches_wrong_transpose(mode: str) -> None:
    r = verify(lambda x, W: x @ W, lambda x, W: x @ W.T, xw(), mode=mode, **FAST)
    failed_with(r, "output")
    assert {c.status for c in r.cases} == {"failed"}


def test_catches_missing_scale_factor() -> None:
    r = verify(lambda x, W: (x @ W) * 0.125, lambda x, W: x @ W, xw(), **FAST)
    msg = failed_with(r, "output", "exceed the rounding budget", "computes a different function")
    assert "float64" in msg


def test_catches_dropped_bias_trainable() -> None:
    b = torch.randn(8, requires_grad=True)
    r = verify(lambda x, W, b: x @ W + b, lambda x, W, b: x @ W, (*xw(), b), **FAST)
    failed_with(r, "no grad of input[2]")


def test_catches_dropped_bias_frozen() -> None:
    b = torch.randn(8)
    r = verify(lambda x, W, b: x @ W + b, lambda x, W, b: x @ W, (*xw(), b), **FAST)
    failed_with(r, "output", "exceed the rounding budget")


def test_catches_wrong_reduction_dim() -> None:
    x = torch.randn(8, 8, requires_grad=True)
    r = verify(lambda x: x.sum(-1), lambda x: x.sum(-2), (x,), **FAST)
    failed_with(r, "output", "computes a different function")


def stride_ignoring(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    return torch.as_strided(x, x.shape, contiguous_strides(x.shape)) @ W


def storage_as_contiguous(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    flat = torch.empty(0, dtype=x.dtype).set_(x.untyped_storage())  # the storage, as if contiguous
    return flat[x.storage_offset() : x.storage_offset() + x.numel()].view(x.shape) @ W


@pytest.mark.parametrize("kernel", [stride_ignoring, storage_as_contiguous])
def test_catches_kernel_that_ignores_strides(kernel: Callable[..., torch.Tensor]) -> None:
    x, W = torch.randn(6, 8), torch.randn(8, 8)  # no grads: set_ on a storage is not differentiable
    r = verify(lambda x, W: x @ W, kernel, (x, W), layouts=("contiguous", "noncontiguous"), **FAST)
    assert not r.passed
    by_layout = {c.case.layout: c.status for c in r.cases}
    assert by_layout == {"contiguous": "passed", "noncontiguous": "failed"}
    nc = [f for f in r.failures if "noncontiguous" in f.case]
    assert "hidden slots hold NaN" in nc[0].message and "strides" in nc[0].message
    assert any("depends on memory layout" in n for n in r.notes)


def test_stride_ignoring_kernel_with_grads_fails_in_every_strided_layout() -> None:
    r = verify(lambda x, W: x @ W, stride_ignoring, xw(), **FAST)
    statuses = {c.case.layout: c.status for c in r.cases}
    assert statuses["contiguous"] == "passed"
    assert statuses["noncontiguous"] == statuses["transposed"] == "failed"


def test_catches_dtype_change() -> None:
    r = verify(lambda x, W: x @ W, lambda x, W: x.float() @ W.float(), xw(), dtypes=("bf16",), **FAST)
    failed_with(r, "is float32 where the reference's is bfloat16", "cast the result back")


def test_catches_silently_detached_gradient() -> None:
    r = verify(lambda x, W: x @ W, lambda x, W: x @ W.detach(), xw(), **FAST)
    failed_with(r, "no grad of input[1]", "detach")


def test_catches_detached_output() -> None:
    r = verify(lambda x, W: x @ W, lambda x, W: (x @ W).detach(), xw(), **FAST)
    failed_with(r, "does not require grad", "autograd graph")


def test_catches_inplace_rewrite_corrupting_saved_tensor_autograd_detects() -> None:
    def rewrite(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        y = torch.sigmoid(x)  # sigmoid saves its output for backward
        out = y @ W
        y.mul_(2)  # "reuse the buffer": corrupts the saved tensor
        return out

    r = verify(lambda x, W: torch.sigmoid(x) @ W, rewrite, xw(), **FAST)
    failed_with(r, "the candidate raised RuntimeError in backward", "autograd saved for backward")


class _StashMul(torch.autograd.Function):
    """x * w that stashes x on ctx (not save_for_backward), so autograd cannot see it modified."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.x = x
        return x * w

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, (g * ctx.x).sum(0)


def test_catches_inplace_rewrite_corrupting_saved_tensor_silently() -> None:
    def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return _StashMul.apply(x * 1.0, w)

    def candidate(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x * 1.0
        out = _StashMul.apply(h, w)
        h.zero_()  # frees "nothing" and silently corrupts what backward reads
        return out

    r = verify(reference, candidate, (torch.randn(5, 3), torch.randn(3, requires_grad=True)), **FAST)
    failed_with(r, "grad of input[1]", "exceed the rounding budget")


# -- passes ----------------------------------------------------------------------------------------
def test_passes_head_results_einsum_vs_broadcast_in_reference_mode() -> None:
    z, W_O = torch.randn(8, 4, 16, requires_grad=True), torch.randn(4, 16, 32, requires_grad=True)
    r = verify(
        head_results_broadcast, head_results_einsum, (z, W_O), mode="reference", memory=False, progress=False
    )
    r.assert_ok()
    assert len(r.cases) == 4 * 4 * 3 and all(c.held == "reference" for c in r.cases)
    q = {q.rule for c in r.cases for q in c.quantities}
    assert q == {"per element, budget traced"}


def test_passes_seed000_inplace_backward_in_exact_mode() -> None:
    r = verify(Original.apply, InPlace.apply, gumbel_inputs(), mode="exact", memory=False, progress=False)
    r.assert_ok()
    assert all(c.held == "exact" for c in r.cases) and len(r.cases) == 48
    assert {q.name for q in r.cases[0].quantities} == {"output", "grad of input[0]"}


def test_seed000_folded_scale_caught_by_exact_mode_in_bf16() -> None:
    r = verify(Original.apply, Folded.apply, gumbel_inputs(), mode="exact", dtypes=("bf16",), **FAST)
    msg = failed_with(r, "grad of input[0] is not bit-exact", "bfloat16")
    assert "first at" in msg and r.failures[0].details["offending"]
    assert all(f.what == "grad of input[0]" for f in r.failures)  # the forward is untouched


def test_seed000_folded_scale_judged_in_reference_mode() -> None:
    # Folding is no less accurate (two roundings either way). The softmax and the custom backward are
    # traced, so each element is judged against its own budget; the report says which rule held.
    r = verify(Original.apply, Folded.apply, gumbel_inputs(), mode="reference", memory=False, progress=False)
    r.assert_ok()
    assert {q.rule for c in r.cases for q in c.quantities} == {"per element, budget traced"}
    assert not any("could not be derived" in n for n in r.notes)
    auto = verify(Original.apply, Folded.apply, gumbel_inputs(), dtypes=("bf16",), **FAST)
    assert auto.passed and {c.held for c in auto.cases} == {"reference"}
