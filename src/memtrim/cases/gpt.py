"""A small GPT-style language model in plain PyTorch, and its training step written two ways.

The model: token + position embedding, ``layers`` blocks of causal self-attention and a GELU MLP (pre-norm,
LayerNorm), a final LayerNorm and an ``lm_head`` tied to the token embedding (or not). Nothing is
downloaded: weights are drawn from a seed. At the default size (GPT-2's vocabulary of 50257, 4 x 64
tokens, width 128, 2 blocks) one AdamW step took about 3 s on two shared, loaded CPU cores, and the
``[tokens, vocab]`` logits (51 MB in fp32) dominate the step's peak, as they do for real models.

- :func:`original_step`: the way training loops are usually written: ``out = model(x)`` keeps the output
  object (and its logits) alive through backward and the optimizer step, and
  ``F.cross_entropy(out.logits.view(-1, V), y.view(-1))`` builds the loss from the full logits.
- :func:`fixed_step`: the prescriptions of :mod:`memtrim.fixes`: the hidden states go straight into
  :func:`~memtrim.fixes.chunked_linear_cross_entropy` with the lm_head's weight, so no ``[tokens, vocab]``
  buffer is ever made (``memtrim demo gpt --checkpoint`` also applies
  :func:`~memtrim.fixes.checkpoint_modules` to the blocks).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from memtrim.fixes import chunked_linear_cross_entropy


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 50257
    context: int = 64
    width: int = 128
    layers: int = 2
    heads: int = 4
    tied: bool = True
    dropout: float = 0.0


DEMO = GPTConfig()
"""The demo's size: GPT-2's vocabulary, 64-token context, 2 blocks of width 128."""
TINY = GPTConfig(vocab=97, context=8, width=16, layers=2, heads=2)
"""Small enough to verify in every dtype and layout in seconds."""


class GPTOutput(NamedTuple):
    """What the model returns, like a ``transformers`` ``ModelOutput``: keeping it keeps the logits."""

    logits: torch.Tensor
    hidden: torch.Tensor


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.width % cfg.heads:
            raise ValueError(f"width {cfg.width} must be a multiple of heads {cfg.heads}")
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.width)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.width)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.width, 4 * cfg.width),
            nn.GELU(),
            nn.Linear(4 * cfg.width, cfg.width),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig = DEMO, *, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.width)
        self.pos_emb = nn.Embedding(cfg.context, cfg.width)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.width)
        self.lm_head = nn.Linear(cfg.width, cfg.vocab, bias=False)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("bias"):
                    p.zero_()
                elif p.dim() == 1:  # LayerNorm scale
                    p.fill_(1.0)
                else:  # GPT-2's init, residual projections scaled down by depth
                    residual = name.endswith(("proj.weight", "mlp.2.weight"))
                    std = 0.02 / math.sqrt(2 * cfg.layers) if residual else 0.02
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
        if cfg.tied:
            self.lm_head.weight = self.tok_emb.weight

    def hidden_states(self, idx: torch.Tensor) -> torch.Tensor:
        """The final hidden states ``[batch, seq, width]``, before the lm_head."""
        seq = idx.shape[-1]
        if seq > self.cfg.context:
            raise ValueError(f"sequence length {seq} is longer than the context {self.cfg.context}")
        pos = torch.arange(seq, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)

    def forward(self, idx: torch.Tensor) -> GPTOutput:
        hidden = self.hidden_states(idx)
        return GPTOutput(self.lm_head(hidden), hidden)


def batch(cfg: GPTConfig, size: int = 4, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed random batch of token ids ``x`` and next-token targets ``y``, ``[size, context]`` each."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab, (size, cfg.context + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def optimizer(model: GPT, lr: float = 1e-3) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)


# -- the step, both ways ------------------------------------------------------------------------------
def original_loss(model: GPT, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss the usual way: full ``[tokens, vocab]`` logits into ``F.cross_entropy``."""
    return F.cross_entropy(model(x).logits.view(-1, model.cfg.vocab), y.view(-1))


def fixed_loss(
    model: GPT, x: torch.Tensor, y: torch.Tensor, *, chunk_size: int | None = None
) -> torch.Tensor:
    """The same loss from the hidden states and the lm_head's weight, never making the logits."""
    hidden = model.hidden_states(x)
    return chunked_linear_cross_entropy(hidden, model.lm_head.weight, y, chunk_size=chunk_size)


def original_step(model: GPT, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    """One AdamW step the usual way: the output object (and its logits) stays alive to the end."""
    out = model(x)
    loss = F.cross_entropy(out.logits.view(-1, model.cfg.vocab), y.view(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def fixed_step(
    model: GPT, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, *, chunk_size: int | None = None
) -> float:
    """One AdamW step with the chunked loss: no ``[tokens, vocab]`` buffer is made."""
    loss = fixed_loss(model, x, y, chunk_size=chunk_size)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


# -- the fixed loss as a function of the parameters, for memtrim.verify -------------------------------
class _LossOf(nn.Module):
    """``loss(model, x, y)`` as a forward, so that ``torch.func.functional_call`` can swap its parameters."""

    def __init__(self, model: GPT, loss: Callable[[GPT, torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss(self.model, x, y)


def functional_loss(
    model: GPT, loss: Callable[[GPT, torch.Tensor, torch.Tensor], torch.Tensor]
) -> Callable[..., torch.Tensor]:
    """``f(*parameters, x, y) -> loss``, the model's parameters (tied ones once, in ``parameters()`` order)
    as arguments, so that ``memtrim.verify`` casts them per dtype and checks the gradient of every one."""
    wrapper = _LossOf(model, loss)
    names = [f"model.{name}" for name, _ in model.named_parameters()]

    def f(*args: Any) -> torch.Tensor:
        *params, x, y = args
        return torch.func.functional_call(wrapper, dict(zip(names, params, strict=True)), (x, y))

    return f


def verify_inputs(
    model: GPT, *, size: int = 2
) -> Callable[[torch.dtype, torch.device, int], tuple[Any, ...]]:
    """A ``memtrim.verify`` inputs builder: the model's parameters (initialised per seed) and a batch."""
    cfg = model.cfg

    def build(dtype: torch.dtype, device: torch.device, seed: int) -> tuple[Any, ...]:
        fresh = GPT(cfg, seed=seed)
        params = [p.detach().to(dtype=dtype, device=device).requires_grad_() for p in fresh.parameters()]
        x, y = batch(cfg, size, seed=seed)
        y[0, ::3] = -100  # ignored positions (padding): ignore_index is part of what is checked
        return (*params, x.to(device), y.to(device))

    return build
