"""memtrim.fixes: verified drop-ins for the commonest memory hogs, each a line you can paste.

- :func:`chunked_linear_cross_entropy`: ``F.cross_entropy(hidden @ weight.T, target)`` without the
  ``[tokens, vocab]`` logits (a chunked loss that recomputes each chunk's logits in backward), with the
  elementwise chain a model puts between them (``logit_scale``, ``softcap``).
- :func:`causal_lm_cross_entropy`: the same with a transformers causal LM's loss semantics (label shift,
  fp32, ``num_items_in_batch``).
- :func:`chunked_loss`: ``handle = chunked_loss(model)`` makes a transformers causal LM's ``.loss`` chunked
  (``.logits`` is None when ``labels`` are passed); ``handle.remove()`` undoes it.
- :func:`chunked_head_loss`: ``handle = chunked_head_loss(model.lm_head)`` makes a plain-code
  ``F.cross_entropy(model(x).logits.view(-1, V), y)`` chunked without changing the training code (the
  layer returns deferred logits); ``handle.remove()`` undoes it.
- :func:`checkpoint_modules`: activation checkpointing on the modules named by a pattern
  (``"transformer.h.*"``), bit-exact, undoable.
- :func:`optimizer_in_backward`: the optimizer's step run per parameter inside backward, each gradient
  freed as soon as it is applied (bit for bit for per-parameter optimizers), undoable.
- :func:`micro_batches`: ``handle = micro_batches(model, 2)`` makes a transformers LM's training call with
  ``labels`` run as 2 micro-batches (gradient accumulation: one part's activations alive at a time, the
  same mean loss and gradients to rounding, one more forward); ``handle.remove()`` undoes it.
- :func:`optimizer_options`: ``handle = optimizer_options(optimizer, fused=True, foreach=False)`` sets
  options on a live optimizer's groups as if it had been built with them; ``handle.remove()`` undoes it.
"""

from memtrim.fixes.checkpoint import CheckpointHandle, checkpoint_modules, glob_to_regex
from memtrim.fixes.cross_entropy import (
    auto_chunk_size,
    causal_lm_cross_entropy,
    chunked_linear_cross_entropy,
)
from memtrim.fixes.gradient_accumulation import MicroBatchesHandle, micro_batches
from memtrim.fixes.head_loss import ChunkedHeadLossHandle, DeferredLogits, chunked_head_loss
from memtrim.fixes.hf_loss import ChunkedLossHandle, chunked_loss
from memtrim.fixes.optimizer import (
    OptimizerInBackwardHandle,
    OptimizerOptionsHandle,
    optimizer_in_backward,
    optimizer_options,
)

__all__ = [
    "CheckpointHandle",
    "ChunkedHeadLossHandle",
    "ChunkedLossHandle",
    "DeferredLogits",
    "MicroBatchesHandle",
    "OptimizerInBackwardHandle",
    "OptimizerOptionsHandle",
    "auto_chunk_size",
    "causal_lm_cross_entropy",
    "checkpoint_modules",
    "chunked_head_loss",
    "chunked_linear_cross_entropy",
    "chunked_loss",
    "glob_to_regex",
    "micro_batches",
    "optimizer_in_backward",
    "optimizer_options",
]
