"""The acceptance corpus of memtrim.verify (issue 13): rewrites people make, correct and wrong.

``CORRECT`` maps a name to ``(reference, candidate, inputs)``: each must pass in fp64/fp32/fp16/bf16, every
default layout and three seeds. ``WRONG`` maps a name to ``(reference, candidate, inputs, needle, kwargs)``:
each must fail, and its first failure must contain ``needle`` (what is wrong, named). Shapes are small so
the whole corpus runs in CI. ``inputs`` is a zero-argument function giving example tensors (verify redraws
their values per seed) or a builder ``(dtype, device, seed)`` for inputs that need structure.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

Tensor = torch.Tensor
IGNORE = -100


def r(*shape: int) -> Tensor:
    return torch.randn(*shape, requires_grad=True)


# -- softmax and friends ---------------------------------------------------------------------------
def softmax(x: Tensor) -> Tensor:
    return torch.softmax(x, -1)


def softmax_manual(x: Tensor) -> Tensor:
    m = x.amax(-1, keepdim=True)
    e = (x - m).exp()
    return e / e.sum(-1, keepdim=True)


def softmax_online(x: Tensor, chunk: int = 3) -> Tensor:
    """One pass over chunks with a running max and a rescaled running sum (FlashAttention's form)."""
    m = torch.full((*x.shape[:-1], 1), -math.inf, dtype=x.dtype, device=x.device)
    total = torch.zeros_like(m)
    for c in x.split(chunk, -1):
        m_new = torch.maximum(m, c.amax(-1, keepdim=True))
        total = total * (m - m_new).exp() + (c - m_new).exp().sum(-1, keepdim=True)
        m = m_new
    return (x - m).exp() / total


def softmax_online_no_rescale(x: Tensor, chunk: int = 3) -> Tensor:
    m = torch.full((*x.shape[:-1], 1), -math.inf, dtype=x.dtype, device=x.device)
    total = torch.zeros_like(m)
    for c in x.split(chunk, -1):
        m_new = torch.maximum(m, c.amax(-1, keepdim=True))
        total = total + (c - m_new).exp().sum(-1, keepdim=True)  # forgets exp(m - m_new)
        m = m_new
    return (x - m).exp() / total


def softmax_temperature(x: Tensor) -> Tensor:
    return torch.softmax(x / 0.7, -1)


def softmax_temperature_manual(x: Tensor) -> Tensor:
    return softmax_manual(x * (1 / 0.7))


def log_softmax(x: Tensor) -> Tensor:
    return torch.log_softmax(x, -1)


def log_softmax_manual(x: Tensor) -> Tensor:
    return x - torch.logsumexp(x, -1, keepdim=True)


def logsumexp(x: Tensor) -> Tensor:
    return torch.logsumexp(x, -1)


def logsumexp_manual(x: Tensor) -> Tensor:
    m = x.amax(-1, keepdim=True)
    return (m + (x - m).exp().sum(-1, keepdim=True).log()).squeeze(-1)


def logsumexp_chunked(x: Tensor, chunk: int = 3) -> Tensor:
    return torch.logsumexp(torch.stack([torch.logsumexp(c, -1) for c in x.split(chunk, -1)], -1), -1)


def logsumexp_overlapping_chunks(x: Tensor, chunk: int = 3) -> Tensor:
    starts = range(0, x.shape[-1], chunk)
    parts = [torch.logsumexp(x[..., max(i - 1, 0) : i + chunk], -1) for i in starts]  # off by one
    return torch.logsumexp(torch.stack(parts, -1), -1)


def logsumexp_skipping_chunks(x: Tensor, chunk: int = 3) -> Tensor:
    starts = range(0, x.shape[-1], chunk)
    parts = [torch.logsumexp(x[..., i + (i > 0) : i + chunk], -1) for i in starts]  # off by one
    return torch.logsumexp(torch.stack(parts, -1), -1)


def logsumexp_without_max(x: Tensor) -> Tensor:
    m = x.amax(-1, keepdim=True)
    return (x - m).exp().sum(-1).log()  # forgets to add m back


# -- variance and norms -------------------------------------------------------------------------------
def var(x: Tensor) -> Tensor:
    return x.var(-1)


def var_two_pass(x: Tensor) -> Tensor:
    d = x - x.mean(-1, keepdim=True)
    return (d * d).sum(-1) / (x.shape[-1] - 1)


def var_biased(x: Tensor) -> Tensor:
    d = x - x.mean(-1, keepdim=True)
    return (d * d).mean(-1)  # divides by n, not n - 1


def var_one_pass(x: Tensor) -> Tensor:
    n = x.shape[-1]
    return ((x * x).mean(-1) - x.mean(-1) ** 2) * n / (n - 1)  # E[x^2] - E[x]^2: cancels


def far_from_zero(dtype: torch.dtype, device: torch.device, seed: int) -> tuple[Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 64, generator=g, dtype=torch.float64) + 300  # mean 300, variance 1
    return (x.to(dtype=dtype, device=device).requires_grad_(),)


def std(x: Tensor) -> Tensor:
    return x.std(-1)


def std_manual(x: Tensor) -> Tensor:
    return var_two_pass(x).sqrt()


def var_mean(x: Tensor) -> tuple[Tensor, Tensor]:
    return torch.var_mean(x, -1)


def var_mean_manual(x: Tensor) -> tuple[Tensor, Tensor]:
    return var_two_pass(x), x.mean(-1)


def layer_norm(x: Tensor, w: Tensor, b: Tensor) -> Tensor:
    return F.layer_norm(x, (x.shape[-1],), w, b, eps=1e-5)


def layer_norm_manual(x: Tensor, w: Tensor, b: Tensor, eps: float = 1e-5) -> Tensor:
    d = x - x.mean(-1, keepdim=True)
    return d * torch.rsqrt((d * d).mean(-1, keepdim=True) + eps) * w + b


def layer_norm_eps_1e6(x: Tensor, w: Tensor, b: Tensor) -> Tensor:
    return layer_norm_manual(x, w, b, eps=1e-6)


def layer_norm_without_bias(x: Tensor, w: Tensor, b: Tensor) -> Tensor:
    d = x - x.mean(-1, keepdim=True)  # b unused: its gradient is missing
    return d * torch.rsqrt((d * d).mean(-1, keepdim=True) + 1e-5) * w


def layer_norm_over_rows(x: Tensor, w: Tensor, b: Tensor) -> Tensor:
    d = x - x.mean(0, keepdim=True)  # normalises over the wrong dim
    return d * torch.rsqrt((d * d).mean(0, keepdim=True) + 1e-5) * w + b


def rms_norm(x: Tensor, w: Tensor) -> Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, eps=1e-6)


