"""Models memtrim's rules were not written for: tiny configs of the architectures a new user tried
(transformers Qwen3, Mistral with eager attention, T5 called through its encoder and decoder, Qwen3-MoE,
Gemma2 with a softcapped head) and a plain-PyTorch UNet with BatchNorm. Random weights, nothing
downloaded; each with the training step the user ran."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
import transformers
from torch import nn

VOCAB, TOKENS, BATCH = 256, 32, 2


class UNet(nn.Module):
    """Two levels down, two up, skip connections; every block conv -> BatchNorm -> ReLU (three times)."""

    def __init__(self, channels: int = 3, width: int = 8, levels: int = 3) -> None:
        super().__init__()
        widths = [width * 2**i for i in range(levels + 1)]
        self.stem = nn.Conv2d(channels, width, 3, padding=1)
        self.down = nn.ModuleList(_block(widths[i], widths[i + 1]) for i in range(levels))
        self.pool = nn.MaxPool2d(2)
        self.up = nn.ModuleList(_block(widths[i + 1] + widths[i], widths[i]) for i in reversed(range(levels)))
        self.head = nn.Conv2d(width, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        skips = []
        for block in self.down:
            skips.append(x)
            x = block(self.pool(x))
        for block in self.up:
            skip = skips.pop()
            x = nn.functional.interpolate(x, size=skip.shape[-2:])
            x = block(torch.cat([x, skip], dim=1))
        return self.head(x)


def _block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
        nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
        nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
    )  # fmt: skip


@dataclass(frozen=True)
class Unseen:
    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[], dict[str, torch.Tensor]]
    step: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]
    """The forward and loss the user wrote, from the model and the batch."""


def _tokens() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, TOKENS))
    return {"input_ids": ids, "labels": ids}


def _causal_lm(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch, use_cache=False).loss


_DECODER = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=TOKENS, head_dim=8,
)  # fmt: skip


def qwen3() -> nn.Module:
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**_DECODER))


def mistral_eager() -> nn.Module:
    config = transformers.MistralConfig(**_DECODER, sliding_window=None)
    config._attn_implementation = "eager"
    return transformers.MistralForCausalLM(config)


def qwen3_moe() -> nn.Module:
    config = transformers.Qwen3MoeConfig(
        **_DECODER, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1
    )
    # the eager loop over experts: torch's grouped_mm has no float64 kernel, which verify's oracle needs
    config._experts_implementation = "eager"
    return transformers.Qwen3MoeForCausalLM(config)


def gemma2() -> nn.Module:
    config = transformers.Gemma2Config(**_DECODER, final_logit_softcapping=30.0, sliding_window=TOKENS)
    return transformers.Gemma2ForCausalLM(config)


def t5() -> nn.Module:
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        decoder_start_token_id=0, tie_word_embeddings=True,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)


def _t5_batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (BATCH, TOKENS))
    return {"input_ids": ids, "labels": torch.randint(1, VOCAB, (BATCH, 8))}


def _t5_through_stacks(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """T5 called as its parts: the encoder, the decoder on shifted labels, the tied head and the loss."""
    encoded = model.encoder(input_ids=batch["input_ids"]).last_hidden_state
    start = model._shift_right(batch["labels"])
    decoded = model.decoder(input_ids=start, encoder_hidden_states=encoded, use_cache=False).last_hidden_state
    logits = model.lm_head(decoded * model.model_dim**-0.5)
    return nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())


def unet() -> nn.Module:
    return UNet()


def _images() -> dict[str, torch.Tensor]:
    return {"x": torch.randn(2, 3, 64, 64), "target": torch.randn(2, 1, 64, 64)}


def _unet_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch["x"]), batch["target"])


UNSEEN = (
    Unseen("qwen3", qwen3, _tokens, _causal_lm),
    Unseen("mistral-eager", mistral_eager, _tokens, _causal_lm),
    Unseen("t5-stacks", t5, _t5_batch, _t5_through_stacks),
    Unseen("qwen3-moe", qwen3_moe, _tokens, _causal_lm),
    Unseen("gemma2", gemma2, _tokens, _causal_lm),
    Unseen("unet-bn", unet, _images, _unet_step),
)


def train(model: nn.Module, batch: dict[str, Any], step: Callable[..., torch.Tensor], steps: int = 1) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        step(model, batch).backward()
        optimizer.step()
