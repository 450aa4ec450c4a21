"""The file names of a torchrun job's traces: ``trace.json`` is written as ``trace.rank0.json``,
``trace.rank1.json``, ... (one per process), and a base name finds them again."""

from __future__ import annotations

import os
import re


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
