"""Saving a trace in bounded memory: the same ``memtrim.trace/2`` JSON that :func:`~memtrim.trace.load`
reads, written to the file piece by piece instead of built whole in memory first.

:func:`~memtrim.trace.serialize.dumps` makes every op row and allocation object, then one string of the
whole file (4000 steps, 380k ops: 895 MiB above the trace itself, for an 83 MiB file). Here each op
row and each allocation is encoded in chunks of :data:`CHUNK` and written at once, one per line, so
saving costs the site table and one chunk at a time; the file is written atomically, with the
permissions ``open()`` would give it, like :func:`~memtrim.trace.save`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import IO, Any

from memtrim.trace.model import SCHEMA, Site, TraceLog
from memtrim.trace.serialize import (
    OP_COLUMNS,
    _site_table,
    allocation_data,
    atomic_file,
    failed_op_data,
    op_row_data,
    scalars_data,
)

CHUNK = 4096
"""Rows encoded at a time."""

_encode = json.JSONEncoder(allow_nan=False, separators=(", ", ": ")).encode


def _value(value: Any) -> str:
    return _encode(value)


def _rows(handle: IO[str], rows: Iterable[Any]) -> None:
    """A JSON list, one element per line, encoded a chunk at a time."""
    handle.write("[")
    chunk: list[str] = []
    first = True
    for row in rows:
        chunk.append(_encode(row))
        if len(chunk) == CHUNK:
            handle.write(("\n " if first else ",\n ") + ",\n ".join(chunk))
            chunk.clear()
            first = False
    if chunk:
        handle.write(("\n " if first else ",\n ") + ",\n ".join(chunk))
        first = False
    handle.write("]" if first else "\n]")


def write(log: TraceLog, handle: IO[str], summary: Mapping[str, Any] | None = None) -> None:
    """Write ``{schema, <summary>, <raw log>}`` to ``handle`` as :func:`~memtrim.trace.dumps` would
    (same keys, same order, same values)."""
    sites, index = _site_table(log)

    def ref(site: Site | None) -> int | None:
        return None if site is None else index[site]

    head: dict[str, Any] = {"schema": SCHEMA, **(summary or {})}
    head.update(
        fake=log.fake,
        finished=log.finished,
        error=log.error,
        cuda_max_allocated=log.cuda_max_allocated,
        metadata=log.metadata,
        end_tick=log.end_tick,
    )
    handle.write("{")
    for i, (key, value) in enumerate(head.items()):
        handle.write(("\n" if i == 0 else ",\n") + f"{_value(key)}: {_value(value)}")
    handle.write(',\n"sites": ')
    _rows(handle, ([s.file, s.line, s.function] for s in sites))
    handle.write(f',\n"op_columns": {_value(OP_COLUMNS)},\n"ops": ')
    _rows(handle, (op_row_data(seq, row, ref) for seq, row in enumerate(log.ops.rows)))
    handle.write(f',\n"failed_op": {_value(failed_op_data(log, ref))},\n"allocations": ')
    _rows(handle, (allocation_data(a, ref) for a in log.allocations))
    handle.write(',\n"regions": ')
    _rows(handle, ([r.name, r.start_tick, r.end_tick] for r in log.regions))
    handle.write(',\n"scalars": ')
    _rows(handle, scalars_data(log))
    handle.write("\n}\n")


def save(log: TraceLog, path: str, summary: Mapping[str, Any] | None = None) -> None:
    """Write the trace to ``path`` in bounded memory (see the module's docstring)."""
    with atomic_file(path) as handle:
        write(log, handle, summary)
