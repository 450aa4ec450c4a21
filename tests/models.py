"""A corpus of real third-party models: ``transformers`` tiny configs built from scratch with random
weights (nothing is downloaded), and one training step each: forward, loss, backward, AdamW step."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # tiny vocabularies make it warn about token ids

import torch
import transformers

WIDTH, LAYERS, HEADS, VOCAB, TOKENS, BATCH = 32, 2, 2, 128, 8, 2


@dataclass(frozen=True)
class TinyModel:
    name: str
    build: Callable[[], torch.nn.Module]
    batch: Callable[[], dict[str, torch.Tensor]]
    layer_path: str
    """``named_modules()`` name of the first block's attention."""
    buffers_used: tuple[str, ...] = ()
    """The buffers a forward reads (``named_buffers()`` names)."""


def _tokens() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, TOKENS))
    return {"input_ids": ids, "labels": ids}


def _gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=TOKENS, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=1, max_position_embeddings=TOKENS,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _bert() -> torch.nn.Module:
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=2 * WIDTH, max_position_embeddings=TOKENS, num_labels=3,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config)


def _bert_batch() -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, VOCAB, (BATCH, TOKENS)), "labels": torch.tensor([0, 2])}


def _vit() -> torch.nn.Module:
    config = transformers.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=WIDTH, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, intermediate_size=2 * WIDTH, num_labels=3,
    )  # fmt: skip
    return transformers.ViTForImageClassification(config)


def _vit_batch() -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(BATCH, 3, 16, 16), "labels": torch.tensor([0, 2])}


CORPUS = (
    TinyModel("gpt2", _gpt2, _tokens, "transformer.h.0.attn"),
    TinyModel("llama", _llama, _tokens, "model.layers.0.self_attn", ("model.rotary_emb.inv_freq",)),
    TinyModel(
        "bert",
        _bert,
        _bert_batch,
        "bert.encoder.layer.0.attention.self",
        ("bert.embeddings.position_ids", "bert.embeddings.token_type_ids"),
    ),
    TinyModel("vit", _vit, _vit_batch, "vit.layers.0.attention"),
)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> None:
    """One training step; the gradients and the optimizer state stay alive after it."""
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()


def new_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    # foreach=False: the same single-tensor loop on every device, so that state is made per parameter
    return torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)


def nbytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (tied weights counted once)."""
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())
