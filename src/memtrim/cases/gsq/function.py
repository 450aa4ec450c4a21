"""The GSQ Gumbel-softmax autograd Function, with the seed PR's lean backward beside GSQ's original.

Forward: ``soft = softmax((logits * scale + gumbel) / T, dim=0)`` over the four codes ``{-2, -1, 0, 1}``,
soft weight ``= sum_k soft[k] * code_k``, times the per-group scale. Only the logits, the scales and the RNG
state are kept for backward, which redraws the same uniform sample and rebuilds ``soft`` instead of saving
several ``(4, out, in)`` buffers.

Both variants run the same ops on the same operands in the same order, so every result is bit-for-bit equal;
``lean`` writes into buffers it already owns and drops each big tensor as soon as it is no longer read.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx, once_differentiable

__all__ = ["CODES", "VARIANTS", "GumbelSoftmax2Bit", "gumbel_soft_weight"]

#: The 2-bit codebook, in the order of the logits' first dimension.
CODES: tuple[float, ...] = (-2.0, -1.0, 0.0, 1.0)
VARIANTS: tuple[str, ...] = ("original", "lean")
_EPS = 1e-8


def check_variant(variant: str) -> str:
    if variant not in VARIANTS:
        raise ValueError(f"unknown backward variant {variant!r}; use backward='lean' or backward='original'")
    return variant


def _is_fake(t: torch.Tensor) -> bool:
    # Under FakeTensorMode nothing is drawn, and a fake CUDA device has no generator to read: skip the state.
    from torch._subclasses.fake_tensor import is_fake

    return bool(is_fake(t)) or t.device.type == "meta"


def default_generator(device: torch.device) -> torch.Generator:
    """The generator ``torch.rand(..., device=device)`` draws from when none is given."""
    if device.type == "cpu":
        return torch.default_generator
    module = getattr(torch, device.type, None)
    generators = getattr(module, "default_generators", None)
    if module is None or generators is None:
        raise RuntimeError(
            f"cannot find the default RNG of device type {device.type!r} to replay the Gumbel noise; "
            "run GumbelQuantizer2Bit on cpu or cuda"
        )
    index = device.index if device.index is not None else module.current_device()
    generator: torch.Generator = generators[index]
    return generator


def _draw_uniform(like: torch.Tensor, replay: torch.Tensor | None) -> torch.Tensor:
    """The forward's draw (``replay=None``: from the device's global generator, advancing it, as
    ``rand_like`` would) or its replay from the state captured just before it."""
    if replay is None:
        return torch.rand(like.shape, dtype=like.dtype, device=like.device)
    # A private generator set to the forward's state: the global generator is neither read nor advanced,
    # which also keeps replay safe on autograd's CUDA worker threads (fork_rng would swap global state).
    gen = torch.Generator(device=like.device)
    gen.set_state(replay)
    return torch.rand(like.shape, dtype=like.dtype, device=like.device, generator=gen)


def _group_view(x: torch.Tensor, group_size: int) -> torch.Tensor:
    # reshape, not view: an incoming gradient may be a transposed (non-contiguous) tensor.
    return x.reshape(x.shape[0], x.shape[1] // group_size, group_size)


def _scale_per_col(scales: torch.Tensor, group_size: int) -> torch.Tensor:
    # GSQ's scales[:, idx]: the same (out, in) copy, built without advanced indexing, which fake CUDA
    # tensors cannot run on a CPU-only build of torch.
    return scales.unsqueeze(-1).expand(*scales.shape, group_size).reshape(scales.shape[0], -1)


def _scale_columns(x: torch.Tensor, scales: torch.Tensor, group_size: int, variant: str) -> torch.Tensor:
    """``x * scales[:, idx].to(x.dtype)``, ``idx = arange(in) // group_size`` being each column's group."""
    if variant == "original":
        return x * _scale_per_col(scales, group_size).to(x.dtype)
    # Same products of the same pairs, without materialising the (out, in) expanded scales.
    return (_group_view(x, group_size) * scales.to(x.dtype).unsqueeze(-1)).view(x.shape)


