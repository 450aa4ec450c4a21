"""The diagnosis rules, one small function each, registered on
:data:`memtrim.doctor.diagnosis.DIAGNOSES` when this package is imported:

- ``logits-cross-entropy``, ``upcast-copy`` (:mod:`.loss`)
- ``kept-output``, ``cache-in-training`` (:mod:`.kept`)
- ``broadcast-then-reduce``, ``out-of-place-chain`` (:mod:`.elementwise`)
- ``checkpoint-candidates`` (:mod:`.checkpoint`)
- ``eager-attention`` (:mod:`.attention`)
- ``optimizer-step`` (:mod:`.optimizer`)
- ``optimizer-state`` (:mod:`.optimizer_state`)
- ``fsdp-reshard-after-forward`` (:mod:`.fsdp`)
- ``ddp-gradient-as-bucket-view`` (:mod:`.ddp`)
- ``all-gather-saved-for-backward`` (:mod:`.gather`)
"""

from memtrim.doctor.rules import (
    attention,
    checkpoint,
    ddp,
    elementwise,
    fsdp,
    gather,
    kept,
    loss,
    optimizer,
    optimizer_state,
)

__all__ = [
    "attention",
    "checkpoint",
    "ddp",
    "elementwise",
    "fsdp",
    "gather",
    "kept",
    "loss",
    "optimizer",
    "optimizer_state",
]
