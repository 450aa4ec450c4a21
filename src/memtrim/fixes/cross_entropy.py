"""``chunked_linear_cross_entropy``: the loss of ``F.cross_entropy(hidden @ weight.T, target)`` without the
``[tokens, vocab]`` logits.

A language model's last two ops, ``logits = hidden @ weight.T`` and ``F.cross_entropy(logits, target)``,
hold four ``[tokens, vocab]`` buffers at the peak of an unfused training step: the logits, the saved
``log_softmax``, and two in backward (``nll_loss``'s and ``log_softmax``'s gradients). At GPT-2's
vocabulary that is 206 MB per 1024 tokens each, in fp32. This autograd Function holds one tile of
``chunk_size x vocab`` logits instead (see :func:`tiling` for its shape: all tokens by a block of the
vocabulary when that leaves at least 512 columns, else blocks of tokens):

* forward: per tile, the logits, an online log-sum-exp per token (its running max and log-sum are kept:
  8 bytes a token) and the target logits; the loss from those. Saved for backward: ``hidden``,
  ``weight``, ``bias``, ``target`` and the two per-token vectors, nothing of vocabulary size.
* backward: per tile, the logits again (recomputed: one more ``hidden @ weight_block.T`` per tile, the price
  of not keeping them, as Apple's Cut Cross-Entropy pays it on GPU), turned in place into
  ``(softmax - one_hot) * upstream``; then ``grad_hidden += g @ weight_block`` and the weight block's
  gradient ``g.T @ hidden`` (one matmul over all tokens when the tile spans them, so written once).

Numerics follow ``F.cross_entropy``: logits in the inputs' dtype (as ``hidden @ weight.T`` makes them),
the softmax arithmetic in fp32 for fp16/bf16 (fp64 stays fp64) as the unfused loss does under autocast,
log-probabilities grouped as ``log_softmax`` groups them, ``(z - max) - log(sum)``, and the logits'
gradient rounded to fp16/bf16 before the matmuls as the unfused backward rounds it. What chunking adds
(``grad_hidden`` summed over vocabulary blocks, the weight's gradient over token blocks) is summed in
fp32 for fp16/bf16: an fp32 ``[tokens, H]`` buffer during backward.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch

Reduction = Literal["mean", "sum", "none"]
REDUCTIONS: tuple[Reduction, ...] = ("mean", "sum", "none")
_HALF = (torch.float16, torch.bfloat16)

MIN_TILE_BYTES = 8 * 2**20
"""Smallest tile budget ``chunk_size=None`` uses (8 MiB), so small models still run in few chunks."""
TILE_FRACTION = 8
"""``chunk_size=None`` keeps one tile at most 1/TILE_FRACTION of the weight's bytes."""
CHUNK_MULTIPLE = 8
"""Chunks are a multiple of this many tokens (whole SIMD rows / tensor-core tiles)."""


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the softmax arithmetic (and the fp16/bf16 weight gradient) is accumulated in."""
    return torch.float32 if dtype in _HALF else dtype


def bytes_per_logit(dtype: torch.dtype) -> int:
    """Tile bytes per logit: the accumulation dtype's, plus the fp16/bf16 copy of the tile for the matmuls."""
    acc = accumulation_dtype(dtype).itemsize
    return acc + dtype.itemsize if dtype in _HALF else acc


