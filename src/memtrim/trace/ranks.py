"""A torchrun job's traces: which rank a trace recorded itself as (``metadata["distributed"]``), and
their file names (``trace.json`` is written as ``trace.rank0.json``, ``trace.rank1.json``, ..., one per
process; a base name finds them again)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

WORLD = "distributed"
"""``TraceLog.metadata`` key: ``{"rank": int, "world_size": int, "backend": str, "run_id": str}``."""


class RecordedRank(NamedTuple):
    """Which rank of which job a trace is, as it recorded (world size and run id where known)."""

    rank: int
    world_size: int | None
    run_id: str | None


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def recorded_rank(metadata: Mapping[str, Any]) -> RecordedRank | None:
    """The rank a trace's metadata names; None for a trace of one process (or a damaged entry)."""
    world = metadata.get(WORLD)
    if not isinstance(world, dict):
        return None
    rank, size, run = _count(world.get("rank")), _count(world.get("world_size")), world.get("run_id")
    if rank is None or rank < 0:
        return None
    return RecordedRank(
        rank, size if size is not None and size > 0 else None, run if isinstance(run, str) else None
    )


def rank_path(path: str, rank: int) -> str:
    """``trace.json`` -> ``trace.rank1.json``."""
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext}"


def rank_files(path: str) -> list[str]:
    """The rank traces written for the base name ``path`` (``trace.json``: ``trace.rank0.json``, ...)
    that exist, in rank order; empty when there are none."""
    folder, name = os.path.split(path)
    root, ext = os.path.splitext(name)
    pattern = re.compile(re.escape(root) + r"\.rank(\d+)" + re.escape(ext))
    try:
        names = os.listdir(folder or ".")
    except OSError:
        return []
    found = [(int(m.group(1)), n) for n in names if (m := pattern.fullmatch(n))]
    return [os.path.join(folder, n) for _, n in sorted(found)]
