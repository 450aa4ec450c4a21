"""Per-head attention results: ``result[..., h, m] = sum_d z[..., h, d] * W_O[h, d, m]`` (seed 001).

Mechanistic-interpretability code decomposes an attention layer's output into each head's
contribution. The common implementation broadcasts ``z[..., None] * W_O`` and sums over ``d_head``:
for GPT-2 small at 512 tokens that builds a 1,208 MB temporary for a 19 MB result, and its backward
builds one more of the same size per input that needs a gradient. ``head_results`` contracts with einsum
instead (one batched matmul over heads), which never materialises the broadcast product.

>>> z = torch.randn(512, 12, 64)            # [pos, head, d_head], or [batch, pos, head, d_head]
>>> W_O = torch.randn(12, 64, 768)          # [head, d_head, d_model]
>>> head_results(z, W_O).shape
torch.Size([512, 12, 768])
"""

from __future__ import annotations

import contextlib

import torch


def _check_shapes(z: torch.Tensor, W_O: torch.Tensor) -> None:
    if W_O.dim() != 3:
        raise ValueError(f"W_O must be [head, d_head, d_model]; got shape {list(W_O.shape)}")
    if z.dim() < 2 or tuple(z.shape[-2:]) != tuple(W_O.shape[:2]):
        raise ValueError(
            f"z must end in [head, d_head] = {list(W_O.shape[:2])} to match W_O; got z of shape "
            f"{list(z.shape)} (expected [..., pos, head, d_head])"
        )


def result_dtype(z: torch.Tensor, W_O: torch.Tensor) -> torch.dtype:
    """The dtype ``head_results_broadcast`` returns: the promoted one, int64 for integers and bools.

    The multiply promotes (fp16 ``z`` with fp32 ``W_O`` gives fp32; integer ``z`` with fp16 ``W_O``
    gives fp16) and ``sum`` turns bool and integer products into int64.
    """
    dtype = torch.promote_types(z.dtype, W_O.dtype)
    if dtype.is_floating_point or dtype.is_complex:
        return dtype
    return torch.int64


def _autocast_off(device_type: str) -> contextlib.AbstractContextManager[object]:
    """Turn autocast off for the contraction, so that it runs in the dtype the original's ops run in.

    ``mul`` and ``sum`` are not autocast ops, so the original computes (and returns) the promoted dtype
    under autocast; the einsum's batched matmul is one, and would otherwise run in bf16/fp16 and return
    it: a different dtype and far less accurate than the original.
    """
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def head_results_broadcast(z: torch.Tensor, W_O: torch.Tensor) -> torch.Tensor:
    """The original: broadcast multiply, then sum over d_head. Kept as the reference of what not to do.

    Allocates a ``[..., head, d_head, d_model]`` temporary, ``d_head`` times the result (and, in backward,
    one more of that size per input that needs a gradient).
    """
    _check_shapes(z, W_O)
    return (z[..., None] * W_O).sum(-2)


def head_results(z: torch.Tensor, W_O: torch.Tensor) -> torch.Tensor:
    """Each head's contribution to the residual stream, ``[..., head, d_model]``, without the temporary.

    A drop-in replacement for :func:`head_results_broadcast`:

    - ``z`` is ``[..., pos, head, d_head]`` with any number of leading dims (batched or batchless);
      ``W_O`` is ``[head, d_head, d_model]``. Non-contiguous, expanded and empty inputs are fine.
    - The result has the dtype the original returns (:func:`result_dtype`): mixed dtypes promote (fp16
      ``z`` with fp32 ``W_O`` gives fp32); integers and bools give int64, computed exactly in int64.
    - Under autocast it computes in that dtype too, as the original's ``mul`` and ``sum`` do, rather than
      in autocast's lower precision.
    - Differentiable to any order in both inputs.

    Memory: never the ``d_head``-times-larger product. Temporaries are at most the size of an input (in
    the result dtype) or of the result: a copy of ``z`` or ``W_O`` when its dtype or layout needs one, and
    in backward the batched matmul's output for ``z``'s gradient (measured: none in forward for
    same-dtype inputs).

    Numerics: each element is the same sum of ``d_head`` products in another order. For fp16/bf16 the
    CPU kernels form the products and accumulate them in fp32 and round once, where the original rounds
    every product to fp16/bf16 before its fp32 sum; ``memtrim.verify`` (reference mode, float64 oracle)
    finds it no less accurate than the original for outputs and both gradients (tests/test_heads.py).

    Layout: the result is a permuted view of the batched matmul's ``[head, ..., d_model]`` output, so it
    is not contiguous (strides differ from the original's; values, shape and dtype do not). ``.reshape``
    works as before; call ``.contiguous()`` before ``.view`` if you need one (it costs a copy the size
    of the result, which is what this function avoids allocating).
    """
    _check_shapes(z, W_O)
    dtype = result_dtype(z, W_O)
    with _autocast_off(z.device.type):
        return torch.einsum("...hd,hdm->...hm", z.to(dtype), W_O.to(dtype))
