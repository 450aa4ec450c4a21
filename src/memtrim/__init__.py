"""memtrim: find what sets a PyTorch program's peak memory, cut it, and prove the rewrite safe."""

from __future__ import annotations

__version__ = "0.1.0"
