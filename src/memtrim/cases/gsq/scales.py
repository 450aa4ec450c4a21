"""Per-group scales for the 2-bit codebook ``{-2, -1, 0, 1}`` and the round-to-nearest baseline."""

from __future__ import annotations

import torch

__all__ = ["minmax_scales", "mse_scales", "rtn_2bit"]

_LOW, _HIGH = -2.0, 1.0


def _groups(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    out_features, in_features = weight.shape
    if in_features % group_size != 0:
        raise ValueError(f"group_size={group_size} does not divide in={in_features}; pick a divisor")
    return weight.float().view(out_features, in_features // group_size, group_size)


def minmax_scales(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """Smallest scale per group that puts every ``W / scale`` inside ``[-2, 1]``: ``(out, in // group)``."""
    g = _groups(weight, group_size)
    lo = (g.amin(dim=-1) / _LOW).clamp_min(0)
    hi = (g.amax(dim=-1) / _HIGH).clamp_min(0)
    return torch.maximum(lo, hi).clamp_min(torch.finfo(torch.float32).tiny)


def rtn_2bit(weight: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """Round-to-nearest 2-bit weights ``clamp(round(W / s), -2, 1) * s``, in float32."""
    g = _groups(weight, group_size)
    s = scales.float().unsqueeze(-1)
    return ((g / s).round().clamp(_LOW, _HIGH) * s).view(weight.shape)


def mse_scales(weight: torch.Tensor, group_size: int, grid: int = 40, lowest: float = 0.3) -> torch.Tensor:
    """Per group, the shrink of the min-max scale (from ``lowest`` to 1 in ``grid`` steps) whose
    round-to-nearest weights have the least squared error."""
    g = _groups(weight, group_size)
    base = minmax_scales(weight, group_size)
    best_err = torch.full_like(base, float("inf"))
    best = base.clone()
    for shrink in torch.linspace(lowest, 1.0, grid).tolist():
        s = (base * shrink).unsqueeze(-1)
        err = ((g / s).round().clamp(_LOW, _HIGH) * s - g).square().sum(dim=-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, base * shrink, best)
    return best
