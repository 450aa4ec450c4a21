"""memtrim.fixes: verified drop-ins for the commonest memory hogs, each a line you can paste.

- :func:`chunked_linear_cross_entropy`: ``F.cross_entropy(hidden @ weight.T, target)`` without the
  ``[tokens, vocab]`` logits (a chunked loss that recomputes each chunk's logits in backward).
- :func:`checkpoint_modules`: activation checkpointing on the modules named by a pattern
  (``"transformer.h.*"``), bit-exact, undoable.
"""

from memtrim.fixes.checkpoint import CheckpointHandle, checkpoint_modules, glob_to_regex
from memtrim.fixes.cross_entropy import auto_chunk_size, chunked_linear_cross_entropy

__all__ = [
    "CheckpointHandle",
    "auto_chunk_size",
    "checkpoint_modules",
    "chunked_linear_cross_entropy",
    "glob_to_regex",
]