def rms_norm_manual(x: Tensor, w: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rms_norm_eps_1e5(x: Tensor, w: Tensor) -> Tensor:
    return rms_norm_manual(x, w, eps=1e-5)


def norm_inputs() -> tuple[Tensor, Tensor, Tensor]:
    return r(4, 8), r(8), r(8)


# -- activations ------------------------------------------------------------------------------------
def gelu(x: Tensor) -> Tensor:
    return F.gelu(x)


def gelu_manual(x: Tensor) -> Tensor:
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


def gelu_tanh_manual(x: Tensor) -> Tensor:
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def silu_manual(x: Tensor) -> Tensor:
    return x * torch.sigmoid(x)


def silu_doubled(x: Tensor) -> Tensor:
    return x * torch.sigmoid(2 * x)


def sigmoid_manual(x: Tensor) -> Tensor:
    return 1 / (1 + torch.exp(-x))


def softplus_manual(x: Tensor) -> Tensor:
    return torch.log1p(torch.exp(x))


def relu(x: Tensor) -> Tensor:
    return torch.relu(x)


def relu_by_mask(x: Tensor) -> Tensor:
    return x * (x > 0)  # -0.0 where x < 0: equal values, other bits


# -- products -----------------------------------------------------------------------------------------
def chain_left(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    return (a @ b) @ c


def chain_right(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    return a @ (b @ c)


def head_results_broadcast(z: Tensor, W: Tensor) -> Tensor:
    return (z[..., None] * W).sum(-2)


def head_results_einsum(z: Tensor, W: Tensor) -> Tensor:
    return torch.einsum("...hd,hdm->...hm", z, W)


def linear(x: Tensor, W: Tensor, b: Tensor) -> Tensor:
    return F.linear(x, W, b)


def linear_unfused(x: Tensor, W: Tensor, b: Tensor) -> Tensor:
    return x @ W.T + b


def addmm(b: Tensor, x: Tensor, W: Tensor) -> Tensor:
    return torch.addmm(b, x, W)


def addmm_unfused(b: Tensor, x: Tensor, W: Tensor) -> Tensor:
    return x @ W + b


# -- attention ------------------------------------------------------------------------------------
def sdpa(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v)


def sdpa_causal(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def attention_manual(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1) @ v


def attention_manual_causal(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    return torch.softmax(s.masked_fill(~keep, -math.inf), -1) @ v


def attention_without_scale(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return torch.softmax(q @ k.transpose(-1, -2), -1) @ v


def qkv() -> tuple[Tensor, Tensor, Tensor]:
    return r(2, 2, 5, 4), r(2, 2, 5, 4), r(2, 2, 5, 4)


# -- cross-entropy ---------------------------------------------------------------------------------
def cross_entropy(h: Tensor, W: Tensor, t: Tensor) -> Tensor:
    return F.cross_entropy(h @ W.T, t, ignore_index=IGNORE)


def cross_entropy_chunked(h: Tensor, W: Tensor, t: Tensor, chunk: int = 3) -> Tensor:
    """The standard fix for full-vocab logits: logits and log-softmax per chunk of tokens."""
    total = h.new_zeros(())
    for hc, tc in zip(h.split(chunk), t.split(chunk), strict=True):
        logp = torch.log_softmax(hc @ W.T, -1)
        picked = logp.gather(-1, tc.clamp_min(0)[:, None]).squeeze(-1)
        total = total - (picked * (tc != IGNORE)).sum()
    return total / (t != IGNORE).sum()


def cross_entropy_chunked_keeps_ignored(h: Tensor, W: Tensor, t: Tensor, chunk: int = 3) -> Tensor:
    total = h.new_zeros(())
    for hc, tc in zip(h.split(chunk), t.split(chunk), strict=True):
        logp = torch.log_softmax(hc @ W.T, -1)
        total = total - logp.gather(-1, tc.clamp_min(0)[:, None]).sum()  # ignore_index dropped
    return total / t.numel()


def cross_entropy_chunked_counts_ignored(h: Tensor, W: Tensor, t: Tensor) -> Tensor:
    return cross_entropy_chunked(h, W, t) * (t != IGNORE).sum() / t.numel()  # mean over all tokens


def token_inputs(dtype: torch.dtype, device: torch.device, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(7, 5, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)
    W = torch.randn(6, 5, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)
    t = torch.randint(0, 6, (7,), generator=g)
    t[1] = t[4] = IGNORE
    return h.requires_grad_(), W.requires_grad_(), t.to(device)


def nll_of_log_softmax(x: Tensor, t: Tensor) -> Tensor:
    return F.nll_loss(torch.log_softmax(x, -1), t)


def class_inputs(dtype: torch.dtype, device: torch.device, seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 5, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)
    return x.requires_grad_(), torch.randint(0, 5, (6,), generator=g).to(device)


# -- in-place updates of inputs ------------------------------------------------------------------------
def sgd_step(p: Tensor, g: Tensor, x: Tensor) -> Tensor:
    loss = (x * p.clone()).sum()
    with torch.no_grad():
        p.sub_(0.1 * g)
    return loss


def sgd_step_copy(p: Tensor, g: Tensor, x: Tensor) -> Tensor:
    loss = (x * p.clone()).sum()
    with torch.no_grad():
        p.copy_(p - 0.1 * g)  # out of place, then written back: the same ops in the same order
    return loss


def sgd_step_alpha(p: Tensor, g: Tensor, x: Tensor) -> Tensor:
    loss = (x * p.clone()).sum()
    with torch.no_grad():
        p.add_(g, alpha=-0.1)  # fused multiply-add: another rounding
    return loss


def sgd_step_too_far(p: Tensor, g: Tensor, x: Tensor) -> Tensor:
    loss = (x * p.clone()).sum()
    with torch.no_grad():
        p.sub_(0.5 * g)
    return loss


def sgd_step_uphill(p: Tensor, g: Tensor, x: Tensor) -> Tensor:
    loss = (x * p.clone()).sum()
    with torch.no_grad():
        p.add_(0.1 * g)
    return loss


def sgd_step_forgotten(p: Tensor, g: Tensor, x: Tensor) -> Tensor:
    return (x * p.clone()).sum()


def sgd_inputs(dtype: torch.dtype, device: torch.device, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    p, g, x = (torch.randn(4, 6, generator=gen, dtype=torch.float64).to(dtype=dtype) for _ in range(3))
    return p.to(device), g.to(device), x.to(device).requires_grad_()


def softmax_mutating_through_data(x: Tensor) -> Tensor:
    y = torch.softmax(x, -1)
    x.data.mul_(2)  # behind autograd's back: the version counter does not move
    return y


# -- structure: dicts, aliases, randomness -----------------------------------------------------------
def two_outputs(x: Tensor, W: Tensor) -> dict[str, Tensor]:
    return {"a": x @ W, "b": x.sum(-1)}


def two_outputs_other_order(x: Tensor, W: Tensor) -> dict[str, Tensor]:
    return {"b": x.sum(-1), "a": torch.einsum("ij,jk->ik", x, W)}


def two_outputs_scaled(x: Tensor, W: Tensor) -> dict[str, Tensor]:
    return {"b": x.sum(-1), "a": x @ W * 1.001}


def copy_of(x: Tensor) -> Tensor:
    return x * 1


def view_of(x: Tensor) -> Tensor:
    return x.view(x.shape)


def dropout_half(x: Tensor) -> Tensor:
    return F.dropout(x, 0.5)


def dropout_more(x: Tensor) -> Tensor:
    return F.dropout(x, 0.6)


Inputs = Callable[..., Any]

CORRECT: dict[str, tuple[Callable[..., Any], Callable[..., Any], Inputs]] = {
    "max-shifted softmax": (softmax, softmax_manual, lambda: (r(4, 8),)),
    "online softmax": (softmax, softmax_online, lambda: (r(4, 8),)),
    "softmax with a temperature": (softmax_temperature, softmax_temperature_manual, lambda: (r(4, 8),)),
    "log_softmax as x - logsumexp": (log_softmax, log_softmax_manual, lambda: (r(4, 8),)),
    "max-shifted logsumexp": (logsumexp, logsumexp_manual, lambda: (r(4, 8),)),
    "chunked logsumexp": (logsumexp, logsumexp_chunked, lambda: (r(4, 8),)),
    "two-pass variance": (var, var_two_pass, lambda: (r(4, 8),)),
    "std from the two-pass variance": (std, std_manual, lambda: (r(4, 8),)),
    "var_mean in two calls": (var_mean, var_mean_manual, lambda: (r(4, 8),)),
    "unfused layer norm": (layer_norm, layer_norm_manual, norm_inputs),
    "unfused rms norm": (rms_norm, rms_norm_manual, lambda: (r(4, 8), r(8))),
    "GELU spelled out": (gelu, gelu_manual, lambda: (r(4, 8),)),
    "tanh GELU spelled out": (gelu_tanh, gelu_tanh_manual, lambda: (r(4, 8),)),
    "SiLU as x * sigmoid(x)": (F.silu, silu_manual, lambda: (r(4, 8),)),
    "sigmoid spelled out": (torch.sigmoid, sigmoid_manual, lambda: (r(4, 8),)),
    "softplus spelled out": (F.softplus, softplus_manual, lambda: (r(4, 8),)),
    "(a @ b) @ c as a @ (b @ c)": (chain_left, chain_right, lambda: (r(4, 6), r(6, 5), r(5, 3))),
    "head results by einsum": (head_results_broadcast, head_results_einsum, lambda: (r(3, 2, 8), r(2, 8, 5))),
    "F.linear unfused": (linear, linear_unfused, lambda: (r(4, 6), r(5, 6), r(5))),
    "addmm unfused": (addmm, addmm_unfused, lambda: (r(5), r(4, 6), r(6, 5))),
    "sdpa as manual attention": (sdpa, attention_manual, qkv),
    "causal sdpa as masked attention": (sdpa_causal, attention_manual_causal, qkv),
    "chunked linear + cross-entropy": (cross_entropy, cross_entropy_chunked, token_inputs),
    "cross_entropy as nll of log_softmax": (
        lambda x, t: F.cross_entropy(x, t),
        nll_of_log_softmax,
        class_inputs,
    ),
    "dict outputs in another key order": (two_outputs, two_outputs_other_order, lambda: (r(4, 6), r(6, 3))),
    "in-place step as copy_ of out-of-place": (sgd_step, sgd_step_copy, sgd_inputs),
    "in-place step with add_(alpha=)": (sgd_step, sgd_step_alpha, sgd_inputs),
}

WRONG: dict[str, tuple[Callable[..., Any], Callable[..., Any], Inputs, str, dict[str, Any]]] = {
    "layer norm eps 1e-5 -> 1e-6": (layer_norm, layer_norm_eps_1e6, norm_inputs, "output: ", {}),
    "rms norm eps 1e-6 -> 1e-5": (rms_norm, rms_norm_eps_1e5, lambda: (r(4, 8), r(8)), "output: ", {}),
    "layer norm drops the bias": (layer_norm, layer_norm_without_bias, norm_inputs, "grad of input[2]", {}),
    "layer norm over the wrong dim": (layer_norm, layer_norm_over_rows, norm_inputs, "output: ", {}),
    "chunked logsumexp: chunks overlap by one": (
        logsumexp,
        logsumexp_overlapping_chunks,
        lambda: (r(4, 8),),
        "output: ",
        {},
    ),
    "chunked logsumexp: one element skipped per chunk": (
        logsumexp,
        logsumexp_skipping_chunks,
        lambda: (r(4, 8),),
        "output: ",
        {},
    ),
    "logsumexp forgets the max": (logsumexp, logsumexp_without_max, lambda: (r(4, 8),), "output: ", {}),
    "online softmax without the rescale": (
        softmax,
        softmax_online_no_rescale,
        lambda: (r(4, 8),),
        "output: ",
        {},
    ),
    "softmax over the wrong dim": (
        softmax,
        lambda x: torch.softmax(x, 0),
        lambda: (r(4, 8),),
        "output: ",
        {},
    ),
    "biased variance": (var, var_biased, lambda: (r(4, 8),), "output: ", {}),
    "one-pass variance on data far from zero": (var, var_one_pass, far_from_zero, "output: ", {}),
    "attention without the 1/sqrt(d) scale": (sdpa, attention_without_scale, qkv, "output: ", {}),
    "causal mask dropped": (sdpa_causal, attention_manual, qkv, "exceed the rounding budget", {}),
    "tanh GELU for exact GELU": (gelu, gelu_tanh, lambda: (r(4, 8),), "output: ", {}),
    "SiLU with sigmoid(2x)": (F.silu, silu_doubled, lambda: (r(4, 8),), "output: ", {}),
    "chunked cross-entropy drops ignore_index": (
        cross_entropy,
        cross_entropy_chunked_keeps_ignored,
        token_inputs,
        "exceed the rounding budget",
        {},
    ),
    "chunked cross-entropy averages over ignored tokens": (
        cross_entropy,
        cross_entropy_chunked_counts_ignored,
        token_inputs,
        "output: ",
        {},
    ),
    "in-place step 0.1 -> 0.5": (sgd_step, sgd_step_too_far, sgd_inputs, "input[0] (updated in place)", {}),
    "in-place step with the wrong sign": (
        sgd_step,
        sgd_step_uphill,
        sgd_inputs,
        "input[0] (updated in place)",
        {},
    ),
    "in-place step forgotten": (
        sgd_step,
        sgd_step_forgotten,
        sgd_inputs,
        "the reference updates input[0] in place but the candidate leaves it unchanged",
        {},
    ),
    ".data mutation of an input": (
        softmax,
        softmax_mutating_through_data,
        lambda: (r(4, 8),),
        "modifies input[0] through .data",
        {},
    ),
    "an output that aliases its input": (
        copy_of,
        view_of,
        lambda: (r(4, 8),),
        "shares memory with input[0]",
        {},
    ),
    "dict value scaled under its key": (
        two_outputs,
        two_outputs_scaled,
        lambda: (r(4, 6), r(6, 3)),
        "output['a']",
        {},
    ),
    "dropout p 0.5 -> 0.6": (dropout_half, dropout_more, lambda: (r(16, 8),), "output: ", {}),
    "relu as x * (x > 0), bit for bit": (
        relu,
        relu_by_mask,
        lambda: (r(4, 8),),
        "other sign of zero",
        {"mode": "exact"},
    ),
}
