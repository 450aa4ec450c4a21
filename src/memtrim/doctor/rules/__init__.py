"""The diagnosis rules, one small function each, registered on
:data:`memtrim.doctor.diagnosis.DIAGNOSES` when this package is imported:

- ``logits-cross-entropy``, ``upcast-copy`` (:mod:`.loss`)
- ``kept-output``, ``cache-in-training`` (:mod:`.kept`)
- ``broadcast-then-reduce``, ``out-of-place-chain`` (:mod:`.elementwise`)
- ``checkpoint-candidates`` (:mod:`.checkpoint`)
- ``optimizer-step`` (:mod:`.optimizer`)
- ``fsdp-reshard-after-forward`` (:mod:`.fsdp`)
- ``ddp-gradient-as-bucket-view`` (:mod:`.ddp`)
- ``all-gather-saved-for-backward`` (:mod:`.gather`)
"""

from memtrim.doctor.rules import checkpoint, ddp, elementwise, fsdp, gather, kept, loss, optimizer

__all__ = ["checkpoint", "ddp", "elementwise", "fsdp", "gather", "kept", "loss", "optimizer"]
