"""JSON round trip for trace logs: written atomically (as ``open()`` would, honouring the umask), read as
JSON only (never pickle) and validated field by field, so a bad file is one clear error naming the field.

Saving writes the raw log. A caller may add a ``summary`` (the report layer supplies the figures a
program wants first: peak, live set, diagnoses); loading reads the raw log and ignores the summary.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
import time
from collections.abc import Callable, Iterator, Mapping
from typing import IO, Any, TypeVar

from memtrim.trace import columns as column_layout
from memtrim.trace.collector import collector_paused
from memtrim.trace.invariants import check_invariants
from memtrim.trace.model import SCHEMA, Allocation, Fact, OpCall, OpLog, OpRow, Phase, Region, Site, TraceLog

SCHEMA_V2 = "memtrim.trace/2"
READABLE_SCHEMAS = ("memtrim.trace/1", SCHEMA_V2, SCHEMA)

OP_COLUMNS = ["seq", "tick", "op", "phase", "site", "node", "module", "inputs"]
OP_COLUMNS_V1 = OP_COLUMNS[:-1]  # memtrim.trace/1 recorded no inputs

# No allocation, tick or count in a real program reaches 2**62 (4 EiB); larger numbers in a file are
# corruption, not memory, and would print as nonsense ("1073741824 TiB").
MAX_INT = 2**62


class TraceFormatError(ValueError):
    """A file that is not a memtrim trace, or one written by an incompatible version."""


def _site_table(log: TraceLog) -> tuple[list[Site], dict[Site, int]]:
    sites: list[Site] = []
    index: dict[Site, int] = {}

    def add(site: Site | None) -> None:
        if site is not None and site not in index:
            index[site] = len(sites)
            sites.append(site)

    for row in log.ops.rows:
        add(row.site)
    for alloc in log.allocations:
        add(alloc.site)
        add(alloc.call_site)
    if log.failed_op is not None:
        add(log.failed_op.site)
    return sites, index


def op_row_data(seq: int, row: OpRow, ref: Callable[[Site | None], int | None]) -> list[Any]:
    """One op as the JSON row of :data:`OP_COLUMNS` (``ref`` gives a site's number in the site table)."""
    return [seq, row.tick, row.op, row.phase.value, ref(row.site), row.node, row.module, list(row.inputs)]


def allocation_data(a: Allocation, ref: Callable[[Site | None], int | None]) -> dict[str, Any]:
    """One allocation as its JSON object."""
    return {
        "id": a.id,
        "bytes": a.bytes,
        "dtype": a.dtype,
        "shape": list(a.shape),
        "device": a.device,
        "op": a.op,
        "phase": a.phase.value,
        "alloc_tick": a.alloc_tick,
        "free_tick": a.free_tick,
        "free_phase": None if a.free_phase is None else a.free_phase.value,
        "site": ref(a.site),
        "call_site": ref(a.call_site),
        "node": a.node,
        "module": a.module,
        "saved": a.saved,
        "preexisting": a.preexisting,
        "facts": sorted(f.value for f in a.facts),
    }


def failed_op_data(log: TraceLog, ref: Callable[[Site | None], int | None]) -> list[Any] | None:
    failed = log.failed_op
    if failed is None:
        return None
    return op_row_data(
        failed.seq,
        OpRow(failed.tick, failed.op, failed.phase, failed.site, failed.node, failed.module, failed.inputs),
        ref,
    )


def _header(log: TraceLog, schema: str) -> dict[str, Any]:
    """The fields every layout of the file starts with."""
    return {
        "schema": schema,
        "fake": log.fake,
        "finished": log.finished,
        "error": log.error,
        "cuda_max_allocated": log.cuda_max_allocated,
        "metadata": log.metadata,
        "end_tick": log.end_tick,
    }


def log_to_dict(log: TraceLog) -> dict[str, Any]:
    """The raw event log as plain JSON data, in the ``memtrim.trace/3`` layout
    (:mod:`memtrim.trace.columns`)."""
    tables = column_layout.Tables()

    def written(column: column_layout.Column) -> list[Any]:
        return [value for chunk in column_layout.column_chunks(column, 1 << 62) for value in chunk]

    ops = {"count": len(log.ops), **{c[0]: written(c) for c in column_layout.op_columns(log, tables)}}
    failed_op = failed_op_data(log, lambda site: tables.site([site])[0])
    allocations: dict[str, Any] = {"count": len(log.allocations)}
    allocations.update({c[0]: written(c) for c in column_layout.allocation_columns(log, tables)})
    return {
        **_header(log, SCHEMA),
        "ops": ops,
        "failed_op": failed_op,
        "allocations": allocations,
        "regions": [[r.name, r.start_tick, r.end_tick] for r in log.regions],
        "scalars": scalars_data(log),
        # the tables last: filled while the columns above were written
        "sites": [[s.file, s.line, s.function] for s in tables.sites],
        "strings": tables.strings,
        "shapes": tables.shapes,
    }


def log_to_dict_v2(log: TraceLog) -> dict[str, Any]:
    """The raw event log in the ``memtrim.trace/2`` layout (rows and objects): what older memtrims
    read, and what the /2 reader's tests start from."""
    sites, index = _site_table(log)

    def ref(site: Site | None) -> int | None:
        return None if site is None else index[site]

    return {
        **_header(log, SCHEMA_V2),
        "sites": [[s.file, s.line, s.function] for s in sites],
        "op_columns": OP_COLUMNS,
        "ops": [op_row_data(seq, row, ref) for seq, row in enumerate(log.ops.rows)],
        "failed_op": failed_op_data(log, ref),
        "allocations": [allocation_data(a, ref) for a in log.allocations],
        "regions": [[r.name, r.start_tick, r.end_tick] for r in log.regions],
        "scalars": scalars_data(log),
    }


def scalars_data(log: TraceLog) -> list[Any]:
    """:attr:`TraceLog.scalars` as JSON rows ``[seq, [[argument name, value], ...]]``, in op order."""
    return [[seq, [[name, value] for name, value in pairs]] for seq, pairs in sorted(log.scalars.items())]


# -- validation ------------------------------------------------------------------------------------
T = TypeVar("T")


def _fail(where: str, expected: str, value: Any) -> TraceFormatError:
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return TraceFormatError(f"malformed memtrim trace: {where} should be {expected}, got {shown}")


def _int(value: Any, where: str, *, low: int = 0) -> int:
    if type(value) is not int or not low <= value < MAX_INT:
        raise _fail(where, f"an integer from {low} to 2**62", value)
    return value


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise _fail(where, "a string", value)
    return value


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise _fail(where, "true or false", value)
    return value


def _phase(value: Any, where: str) -> Phase:
    try:
        return Phase(value)
    except ValueError:
        raise _fail(where, "one of " + ", ".join(repr(p.value) for p in Phase), value) from None


def _fact(value: Any, where: str) -> Fact:
    try:
        return Fact(value)
    except ValueError:
        raise _fail(where, "one of " + ", ".join(repr(f.value) for f in Fact), value) from None


def _optional(check: Callable[[Any, str], T], value: Any, where: str) -> T | None:
    return None if value is None else check(value, where)


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise _fail(where, "a list", value)
    return value


def _field(data: Mapping[str, Any], name: str, where: str) -> Any:
    if name not in data:
        raise TraceFormatError(f"malformed memtrim trace: {where} has no {name!r} field")
    return data[name]


# -- the fast path ----------------------------------------------------------------------------------
# A million-op trace is millions of fields; checking each through the functions above costs most of a
# load. The readers below check a whole row in one expression, with the same rules (exact types, the same
# ranges), and return None for any row they do not accept: that row then goes through the field-by-field
# checks, which either accept it (a value only they allow, e.g. a str subclass) or raise the error naming
# the field. So a bad file fails exactly as before; a good one is read several times faster.
_PHASES = {p.value: p for p in Phase}
_FACTS = {f.value: f for f in Fact}


def _ints(values: Any) -> bool:
    """Whether ``values`` is a list of ints from 0 to 2**62 (what :func:`_int` accepts)."""
    return type(values) is list and (
        not values or (set(map(type, values)) == {int} and min(values) >= 0 and max(values) < MAX_INT)
    )


def _fast_op_reader(sites: list[Site], width: int) -> Callable[[Any], OpRow | None]:
    count = len(sites)
    phases = _PHASES

    def read(row: Any) -> OpRow | None:
        if type(row) is not list or len(row) != width:
            return None
        seq, tick, op, phase, site, node, module = row[:7]
        if not (
            type(seq) is int
            and 0 <= seq < MAX_INT
            and type(tick) is int
            and 0 <= tick < MAX_INT
            and type(op) is str
            and type(phase) is str
            and phase in phases
            and (site is None or (type(site) is int and 0 <= site < count))
            and (node is None or type(node) is str)
            and (module is None or type(module) is str)
        ):
            return None
        if width == 8:
            inputs = row[7]
            if not _ints(inputs):
                return None
            inputs = tuple(inputs)
        else:
            inputs = ()
        return OpRow(tick, op, phases[phase], None if site is None else sites[site], node, module, inputs)

    return read


# the keys every /2 allocation object has: its id, and the /3 columns but for the facts it may omit
_ALLOCATION_FIELDS = frozenset({"id", *column_layout.ALLOCATION_FIELDS} - {"facts"})


def _fast_allocation_reader(sites: list[Site]) -> Callable[[Any, int], Allocation | None]:
    count = len(sites)
    phases, facts_of = _PHASES, _FACTS

    def site_ok(value: Any) -> bool:
        return value is None or (type(value) is int and 0 <= value < count)

    def read(a: Any, i: int) -> Allocation | None:
        if type(a) is not dict or not a.keys() >= _ALLOCATION_FIELDS:
            return None
        preexisting, alloc_tick, phase = a["preexisting"], a["alloc_tick"], a["phase"]
        free_tick, free_phase, size, shape = a["free_tick"], a["free_phase"], a["bytes"], a["shape"]
        node, module, site, call_site = a["node"], a["module"], a["site"], a["call_site"]
        facts = a.get("facts", [])
        if not (
            type(preexisting) is bool
            and type(a["saved"]) is bool
            and type(a["id"]) is int
            and a["id"] == i
            and type(size) is int
            and 0 <= size < MAX_INT
            and type(a["dtype"]) is str
            and _ints(shape)
            and type(a["device"]) is str
            and type(a["op"]) is str
            and type(phase) is str
            and phase in phases
            and type(alloc_tick) is int
            and (-1 if preexisting else 0) <= alloc_tick < MAX_INT
            and (
                (free_tick is None and free_phase is None)
                or (
                    type(free_tick) is int
                    and 0 <= free_tick < MAX_INT
                    and type(free_phase) is str
                    and free_phase in phases
                )
            )
            and site_ok(site)
            and site_ok(call_site)
            and (node is None or type(node) is str)
            and (module is None or type(module) is str)
            and type(facts) is list
            and all(type(f) is str and f in facts_of for f in facts)
        ):
            return None
        return Allocation(
            id=i,
            bytes=size,
            dtype=a["dtype"],
            shape=tuple(shape),
            device=a["device"],
            op=a["op"],
            phase=phases[phase],
            alloc_tick=alloc_tick,
            free_tick=free_tick,
            free_phase=None if free_phase is None else phases[free_phase],
            site=None if site is None else sites[site],
            call_site=None if call_site is None else sites[call_site],
            node=node,
            module=module,
            saved=a["saved"],
            preexisting=preexisting,
            facts=frozenset(facts_of[f] for f in facts),
        )

    return read


def _decline(*row: Any) -> None:
    """A fast reader that accepts nothing: every row takes the field-by-field checks."""
    return None


def _rows_v2(
    data: Mapping[str, Any],
    sites: list[Site],
    site: Callable[[Any, str], Site | None],
    columns: list[str],
    op_from_row: Callable[[Any, str], OpCall],
    fast: bool,
) -> tuple[OpLog, list[Allocation]]:
    """The ops (rows) and allocations (objects) of a /1 or /2 file."""
    get = lambda name: _field(data, name, "the trace")  # noqa: E731
    ops = OpLog()
    fast_op = _fast_op_reader(sites, len(columns)) if fast else _decline
    rows = ops.rows
    for i, row in enumerate(_list(get("ops"), "ops")):
        fast_row = fast_op(row)
        if fast_row is not None:
            rows.append(fast_row)
        else:  # the checks one by one: the error names the field (or a value the fast path declined)
            ops.append(op_from_row(row, f"ops[{i}]"))
    allocations = []
    fast_allocation = _fast_allocation_reader(sites) if fast else _decline
    for i, a in enumerate(_list(get("allocations"), "allocations")):
        fast_a = fast_allocation(a, i)
        if fast_a is not None:
            allocations.append(fast_a)
            continue
        where = f"allocations[{i}]"
        if not isinstance(a, dict):
            raise _fail(where, "an object", a)
        f = lambda name, w=where, a=a: _field(a, name, w)  # noqa: E731
        preexisting = _bool(f("preexisting"), where + ".preexisting")
        if _int(f("id"), where + ".id") != i:
            raise _fail(where + ".id", f"its position {i}", f("id"))
        shape = _list(f("shape"), where + ".shape")
        allocations.append(
            Allocation(
                id=i,
                bytes=_int(f("bytes"), where + ".bytes"),
                dtype=_str(f("dtype"), where + ".dtype"),
                shape=tuple(_int(d, f"{where}.shape[{j}]") for j, d in enumerate(shape)),
                device=_str(f("device"), where + ".device"),
                op=_str(f("op"), where + ".op"),
                phase=_phase(f("phase"), where + ".phase"),
                alloc_tick=_int(f("alloc_tick"), where + ".alloc_tick", low=-1 if preexisting else 0),
                free_tick=_optional(_int, f("free_tick"), where + ".free_tick"),
                free_phase=_optional(_phase, f("free_phase"), where + ".free_phase"),
                site=site(f("site"), where + ".site"),
                call_site=site(f("call_site"), where + ".call_site"),
                node=_optional(_str, f("node"), where + ".node"),
                module=_optional(_str, f("module"), where + ".module"),
                saved=_bool(f("saved"), where + ".saved"),
                preexisting=preexisting,
                facts=frozenset(
                    _fact(x, f"{where}.facts[{j}]")
                    for j, x in enumerate(_list(a.get("facts", []), where + ".facts"))
                ),
            )
        )
        if (allocations[-1].free_tick is None) != (allocations[-1].free_phase is None):
            raise _fail(where + ".free_phase", "set exactly when free_tick is", f("free_phase"))
    return ops, allocations


def log_from_dict(data: Any, *, fast: bool = True) -> TraceLog:
    """The :class:`TraceLog` in ``data`` (parsed JSON), checked field by field (``fast=False``: every
    row through the field-by-field checks; the result, or the error, is the same either way)."""
    if not isinstance(data, dict) or "schema" not in data:
        raise TraceFormatError("not a memtrim trace: expected a JSON object with a 'schema' field")
    if data["schema"] not in READABLE_SCHEMAS:
        raise TraceFormatError(
            f"trace schema {_prefix(data['schema'])} is not supported by this memtrim (reads "
            f"{', '.join(map(repr, READABLE_SCHEMAS))}); re-record the trace with this version"
        )
    get = lambda name: _field(data, name, "the trace")  # noqa: E731
    sites = []
    for i, row in enumerate(_list(get("sites"), "sites")):
        where = f"sites[{i}]"
        if not isinstance(row, list) or len(row) != 3:
            raise _fail(where, "[file, line, function]", row)
        sites.append(
            Site(
                _str(row[0], where + " file"),
                _int(row[1], where + " line"),
                _str(row[2], where + " function"),
            )
        )

    def site(value: Any, where: str) -> Site | None:
        if value is None:
            return None
        if type(value) is not int or not 0 <= value < len(sites):
            raise _fail(where, f"a site number below {len(sites)} or null", value)
        return sites[value]

    # the layout the file says it used: /1 had no inputs column, /2 writers may omit it too
    if data["schema"] == SCHEMA:
        columns = OP_COLUMNS
    else:
        columns = data.get("op_columns", OP_COLUMNS if data["schema"] == SCHEMA_V2 else OP_COLUMNS_V1)
    if columns not in (OP_COLUMNS, OP_COLUMNS_V1):
        raise _fail("op_columns", f"{OP_COLUMNS} or {OP_COLUMNS_V1}", columns)

    def op_from_row(row: Any, where: str) -> OpCall:
        if not isinstance(row, list) or len(row) != len(columns):
            raise _fail(where, "[" + ", ".join(columns) + "]", row)
        seq, tick, op, phase, site_index, node, module, *rest = row
        inputs = (
            tuple(_int(i, f"{where} inputs[{j}]") for j, i in enumerate(_list(rest[0], where + " inputs")))
            if rest
            else ()
        )
        return OpCall(
            _int(seq, where + " seq"),
            _int(tick, where + " tick"),
            _str(op, where + " op"),
            _phase(phase, where + " phase"),
            site(site_index, where + " site"),
            _optional(_str, node, where + " node"),
            _optional(_str, module, where + " module"),
            inputs,
        )

    if data["schema"] == SCHEMA:
        ops, allocations = column_layout.read(data, sites, _fail, _field)
    else:
        ops, allocations = _rows_v2(data, sites, site, columns, op_from_row, fast)
    cuda = get("cuda_max_allocated")
    if not isinstance(cuda, dict):
        raise _fail("cuda_max_allocated", "an object", cuda)
    metadata = data.get("metadata", {})
    if not isinstance(metadata, dict):
        raise _fail("metadata", "an object", metadata)
    regions = []
    for i, row in enumerate(_list(data.get("regions", []), "regions")):
        where = f"regions[{i}]"
        if not isinstance(row, list) or len(row) != 3:
            raise _fail(where, "[name, start_tick, end_tick]", row)
        regions.append(
            Region(
                _str(row[0], where + " name"),
                _int(row[1], where + " start_tick"),
                _optional(_int, row[2], where + " end_tick"),
            )
        )
    scalars: dict[int, tuple[tuple[str, float], ...]] = {}
    for i, row in enumerate(_list(data.get("scalars", []), "scalars")):
        where = f"scalars[{i}]"
        if not isinstance(row, list) or len(row) != 2:
            raise _fail(where, "[op number, [[argument name, value], ...]]", row)
        seq = _int(row[0], where + " op number")
        if seq >= len(ops):
            raise _fail(where + " op number", f"an op number below {len(ops)}", seq)
        pairs = []
        for j, pair in enumerate(_list(row[1], where + " arguments")):
            at = f"{where} arguments[{j}]"
            if not isinstance(pair, list) or len(pair) != 2 or type(pair[1]) not in (int, float):
                raise _fail(at, "[argument name, number]", pair)
            pairs.append((_str(pair[0], at + " name"), float(pair[1])))
        scalars[seq] = tuple(pairs)
    failed = get("failed_op")
    failed_op = None if failed is None else op_from_row(failed, "failed_op")
    end_tick = _int(get("end_tick"), "end_tick")
    check_invariants(ops, allocations, regions, end_tick, failed_op, _fail)
    return TraceLog.of(
        allocations,
        ops,
        end_tick=end_tick,
        fake=_bool(get("fake"), "fake"),
        error=_optional(_str, get("error"), "error"),
        failed_op=failed_op,
        cuda_max_allocated={
            _str(k, "cuda_max_allocated key"): _int(v, f"cuda_max_allocated[{k!r}]") for k, v in cuda.items()
        },
        metadata=metadata,
        regions=regions,
        scalars=scalars,
    )


# -- files -----------------------------------------------------------------------------------------
STALE_TEMPORARY_SECONDS = 3600
"""A temporary of the same target this old is left over from a killed save, whoever wrote it."""


def _writer_gone(pid: str) -> bool:
    """Whether the process that named a temporary (its pid is in the name) has ended."""
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return True
    except OSError:  # alive, someone else's
        return False
    return False


def _remove_stale_temporaries(folder: str, name: str) -> None:
    """Remove ``.NAME.PID-XXXXXXXX.memtrim-tmp`` files of the same target whose writer has ended (a save
    killed before its rename, ``kill -9``, leaves one behind) or that are an hour old (a writer on
    another machine sharing the folder); a live writer's temporary is left alone."""
    prefix, suffix, now = f".{name}.", ".memtrim-tmp", time.time()
    try:
        entries = os.listdir(folder)
    except OSError:
        return
    for entry in entries:
        if not (entry.startswith(prefix) and entry.endswith(suffix)):
            continue
        pid, _, token = entry[len(prefix) : -len(suffix)].partition("-")
        if not (pid.isdigit() and len(token) == 8):
            continue
        stale = os.path.join(folder, entry)
        with contextlib.suppress(OSError):
            if _writer_gone(pid) or now - os.lstat(stale).st_mtime >= STALE_TEMPORARY_SECONDS:
                os.unlink(stale)


@contextlib.contextmanager
def atomic_file(path: str, *, binary: bool = False) -> Iterator[IO[Any]]:
    """A file that appears at ``path`` whole or not at all: a temporary file in the same folder, renamed
    when the block ends (removed if it raises), so a crash never leaves half a file.

    The file gets the permissions ``open(path, "w")`` would give it (0666 less the umask), not
    ``mkstemp``'s 0600; an existing file's permissions are kept.
    """
    folder = os.path.dirname(os.path.abspath(path))
    _remove_stale_temporaries(folder, os.path.basename(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}-{secrets.token_hex(4)}.memtrim-tmp")
    try:
        mode = os.stat(path).st_mode & 0o7777
    except OSError:
        mode = None
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8") as handle:
            yield handle
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_text_atomically(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through :func:`atomic_file`."""
    with atomic_file(path) as handle:
        handle.write(text)


def check_writable(path: str) -> None:
    """Raise ``OSError`` now if ``path`` could not be written later (its folder is missing or read-only,
    or it is a folder): checked before a long run so that the run's trace is not lost at the end."""
    target = os.path.abspath(path)
    folder = os.path.dirname(target)
    if os.path.isdir(target):
        raise IsADirectoryError(f"{path} is a folder; give a file name")
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"the folder of {path} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write in the folder of {path}")


def dumps(log: TraceLog, summary: Mapping[str, Any] | None = None) -> str:
    """``{schema, <summary>, <raw log>}`` as JSON text."""
    raw = log_to_dict(log)
    data = {"schema": raw.pop("schema"), **(summary or {}), **raw}
    return json.dumps(data, indent=1, allow_nan=False) + "\n"


def save(log: TraceLog, path: str, summary: Mapping[str, Any] | None = None) -> None:
    write_text_atomically(path, dumps(log, summary))


MAX_TRACE_BYTES = 4 << 30
"""The most :func:`load` reads: a bigger file is refused before it is parsed (JSON of that size would
need several times as much memory to parse)."""


def _prefix(value: Any, limit: int = 40) -> str:
    """``repr(value)``, cut to its first ``limit`` characters: errors quote what they refuse, briefly."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _no_constants(name: str) -> Any:
    raise TraceFormatError(f"malformed memtrim trace: {name} is not a number a trace can hold")


def loads(text: str | bytes, source: str = "the trace") -> TraceLog:
    with collector_paused():
        return _loads(text, source)


def _loads(text: str | bytes, source: str) -> TraceLog:
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        data = json.loads(text, parse_constant=_no_constants)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TraceFormatError(f"{source} is not JSON ({exc}); memtrim traces are JSON files") from exc
    except RecursionError as exc:
        raise TraceFormatError(f"{source} nests too deeply to be a memtrim trace") from exc
    except ValueError as exc:  # Python's int-string limit (an integer of thousands of digits)
        raise TraceFormatError(f"{source} holds a number too long for a memtrim trace ({exc})") from exc
    return log_from_dict(data)


def load(path: str) -> TraceLog:
    """Read a trace log written by :func:`save`."""
    # O_NONBLOCK: opening a FIFO must not wait for a writer; anything but a regular file is refused
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise TraceFormatError(f"{path} is not a regular file (a pipe, a device or a socket)")
        raw = handle.read(MAX_TRACE_BYTES + 1)
    if len(raw) > MAX_TRACE_BYTES:
        raise TraceFormatError(f"{path} is larger than {MAX_TRACE_BYTES >> 30} GiB, too large for a trace")
    return loads(raw, path)
