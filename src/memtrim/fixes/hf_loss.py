"""``chunked_loss(model)``: a transformers causal LM's ``model(input_ids, labels=labels).loss`` computed by
:func:`~memtrim.fixes.cross_entropy.causal_lm_cross_entropy` from the last hidden state, without the
``[tokens, vocab]`` logits.

The patch replaces the instance's ``forward`` (not the class's): with ``labels`` it runs the model's
decoder (``model.base_model``), takes ``last_hidden_state`` and computes the loss the model's own
``loss_function`` would (``ForCausalLMLoss``: label shift, fp32, ``num_items_in_batch``), with the
model's ``config.final_logit_softcapping`` (Gemma 2) applied per tile. The output's ``logits`` is then
**None** (never built); everything else (``past_key_values``, ``hidden_states``, ``attentions``) is the
decoder's. Without ``labels`` the original forward runs unchanged. ``handle.remove()`` undoes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memtrim.fixes.cross_entropy import causal_lm_cross_entropy


@dataclass
class ChunkedLossHandle:
    """What :func:`chunked_loss` returns: ``remove()`` restores the model's own forward."""

    model: nn.Module
    had_instance_forward: bool
    previous: Any

    def remove(self) -> None:
        if self.had_instance_forward:
            self.model.forward = self.previous
        elif "forward" in self.model.__dict__:
            del self.model.forward


def _head(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, nn.Linear):
        raise TypeError(
            f"{type(model).__name__} has no nn.Linear output embedding (get_output_embeddings()); "
            "chunked_loss patches transformers causal LMs (…ForCausalLM, GPT2LMHeadModel); for other code "
            "call memtrim.fixes.chunked_linear_cross_entropy(hidden, weight, target)"
        )
    return head.weight, head.bias


def chunked_loss(model: nn.Module, *, chunk_size: int | None = None) -> ChunkedLossHandle:
    """Patch ``model`` (a transformers causal LM) so that ``model(..., labels=labels).loss`` is chunked.

    The loss and every gradient equal the unpatched model's (to rounding); ``.logits`` is None whenever
    ``labels`` is passed. Undo with ``handle.remove()``.
    """
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        raise TypeError(
            f"chunked_loss supports decoder-only transformers causal LMs, not {type(model).__name__}; "
            "for encoder-decoder models call memtrim.fixes.causal_lm_cross_entropy(decoder_hidden, "
            "lm_head.weight, labels, shift=False) yourself"
        )
    _head(model)  # fail now, not at the first step
    decoder = model.base_model
    if decoder is model:
        raise TypeError(f"{type(model).__name__} has no base_model to take the last hidden state from")
    softcap = getattr(config, "final_logit_softcapping", None)
    original = model.forward
    had_instance_forward = "forward" in model.__dict__

    def forward(*args: Any, labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
        if labels is None:
            return original(*args, **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        num_items = kwargs.pop("num_items_in_batch", None)
        kwargs.pop("logits_to_keep", None)
        kwargs.pop("return_dict", None)
        outputs = decoder(*args, **kwargs)  # type: ignore[operator]
        weight, bias = _head(model)
        loss = causal_lm_cross_entropy(
            outputs.last_hidden_state,
            weight,
            labels,
            num_items_in_batch=num_items,
            bias=bias,
            softcap=softcap,
            chunk_size=chunk_size,
        )
        return CausalLMOutputWithPast(
            loss=loss,  # type: ignore[arg-type]
            logits=None,
            past_key_values=getattr(outputs, "past_key_values", None),
            hidden_states=getattr(outputs, "hidden_states", None),
            attentions=getattr(outputs, "attentions", None),
        )

    model.forward = forward
    return ChunkedLossHandle(model, had_instance_forward, original)