def auto_chunk_size(tokens: int, vocab: int, hidden: int, dtype: torch.dtype) -> int:
    """The chunk ``chunk_size=None`` picks: tokens per tile, from a memory budget.

    Budget: ``max(weight bytes / 8, 8 MiB)``, where weight bytes ``= vocab * hidden * dtype size``. Backward
    must hold ``weight.grad`` (that many bytes) anyway, so a tile within 1/8 of it adds at most 12.5% to
    the loss's unavoidable memory however large the model. The chunk is the largest multiple of 8 tokens
    whose tile (``chunk * vocab * bytes_per_logit(dtype)``) fits the budget, at least 8, and at most
    ``tokens`` (one chunk when everything fits).

    >>> auto_chunk_size(1024, 50257, 768, torch.float32)   # GPT-2: a 96 x 50257 fp32 tile (19 MB)
    96
    >>> auto_chunk_size(8192, 128256, 4096, torch.bfloat16)   # Llama 3 8B, bf16
    168
    >>> auto_chunk_size(40, 1000, 64, torch.float32)   # everything fits in one tile
    40
    """
    if tokens <= 0:
        return 1
    weight_bytes = vocab * hidden * dtype.itemsize
    budget = max(weight_bytes // TILE_FRACTION, MIN_TILE_BYTES)
    rows = budget // max(vocab * bytes_per_logit(dtype), 1)
    chunk = max(CHUNK_MULTIPLE, rows // CHUNK_MULTIPLE * CHUNK_MULTIPLE)
    return int(min(chunk, tokens))


MIN_COLUMNS = 512
"""A tile spans all tokens when that leaves it at least this many vocabulary columns (see :func:`tiling`)."""


def tiling(tokens: int, vocab: int, chunk: int) -> tuple[int, int]:
    """``(rows, columns)`` of the tiles that hold ``chunk * vocab`` logits, the memory ``chunk_size`` buys.

    All tokens at once (``rows = tokens``), and as many vocabulary columns as fit, when that is at least
    :data:`MIN_COLUMNS` (or the whole vocabulary): each pass then reads the weight once, and the gradient
    accumulators that stay live across tiles are the small ``[tokens, H]`` one for ``hidden`` and one
    ``[columns, H]`` block of the weight's gradient, written once. Else ``rows`` tokens by
    :data:`MIN_COLUMNS` columns (at least ``chunk`` rows by the whole vocabulary).

    >>> tiling(1024, 50257, 96)     # GPT-2, 1024 tokens: all tokens x 4711 vocabulary columns
    (1024, 4711)
    >>> tiling(10**6, 50257, 96)    # a million tokens: 9423 tokens x 512 columns
    (9423, 512)
    """
    budget = chunk * vocab
    rows = tokens if tokens * min(vocab, MIN_COLUMNS) <= budget else max(chunk, budget // MIN_COLUMNS)
    return rows, min(vocab, budget // rows)


def _logits_into(
    out: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    if bias is None:
        return torch.mm(hidden, weight.t(), out=out)
    return torch.addmm(bias, hidden, weight.t(), out=out)


class _Tiles:
    """One tile's buffers, allocated once and reused: in the accumulation dtype and, for fp16/bf16, a copy
    in the inputs' dtype that the matmuls read and write."""

    def __init__(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> None:
        acc = accumulation_dtype(dtype)
        self.acc = torch.empty(rows * cols, dtype=acc, device=device)
        self.low = torch.empty(rows * cols, dtype=dtype, device=device) if acc != dtype else None

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``hidden @ weight.T (+ bias)`` in the accumulation dtype, in the tile (a contiguous view)."""
        shape = (hidden.shape[0], weight.shape[0])
        acc = self.acc[: shape[0] * shape[1]].view(shape)
        if self.low is None:
            return _logits_into(acc, hidden, weight, bias)
        return acc.copy_(_logits_into(self.low[: acc.numel()].view(shape), hidden, weight, bias))

    def in_input_dtype(self, g: torch.Tensor) -> torch.Tensor:
        return g if self.low is None else self.low[: g.numel()].view(g.shape).copy_(g)


def _apply_chain_(z: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
    """``z -> softcap * tanh(scale * z / softcap)`` (or ``scale * z`` without a softcap), in place: the
    elementwise chain a model applies between its lm_head and the loss (Gemma 2's final-logit softcap is
    ``scale=1``; a temperature ``T`` is ``scale=1/T``)."""
    if softcap is not None:
        return z.mul_(scale / softcap).tanh_().mul_(softcap)
    return z.mul_(scale) if scale != 1.0 else z


def _blocks(n: int, size: int) -> list[tuple[int, int]]:
    return [(start, min(start + size, n)) for start in range(0, n, size)]


def _target_in_block(safe: torch.Tensor, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's target as a column of the vocabulary block ``[start, stop)`` (clamped into it, for
    gather and scatter), and whether it really falls there."""
    local = safe - start
    inside = (local >= 0) & (local < stop - start)
    return local.clamp(0, stop - start - 1)[:, None], inside


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        target: torch.Tensor,
        chunk: int,
        ignore_index: int,
        reduction: Reduction,
        smoothing: float,
        out_dtype: torch.dtype,
        scale: float,
        softcap: float | None,
    ) -> torch.Tensor:
        tokens, vocab = hidden.shape[0], weight.shape[0]
        acc = accumulation_dtype(hidden.dtype)
        device = hidden.device
        valid = target != ignore_index
        safe = target.masked_fill(~valid, 0)
        # Online log-sum-exp over the vocabulary blocks, per token: sum_exp is relative to ref (the
        # running max where finite, else 0, as torch.logsumexp treats infinite maxima).
        top = torch.full((tokens,), -math.inf, dtype=acc, device=device)
        ref = torch.zeros(tokens, dtype=acc, device=device)
        sum_exp = torch.zeros(tokens, dtype=acc, device=device)
        z_target = torch.zeros(tokens, dtype=acc, device=device)
        z_sum = torch.zeros(tokens, dtype=acc, device=device) if smoothing else None
        if tokens:
            rows, cols = tiling(tokens, vocab, chunk)
            tiles = _Tiles(rows, cols, hidden.dtype, device)
            for v0, v1 in _blocks(vocab, cols):
                w, b = weight[v0:v1], None if bias is None else bias[v0:v1]
                for r0, r1 in _blocks(tokens, rows):
                    z = _apply_chain_(tiles.logits(hidden[r0:r1], w, b), scale, softcap)
                    column, inside = _target_in_block(safe[r0:r1], v0, v1)
                    z_target[r0:r1] += z.gather(1, column).squeeze(1).masked_fill_(~inside, 0.0)
                    if z_sum is not None:
                        z_sum[r0:r1] += z.sum(1)
                    block_top = torch.maximum(top[r0:r1], z.amax(1))
                    new_ref = block_top.masked_fill(block_top.isinf(), 0.0)
                    z.sub_(new_ref[:, None]).exp_()
                    # rescale the sum so far to the new reference (exponent <= 0: where nothing finite
                    # was seen yet the sum is 0 and must not become 0 * inf)
                    rescale = (ref[r0:r1] - new_ref).clamp_(max=0.0).exp_()
                    sum_exp[r0:r1] = sum_exp[r0:r1] * rescale + z.sum(1)
                    top[r0:r1], ref[r0:r1] = block_top, new_ref
        # log_softmax's own grouping, (z - max) - log(sum): more accurate than z - (max + log(sum))
        log_sum = sum_exp.log_()
        rows_loss = (ref - z_target).add_(log_sum)
        if z_sum is not None:
            smooth = (ref - z_sum / vocab).add_(log_sum)
            rows_loss = (1.0 - smoothing) * rows_loss + smoothing * smooth
        rows_loss.masked_fill_(~valid, 0.0)
        count = valid.sum()
        ctx.save_for_backward(hidden, weight, bias, target, ref, log_sum, count)
        ctx.config = (chunk, ignore_index, reduction, smoothing, scale, softcap)
        if reduction == "none":
            return rows_loss.to(out_dtype)
        total = rows_loss.sum()
        return (total / count if reduction == "mean" else total).to(out_dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, target, ref, log_sum, count = ctx.saved_tensors
        chunk, ignore_index, reduction, smoothing, scale, softcap = ctx.config
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        with torch.autocast(hidden.device.type, enabled=False):
            grads = _backward(
                hidden,
                weight,
                bias,
                target,
                ref,
                log_sum,
                count,
                grad_out,
                chunk,
                ignore_index,
                reduction,
                smoothing,
                need_hidden,
                need_weight,
                need_bias,
                scale,
                softcap,
            )
        return (*grads, None, None, None, None, None, None, None, None)


def _backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    ref: torch.Tensor,
    log_sum: torch.Tensor,
    count: torch.Tensor,
    grad_out: torch.Tensor,
    chunk: int,
    ignore_index: int,
    reduction: Reduction,
    smoothing: float,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
    logit_scale: float = 1.0,
    softcap: float | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients tile by tile: ``g = (softmax - (1 - eps) * one_hot - eps / vocab) * upstream`` per tile,
    ``grad_hidden += g @ weight_block`` and ``grad_weight_block (+)= g.T @ hidden_rows``."""
    tokens, vocab = hidden.shape[0], weight.shape[0]
    dtype, acc = hidden.dtype, accumulation_dtype(hidden.dtype)
    valid = target != ignore_index
    safe = target.masked_fill(~valid, 0)
    upstream = grad_out.to(acc)
    if reduction == "mean":
        upstream = upstream / count
    # d loss / d (each token's loss): 0 where ignored, so nothing flows from those tokens
    scale = torch.where(valid, upstream.expand(tokens), torch.zeros((), dtype=acc, device=ref.device))
    grad_hidden = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_hidden else None
    grad_weight = None
    if need_weight:  # every block is written below; with no tokens nothing contributes
        grad_weight = (torch.empty_like if tokens else torch.zeros_like)(
            weight, memory_format=torch.contiguous_format
        )
    grad_bias = torch.zeros(vocab, dtype=acc, device=ref.device) if need_bias else None
    if tokens:
        rows, cols = tiling(tokens, vocab, chunk)
        tiles = _Tiles(rows, cols, dtype, hidden.device)
        # the softcap's derivative, scale * (1 - tanh^2), per logit: a second tile (in the accumulation dtype)
        chain_grad = (
            torch.empty(rows * cols, dtype=acc, device=hidden.device) if softcap is not None else None
        )
        row_blocks = _blocks(tokens, rows)
        # more than one row block: a block of the weight's gradient sums over them, in the accumulation dtype
        block_acc = (
            torch.empty(cols, weight.shape[1], dtype=acc, device=weight.device)
            if need_weight and len(row_blocks) > 1
            else None
        )
        for v0, v1 in _blocks(vocab, cols):
            w, b = weight[v0:v1], None if bias is None else bias[v0:v1]
            if block_acc is not None:
                block_acc[: v1 - v0].zero_()
            for r0, r1 in row_blocks:
                s = scale[r0:r1, None]
                g = tiles.logits(hidden[r0:r1], w, b)
                d = None
                if softcap is not None and chain_grad is not None:
                    g.mul_(logit_scale / softcap).tanh_()
                    d = torch.mul(g, g, out=chain_grad[: g.numel()].view(g.shape))
                    d.neg_().add_(1.0).mul_(logit_scale)
                    g.mul_(softcap)
                elif logit_scale != 1.0:
                    g.mul_(logit_scale)
                g.sub_(ref[r0:r1, None]).sub_(log_sum[r0:r1, None]).exp_().mul_(s)  # softmax * upstream
                column, inside = _target_in_block(safe[r0:r1], v0, v1)
                g.scatter_add_(1, column, (s * -(1.0 - smoothing)).masked_fill_(~inside[:, None], 0.0))
                if smoothing:
                    g.sub_(s * (smoothing / vocab))
                if d is not None:  # through the chain: d loss / d raw logit
                    g.mul_(d)
                elif logit_scale != 1.0:
                    g.mul_(logit_scale)
                g_in = tiles.in_input_dtype(g)  # rounded to fp16/bf16, as the unfused loss's gradient is
                if grad_hidden is not None:
                    if g_in is g:
                        grad_hidden[r0:r1].addmm_(g, w)
                    else:
                        grad_hidden[r0:r1] += torch.mm(g_in, w)
                if grad_weight is not None:
                    if block_acc is None:  # one row block: this block's gradient in one matmul, one rounding
                        torch.mm(g_in.t(), hidden[r0:r1], out=grad_weight[v0:v1])
                    else:
                        block_acc[: v1 - v0].addmm_(g.t(), hidden[r0:r1].to(acc))
                if grad_bias is not None:
                    grad_bias[v0:v1] += g.sum(0)
            if grad_weight is not None and block_acc is not None:
                grad_weight[v0:v1].copy_(block_acc[: v1 - v0])
    return (
        None if grad_hidden is None else grad_hidden.to(dtype),
        grad_weight,
        None if grad_bias is None or bias is None else grad_bias.to(bias.dtype),
    )


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_size: int | None = None,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    label_smoothing: float = 0.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    upcast: bool = False,
) -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight.T + bias, target, ...)`` without materialising the logits.

    ``logit_scale`` and ``softcap``: the elementwise chain between the matmul and the loss, applied per
    tile in the accumulation dtype: ``logits * logit_scale`` (a temperature ``T`` is ``1/T``), then with a
    softcap ``softcap * tanh(logits / softcap)`` (Gemma 2's ``final_logit_softcapping``). Plain
    ``(h @ W.T / T).tanh() * c`` is ``logit_scale=c/T, softcap=c``. A scale on the *hidden* states (T5's
    ``d_model**-0.5``) is a scale of the logits too. With a softcap, backward holds a second tile (its
    derivative). ``upcast``: return the loss in fp32 (as HF's losses ``.float()`` the logits).

    ``hidden``: ``[..., H]`` (any leading dims, flattened to tokens); ``weight``: ``[vocab, H]`` (an
    ``nn.Linear`` 's or a tied embedding's weight); ``target``: integer class indices shaped like
    ``hidden.shape[:-1]``; ``bias``: ``[vocab]`` or None. ``ignore_index``, ``reduction`` (``"mean"`` over
    the tokens not ignored, ``"sum"``, ``"none"``: per token, shaped like ``target``, 0 where ignored) and
    ``label_smoothing`` mean what they mean in ``F.cross_entropy``; an empty batch gives what it gives
    (nan for the mean). Gradients flow to ``hidden``, ``weight`` and ``bias``; not twice-differentiable.

    ``chunk_size``: the memory of one tile, in tokens: a tile holds ``chunk_size * vocab`` logits (laid out
    as :func:`tiling` says: all tokens by a block of the vocabulary where it can). None picks it from a
    budget (:func:`auto_chunk_size`: a tile within 1/8 of the weight's bytes, at least 8 MiB). Peak
    memory of forward + backward is then about ``weight.grad`` + ``hidden.grad`` + one tile, instead of
    three or four ``[tokens, vocab]`` buffers; each tile's logits are computed twice (forward and
    backward), a third more matmul work than the unfused loss.

    Under ``torch.autocast`` it computes as ``hidden @ weight.T`` then ``F.cross_entropy`` would there:
    logits in the autocast dtype, the loss in fp32.

    >>> h = torch.randn(4, 8, 16, requires_grad=True)     # [batch, seq, hidden]
    >>> W = torch.randn(100, 16, requires_grad=True)      # [vocab, hidden]
    >>> y = torch.randint(0, 100, (4, 8))
    >>> loss = chunked_linear_cross_entropy(h, W, y, chunk_size=8)
    >>> ref = torch.nn.functional.cross_entropy((h @ W.T).flatten(0, 1), y.flatten())
    >>> bool(torch.allclose(loss, ref, rtol=1e-5))
    True
    """
    _check(hidden, weight, target, bias, chunk_size, reduction, label_smoothing)
    if softcap is not None and not float(softcap) > 0.0:
        raise ValueError(f"softcap must be a positive number or None, got {softcap}")
    out_dtype = torch.promote_types(hidden.dtype, torch.float32) if upcast else hidden.dtype
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):  # as autocast would cast the matmul's operands
        low = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(low), weight.to(low)
        bias = None if bias is None else bias.to(low)
        out_dtype = torch.float32
    lead = target.shape
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_target = target.reshape(-1).long()
    tokens, vocab = flat_hidden.shape[0], weight.shape[0]
    _check_targets(flat_target, vocab, ignore_index)
    chunk = chunk_size or auto_chunk_size(tokens, vocab, weight.shape[1], flat_hidden.dtype)
    with torch.autocast(device_type, enabled=False):
        loss = _ChunkedLinearCrossEntropy.apply(
            flat_hidden,
            weight,
            bias,
            flat_target,
            chunk,
            ignore_index,
            reduction,
            float(label_smoothing),
            out_dtype,
            float(logit_scale),
            None if softcap is None else float(softcap),
        )
    return loss.view(lead) if reduction == "none" else loss


def _check(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    chunk_size: int | None,
    reduction: str,
    label_smoothing: float,
) -> None:
    for name, t in (("hidden", hidden), ("weight", weight), ("target", target), ("bias", bias)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, not {type(t).__name__}")
    if not hidden.is_floating_point() or not weight.is_floating_point():
        raise TypeError(
            f"hidden and weight must be floating point, got {hidden.dtype} and {weight.dtype}; pass the "
            "hidden states before the lm_head and the lm_head's weight"
        )
    if hidden.dim() < 1 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} do not fit hidden @ weight.T: "
            "weight must be [vocab, H] (an nn.Linear's .weight) and hidden [..., H]"
        )
    if weight.shape[0] == 0:
        raise ValueError("weight has no rows: cross-entropy needs at least one class (vocab >= 1)")
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(
            f"target must hold integer class indices, not {target.dtype}; class probabilities (soft "
            "targets) are not supported: use F.cross_entropy for those"
        )
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"target {tuple(target.shape)} must be shaped like hidden without its last dim "
            f"{tuple(hidden.shape[:-1])}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} must be [vocab] = ({weight.shape[0]},)")
    tensors = [t for t in (hidden, weight, target, bias) if t is not None]
    if len({t.device for t in tensors}) > 1:
        raise ValueError(
            "hidden, weight, target and bias must be on one device, got "
            + ", ".join(f"{t.device}" for t in tensors)
        )
    if not torch.is_autocast_enabled(hidden.device.type):
        floats = [("hidden", hidden), ("weight", weight)] + ([("bias", bias)] if bias is not None else [])
        if len({t.dtype for _, t in floats}) > 1:
            raise TypeError(
                "hidden, weight and bias must share a dtype (as hidden @ weight.T requires), got "
                + ", ".join(f"{n} {t.dtype}" for n, t in floats)
                + "; cast them, or run under torch.autocast"
            )
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)):
        raise TypeError(f"chunk_size must be an int or None, not {type(chunk_size).__name__}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1 (tokens per tile), got {chunk_size}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, not {reduction!r}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")


def is_fake(t: torch.Tensor) -> bool:
    """A tensor without values: a ``FakeTensorMode`` tensor (``memtrim.track(fake=True)``) or a meta one."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) or t.device.type == "meta"


def _check_targets(target: torch.Tensor, vocab: int, ignore_index: int) -> None:
    # One host sync (on CUDA): an out-of-range target would otherwise gather garbage or trap the device.
    if is_fake(target):
        return  # no values to check: a measurement of a full-size step without allocating it
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if bool(bad.any()):
        value = int(target[bad][0])
        raise IndexError(
            f"target {value} is out of bounds for a vocabulary of {vocab} (ignore_index={ignore_index}); "
            "targets must be class indices in [0, vocab) or ignore_index"
        )


def causal_lm_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    num_items_in_batch: int | torch.Tensor | None = None,
    shift: bool = True,
    ignore_index: int = -100,
    bias: torch.Tensor | None = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """The loss a transformers causal LM computes from ``labels``, chunked: what ``ForCausalLMLoss`` does
    with ``lm_head(hidden)`` (labels shifted left by one, the last position padded with ``ignore_index``,
    logits upcast to fp32, the mean over the tokens not ignored, or the sum divided by
    ``num_items_in_batch`` when given), without the ``[tokens, vocab]`` logits. ``shift=False`` for labels
    already aligned with ``hidden`` (encoder-decoder models, ``shift_labels``).

    >>> h = torch.randn(2, 6, 16, requires_grad=True); W = torch.randn(50, 16)
    >>> y = torch.randint(0, 50, (2, 6))
    >>> ref = torch.nn.functional.cross_entropy((h[:, :-1] @ W.T).flatten(0, 1), y[:, 1:].flatten())
    >>> bool(torch.allclose(causal_lm_cross_entropy(h, W, y), ref, rtol=1e-5))
    True
    """
    if shift:
        labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    labels = labels.to(hidden.device)
    reduction: Reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = chunked_linear_cross_entropy(
        hidden,
        weight,
        labels,
        bias=bias,
        chunk_size=chunk_size,
        ignore_index=ignore_index,
        reduction=reduction,
        logit_scale=logit_scale,
        softcap=softcap,
        upcast=True,
    )
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss
