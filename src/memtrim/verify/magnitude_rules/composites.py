"""Rules for composite ops (softmax, norms, variance, losses, activations and their backward ops):
traced through their decompositions, so their budget is that of their steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from memtrim.verify.magnitude_rules.common import Args, Kwargs, aten
from memtrim.verify.magnitudes import NotTraceable, Tracer, register_magnitude_rule


# -- composites: traced through their decompositions ---------------------------------------------------
def _torch_decomposition(func: Any) -> Callable[..., Any]:
    from torch._decomp import decomposition_table  # private, read lazily: see the module docstring

    fn = decomposition_table.get(func)
    if fn is None:
        raise NotTraceable(str(func), "no decomposition in this torch")
    return fn


_DECOMPOSED = (
    aten._softmax,
    aten._log_softmax,
    aten._softmax_backward_data,
    aten._log_softmax_backward_data,
    aten._safe_softmax,
    aten.logsumexp,
    aten.native_layer_norm,
    aten.native_layer_norm_backward,
    aten.native_group_norm_backward,
    aten._fused_rms_norm,
    aten._fused_rms_norm_backward,
    aten.gelu,
    aten.gelu_backward,
    aten.silu,
    aten.silu_backward,
    aten.tanh_backward,
    aten.sigmoid_backward,
    aten.softplus,
    aten.softplus_backward,
    aten.elu,
    aten.elu_backward,
    aten.mish,
    aten.mish_backward,
    aten.hardswish,
    aten.hardswish_backward,
    aten.hardsigmoid,
    aten.hardsigmoid_backward,
    aten.leaky_relu,
    aten.leaky_relu_backward,
    aten.hardtanh_backward,
    aten.log_sigmoid_forward,
    aten.log_sigmoid_backward,
    aten.nll_loss_forward,
    aten.nll_loss_backward,
    aten.nll_loss2d_forward,
    aten.nll_loss2d_backward,
    aten.mse_loss,
    aten.mse_loss_backward,
    aten.smooth_l1_loss,
    aten.smooth_l1_loss_backward,
    aten.huber_loss,
    aten.huber_loss_backward,
    aten.binary_cross_entropy,
    aten.binary_cross_entropy_backward,
    aten.linalg_vector_norm,
    aten.lerp,
    aten.threshold,
    aten.xlogy,
    aten._scaled_dot_product_flash_attention_for_cpu,
)


@register_magnitude_rule(*_DECOMPOSED)
def _decomposed(tr: Tracer, func: Any, args: Args, kwargs: Kwargs) -> Any:
    return tr.redispatch(_torch_decomposition(func), *args, **kwargs)


def _var_dims(func: Any, args: Args, kwargs: Kwargs) -> tuple[Any, float, bool]:
    """(dims, correction, keepdim) of var/std/var_mean/std_mean, from the overload's schema."""
    bound = dict(zip((a.name for a in func._schema.arguments), args, strict=False)) | kwargs
    if "correction" in bound or func._overloadname == "correction":
        correction = bound.get("correction")
        correction = 1.0 if correction is None else float(correction)
    else:
        correction = 1.0 if bound.get("unbiased", True) else 0.0
    dims = bound.get("dim")
    if isinstance(dims, int):
        dims = [dims]
    if dims is not None and len(dims) == 0:
        dims = None
    return dims, correction, bool(bound.get("keepdim", False))


def _two_pass(x: torch.Tensor, dims: Any, correction: float, keepdim: bool) -> tuple[Any, Any]:
    # (variance, mean) as the two-pass formula: mean, deviations, sum of squares over N - correction.
    mean = torch.mean(x, dims, keepdim=True) if dims is not None else torch.mean(x).reshape([1] * x.dim())
    dev = x - mean
    n = x.numel() // max(mean.numel(), 1)
    ss = torch.sum(dev * dev, dims, keepdim=keepdim) if dims is not None else torch.sum(dev * dev)
    var = ss / max(n - correction, 0)
    if not keepdim:
        mean = mean.squeeze(dims) if dims is not None else mean.reshape(())
    return var, mean


@register_magnitude_rule(aten.var, aten.std, aten.var_mean, aten.std_mean)
def _variance(tr: Tracer, func: Any, args: Args, kwargs: Kwargs) -> Any:
    # Traced as the two-pass formula (PyTorch's own decomposition reaches a prim with no rule).
    dims, correction, keepdim = _var_dims(func, args, kwargs)
    var, mean = tr.redispatch(_two_pass, args[0], dims, correction, keepdim)
    packet = func.overloadpacket
    if packet in (aten.std, aten.std_mean):
        var = tr.redispatch(torch.sqrt, var)
    return (var, mean) if packet in (aten.var_mean, aten.std_mean) else var
