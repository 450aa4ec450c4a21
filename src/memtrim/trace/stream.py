"""Saving a trace in bounded memory: the same ``memtrim.trace/3`` JSON that :func:`~memtrim.trace.load`
reads, written to the file piece by piece instead of built whole in memory first.

:func:`~memtrim.trace.serialize.dumps` builds every column, then one string of the whole file. Here
each column (:mod:`memtrim.trace.columns`) is encoded in chunks of :data:`CHUNK` values and written at
once, one column per line, and the string, shape and site tables (filled as the columns are written)
come last, so saving costs the tables and one chunk at a time; the file is written atomically, with the
permissions ``open()`` would give it, like :func:`~memtrim.trace.save`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import IO, Any

from memtrim.trace import columns
from memtrim.trace.collector import collector_paused
from memtrim.trace.model import SCHEMA, Phase, TraceLog
from memtrim.trace.serialize import atomic_file, failed_op_data, scalars_data

CHUNK = 65536
"""Values (of a column; rows of the small tables) encoded at a time."""

_ENCODER = json.JSONEncoder(allow_nan=False, separators=(", ", ": "))
_compact = json.JSONEncoder(allow_nan=False, separators=(",", ":")).encode
_encode = _ENCODER.encode


def _value(value: Any) -> str:
    return _encode(value)


def _row_encoder() -> Callable[[Any], str]:
    """``_encode`` for one row, without building a new C encoder per call (``JSONEncoder.encode`` does,
    which was most of the cost of writing a million rows). The C encoder is CPython's internal
    ``json.encoder.c_make_encoder``, called as ``JSONEncoder.iterencode`` calls it; where it is missing,
    or disagrees with ``_encode`` on a sample row, every row goes through ``_encode``."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return _encode
    try:
        iterencode = make(
            None,  # no circular-reference markers: rows are plain lists, numbers and strings
            _ENCODER.default,
            json.encoder.encode_basestring_ascii,
            None,
            ": ",
            ", ",
            False,
            False,
            False,  # allow_nan off, as in _ENCODER
        )

        def encode(value: Any) -> str:
            return "".join(iterencode(value, 0))

        sample = [0, 2**61, "aten.mm.default", Phase.FORWARD, None, 'é\n"', (1, 2), {"facts": [], "ok": True}]
        if encode(sample) != _encode(sample):
            return _encode
    except Exception:  # an interpreter whose internal encoder takes other arguments
        return _encode
    return encode


_encode_row = _row_encoder()


def _rows(handle: IO[str], rows: Iterable[Any]) -> None:
    """A JSON list, one element per line, encoded a chunk at a time."""
    handle.write("[")
    chunk: list[str] = []
    first = True
    encode = _encode_row
    for row in rows:
        chunk.append(encode(row))
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
    tables = columns.Tables()
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
    _section(handle, "ops", len(log.ops), columns.op_columns(log, tables))
    failed = failed_op_data(log, lambda site: tables.site([site])[0])
    handle.write(f',\n"failed_op": {_value(failed)}')
    _section(handle, "allocations", len(log.allocations), columns.allocation_columns(log, tables))
    handle.write(',\n"regions": ')
    _rows(handle, ([r.name, r.start_tick, r.end_tick] for r in log.regions))
    handle.write(',\n"scalars": ')
    _rows(handle, scalars_data(log))
    # the tables last: filled while the columns were written
    handle.write(',\n"sites": ')
    _rows(handle, ([s.file, s.line, s.function] for s in tables.sites))
    handle.write(f',\n"strings": {_value(tables.strings)},\n"shapes": {_compact(tables.shapes)}')
    handle.write("\n}\n")


def _section(handle: IO[str], name: str, count: int, fields: list[columns.Column]) -> None:
    """``"name": {"count": N, "field": [...], ...}``, one column per line, encoded a chunk at a time."""
    handle.write(f',\n{_value(name)}: {{"count": {count}')
    for column in fields:
        handle.write(f",\n {_value(column[0])}: [")
        first = True
        for chunk in columns.column_chunks(column, CHUNK):
            handle.write(_compact(chunk)[1:-1] if first else "," + _compact(chunk)[1:-1])
            first = False
        handle.write("]")
    handle.write("}")


def save(log: TraceLog, path: str, summary: Mapping[str, Any] | None = None) -> None:
    """Write the trace to ``path`` in bounded memory (see the module's docstring)."""
    with collector_paused(), atomic_file(path) as handle:
        write(log, handle, summary)
