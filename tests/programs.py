"""Small programs shared by several test files."""

from __future__ import annotations

import torch


class ScaledDifference(torch.autograd.Function):
    """Backward written the out-of-place way: three temporaries the size of the gradient."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, d)
        return x * 2

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        s, d = ctx.saved_tensors  # type: ignore[attr-defined]
        a = g - d
        b = s * a
        c = b * 3.0
        return c, None
