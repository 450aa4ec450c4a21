"""``GumbelQuantizer2Bit``: GSQ's learnable 2-bit quantizer for one weight matrix."""

from __future__ import annotations

import torch
from torch import nn

from .function import CODES, check_variant, gumbel_soft_weight

__all__ = ["GumbelQuantizer2Bit", "pack_2bit", "unpack_2bit"]


class GumbelQuantizer2Bit(nn.Module):
    """Learn, for each weight, logits over the codes ``{-2, -1, 0, 1}`` times a per-group scale.

    ``weight`` is ``(out, in)``; ``scales`` is ``(out, in // group_size)``, one per group of ``group_size``
    consecutive input columns. The compute (and soft-weight) dtype is ``weight.dtype``; the logits are stored
    in ``logits_dtype`` (default: ``weight.dtype``) and the scales in float32, as in GSQ.
    ``backward`` picks the backward variant: ``"lean"`` (in place, early frees) or ``"original"`` (GSQ's).
    """

    quant_logits: nn.Parameter
    scales: nn.Parameter
    values: torch.Tensor

    def __init__(
        self,
        weight: torch.Tensor,
        scales: torch.Tensor,
        *,
        group_size: int = 128,
        std: float = 0.01,
        strength: float = 6.0,
        logits_dtype: torch.dtype | None = None,
        backward: str = "lean",
    ) -> None:
        super().__init__()
        self.backward_variant = check_variant(backward)
        _check_shapes(weight, scales, group_size)
        logits_dtype = weight.dtype if logits_dtype is None else logits_dtype
        if not logits_dtype.is_floating_point:
            raise ValueError(
                f"logits_dtype must be a floating dtype such as torch.float32; got {logits_dtype}"
            )
        self.group_size = group_size
        out_features, in_features = weight.shape
        self.weight_shape = (out_features, in_features)

        with torch.no_grad():
            codes = torch.tensor(CODES, dtype=weight.dtype, device=weight.device)
            # GSQ's W / scales[:, idx] as a broadcast: the same quotients (advanced indexing would also
            # fail on fake CUDA tensors in a CPU-only torch).
            q = (weight.view(out_features, -1, group_size) / scales.unsqueeze(-1)).view(weight.shape)
            # Logits favour the codes near W / scale: a centred Gaussian log-likelihood, plus init noise.
            logits = -0.5 * (q.unsqueeze(0) - codes.view(4, 1, 1)) ** 2
            logits = logits - logits.mean(dim=0, keepdim=True)
            noise = torch.randn((4, out_features, in_features), dtype=q.dtype, device=q.device)
            quant_logits = std * (noise + logits * strength)

        self.register_buffer("values", codes, persistent=False)
        self.quant_logits = nn.Parameter(quant_logits.to(logits_dtype).detach())
        self.scales = nn.Parameter(scales.detach().float().clone())

    @property
    def out_features(self) -> int:
        return self.weight_shape[0]

    @property
    def in_features(self) -> int:
        return self.weight_shape[1]

    def forward(self, temperature: float, scale: float = 1.0) -> torch.Tensor:
        """The soft weight ``(out, in)`` for this temperature and logit scale, with fresh Gumbel noise."""
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 (the softmax divides by it); got {temperature}")
        return gumbel_soft_weight(
            self.quant_logits,
            self.scales,
            self.values,
            group_size=self.group_size,
            temperature=temperature,
            scale=scale,
            backward=self.backward_variant,
        )

    @torch.no_grad()
    def hard_codes(self) -> torch.Tensor:
        """int8 codes in ``{-2, -1, 0, 1}`` (argmax of the logits), shape ``(out, in)``."""
        return (self.quant_logits.argmax(dim=0) - 2).to(torch.int8)

    @torch.no_grad()
    def hard_weights(self) -> torch.Tensor:
        """The exported 2-bit weight: argmax code times its group's scale, in the compute dtype."""
        # values[argmax] without indexing: the codes are -2, -1, 0, 1 = index - 2, exact in every float dtype.
        codes = (self.quant_logits.argmax(dim=0) - 2).to(self.values.dtype)
        scales = self.scales.to(codes.dtype)
        return (codes.view(self.out_features, -1, self.group_size) * scales.unsqueeze(-1)).view(codes.shape)

    def extra_repr(self) -> str:
        return (
            f"out={self.out_features}, in={self.in_features}, group_size={self.group_size}, "
            f"logits_dtype={self.quant_logits.dtype}, backward={self.backward_variant!r}"
        )


def _check_shapes(weight: torch.Tensor, scales: torch.Tensor, group_size: int) -> None:
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(
            f"weight must be a 2-D floating matrix (out, in); got shape {tuple(weight.shape)}, {weight.dtype}"
        )
    in_features = weight.shape[1]
    if not isinstance(group_size, int) or group_size <= 0 or in_features % group_size != 0:
        raise ValueError(
            f"group_size={group_size!r} does not divide in={in_features}; pick a positive divisor of "
            f"{in_features} (e.g. {_largest_divisor(in_features, 128)})"
        )
    expected = (weight.shape[0], in_features // group_size)
    if tuple(scales.shape) != expected:
        raise ValueError(
            f"scales must have shape (out, in // group_size) = {expected}; got {tuple(scales.shape)}. "
            "Use one scale per group of group_size consecutive input columns, e.g. minmax_scales(weight, "
            "group_size)"
        )
    if scales.device != weight.device:
        raise ValueError(
            f"scales are on {scales.device} but weight is on {weight.device}; move them together"
        )


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


def pack_2bit(codes: torch.Tensor) -> torch.Tensor:
    """Pack int8 codes in ``{-2, -1, 0, 1}`` four to a byte (last dim must divide by 4)."""
    if codes.shape[-1] % 4 != 0:
        raise ValueError(
            f"the last dimension ({codes.shape[-1]}) must be a multiple of 4 to pack 2-bit codes"
        )
    u = (codes.to(torch.int16) + 2).to(torch.uint8).view(*codes.shape[:-1], -1, 4)
    return u[..., 0] | (u[..., 1] << 2) | (u[..., 2] << 4) | (u[..., 3] << 6)


def unpack_2bit(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_2bit`: int8 codes in ``{-2, -1, 0, 1}``."""
    parts = [(packed >> shift) & 3 for shift in (0, 2, 4, 6)]
    return (torch.stack(parts, dim=-1).flatten(-2).to(torch.int16) - 2).to(torch.int8)