def _soft_assignment(
    logits: torch.Tensor,
    values: torch.Tensor,
    replay: torch.Tensor | None,
    temperature: float,
    scale: float,
    variant: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw (``replay=None``) or redraw the noise; return ``soft_quant`` (4, out, in), ``soft_output``."""
    dtype = values.dtype
    if variant == "original":
        u = _draw_uniform(logits, replay)
        noise = -torch.log(-torch.log(u + _EPS) + _EPS).to(dtype)
        soft_quant = F.softmax((logits.to(dtype) * scale + noise) / temperature, dim=0)
        soft_output = (soft_quant * values.view(4, 1, 1)).sum(dim=0)
        return soft_quant, soft_output
    # The uniform sample becomes the noise in its own buffer; no name outlives its last read.
    noise = _draw_uniform(logits, replay).add_(_EPS).log_().neg_().add_(_EPS).log_().neg_().to(dtype)
    z = logits.to(dtype)
    z = z * scale if z is logits else z.mul_(scale)
    z.add_(noise)
    del noise
    soft_quant = F.softmax(z.div_(temperature), dim=0)
    del z
    soft_output = (soft_quant * values.view(4, 1, 1)).sum(dim=0)
    return soft_quant, soft_output


class GumbelSoftmax2Bit(torch.autograd.Function):
    """``apply(logits, scales, values, group_size, temperature, scale, variant)`` -> soft weight (out, in).

    ``logits`` (4, out, in) in any float dtype; ``scales`` (out, in // group_size); ``values`` the four codes
    in the compute dtype, which is also the output's dtype.
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        logits: torch.Tensor,
        scales: torch.Tensor,
        values: torch.Tensor,
        group_size: int,
        temperature: float,
        scale: float,
        variant: str,
    ) -> torch.Tensor:
        state = None if _is_fake(logits) else default_generator(logits.device).get_state()
        soft_quant, soft_output = _soft_assignment(logits, values, None, temperature, scale, variant)
        del soft_quant
        ctx.save_for_backward(logits, scales, values)
        ctx.rng_state = state  # type: ignore[attr-defined]
        ctx.config = (group_size, temperature, scale, variant)  # type: ignore[attr-defined]
        return _scale_columns(soft_output, scales, group_size, variant)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, scales, values = ctx.saved_tensors
        group_size, temperature, scale, variant = ctx.config
        state = ctx.rng_state
        if variant == "original":
            grads = _backward_original(
                grad_output, logits, scales, values, state, group_size, temperature, scale
            )
        else:
            grads = _backward_lean(grad_output, logits, scales, values, state, group_size, temperature, scale)
        return (*grads, None, None, None, None, None)


def _grad_scales(g_scale_per_col: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    # GSQ used scatter_add_ over idx; on CUDA that is atomics and not bitwise reproducible. Groups are
    # contiguous columns, so a grouped sum is the same sum in a fixed order on every device. Both variants
    # share this expression: a reduction's order may depend on its input dtype, so its input must match too.
    return _group_view(g_scale_per_col.to(scales.dtype), group_size).sum(dim=-1)


def _backward_original(
    grad_output: torch.Tensor,
    logits: torch.Tensor,
    scales: torch.Tensor,
    values: torch.Tensor,
    state: torch.Tensor | None,
    group_size: int,
    temperature: float,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    # GSQ's code as it was: every step out of place, every intermediate kept to the end of the function.
    dtype = values.dtype
    eps = _EPS
    u = _draw_uniform(logits, state)
    noise = -torch.log(-torch.log(u + eps) + eps).to(dtype)
    soft_quant = F.softmax((logits.to(dtype) * scale + noise) / temperature, dim=0)
    soft_output = (soft_quant * values.view(4, 1, 1)).sum(dim=0)

    scale_per_col = _scale_per_col(scales, group_size).to(dtype)

    g_scale_per_col = grad_output * soft_output
    grad_scales = _grad_scales(g_scale_per_col, scales, group_size)

    g_soft_output = grad_output * scale_per_col
    g_q = g_soft_output.unsqueeze(0) * values.view(4, 1, 1)

    dot = (g_q * soft_quant).sum(dim=0, keepdim=True)
    grad_z = soft_quant * (g_q - dot)
    grad_quant_logits = grad_z * scale / temperature
    return grad_quant_logits.to(logits.dtype), grad_scales


def _backward_lean(
    grad_output: torch.Tensor,
    logits: torch.Tensor,
    scales: torch.Tensor,
    values: torch.Tensor,
    state: torch.Tensor | None,
    group_size: int,
    temperature: float,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    soft_quant, soft_output = _soft_assignment(logits, values, state, temperature, scale, "lean")

    g_scale_per_col = grad_output * soft_output
    del soft_output
    grad_scales = _grad_scales(g_scale_per_col, scales, group_size)
    del g_scale_per_col

    g_soft_output = _scale_columns(grad_output, scales, group_size, "lean")
    g_q = g_soft_output.unsqueeze(0) * values.view(4, 1, 1)
    del g_soft_output

    dot = (g_q * soft_quant).sum(dim=0, keepdim=True)
    # The seed PR: g_q is a fresh local buffer, so the tail runs in it, in the original op order.
    # soft_quant * (g_q - dot) == (g_q - dot) * soft_quant bit for bit: IEEE multiplication commutes.
    g_q.sub_(dot)
    del dot
    g_q.mul_(soft_quant)
    del soft_quant
    # Two ops, not one mul by scale / temperature: folding them changes bf16 rounding.
    g_q.mul_(scale).div_(temperature)
    return g_q.to(logits.dtype), grad_scales


def gumbel_soft_weight(
    logits: torch.Tensor,
    scales: torch.Tensor,
    values: torch.Tensor,
    *,
    group_size: int,
    temperature: float,
    scale: float = 1.0,
    backward: str = "lean",
) -> torch.Tensor:
    """Functional form of :class:`GumbelSoftmax2Bit` (no shape checks; the module does those)."""
    check_variant(backward)
    out: torch.Tensor = GumbelSoftmax2Bit.apply(
        logits, scales, values, int(group_size), float(temperature), float(scale), backward
    )
    return out
