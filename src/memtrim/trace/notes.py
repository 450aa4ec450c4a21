"""Notes a trace's metadata carries about how the program was measured, read by every reporter."""

from __future__ import annotations

COMPILED_KEY = "torch_compile"
"""The :attr:`TraceLog.metadata` key of the note, present when dynamo was loaded during the region."""
COMPILED_NOTE = (
    "torch.compile'd code called in this region ran eagerly (memtrim records under "
    "torch.compiler.set_stance('force_eager')): the figures are the eager program's; compiled code "
    "is unchanged after the region"
)
COMPILED_BANNER = (
    "measured eagerly: torch.compile'd code in this region ran as plain PyTorch, so these are the eager "
    "program's bytes; the compiled program fuses ops and usually peaks lower (its buffers are made below "
    "the dispatcher, where no recorder sees them)"
)
"""What the terminal and HTML reports say in their first lines when :data:`COMPILED_KEY` is set."""
