"""The text of the source lines a trace points at, read when the region ends.

Kept in the trace (``log.metadata["source_lines"]``) so that views show the code next to its bytes and
a diff of two traces can match a line that moved between two versions of a file by its text: the file
may have changed by the time the traces are compared.
"""

from __future__ import annotations

import linecache

from memtrim.trace.model import Site, TraceLog

SOURCE_LINES = "source_lines"
"""``log.metadata`` key: ``{file: {"line number": "stripped text"}}``."""

_MAX_CHARS = 200


def remember_source_lines(log: TraceLog) -> None:
    """Store the stripped text of every site ``log`` names (lines that cannot be read are left out)."""
    # (an allocation's site is its op's: the op rows name every site, and reading them builds no
    # Allocation objects, which a trace makes only when something reads it)
    sites: set[Site] = log.ops.sites()
    table: dict[str, dict[str, str]] = {}
    for site in sites:
        text = linecache.getline(site.file, site.line).strip()
        if text:
            table.setdefault(site.file, {})[str(site.line)] = text[:_MAX_CHARS]
    if table:
        log.metadata[SOURCE_LINES] = table
