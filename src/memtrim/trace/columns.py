"""The ``memtrim.trace/3`` layout: ops and allocations as columns, strings and sites as tables.

/2 wrote each op as a row and each allocation as an object: a million-op trace was 265 MiB of JSON,
most of it the same field names and the same op, dtype and module strings over and over, and JSON
parsed and encoded that one value at a time. /3 holds the same values (nothing is dropped or derived)
in this shape::

    "sites": [[file, line, function], ...],
    "strings": ["aten.mm.default", "forward", "float32", ...],
    "ops": {"count": N, "tick": [...], "op": [...], "phase": [...], "site": [...], "node": [...],
            "module": [...], "inputs": [[...], ...]},
    "allocations": {"count": M, "bytes": [...], ..., "facts": [[...], ...]},

Every column has ``count`` values, the i-th of each column belongs to op (allocation) i; op names,
phases, nodes, modules, dtypes, devices and facts are numbers in ``strings``, sites numbers in
``sites`` (``null``: none). A whole column is checked at once (its types, its range) and only a column
that fails is walked value by value, so a bad file is still one error naming the field and the row
(``allocations[7].bytes``), as for /2.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import accumulate, chain, islice, repeat
from operator import attrgetter, is_, itemgetter
from typing import Any

from memtrim.trace.model import Allocation, Fact, OpLog, OpRow, Phase, Site, TraceLog

COLUMN_SCHEMA = "memtrim.trace/3"
OP_FIELDS = ("tick", "op", "phase", "site", "node", "module", "inputs")
ALLOCATION_FIELDS = (
    "bytes",
    "dtype",
    "shape",
    "device",
    "op",
    "phase",
    "alloc_tick",
    "free_tick",
    "free_phase",
    "site",
    "call_site",
    "node",
    "module",
    "saved",
    "preexisting",
    "facts",
)

MAX_INT = 2**62
_NONE = type(None)


# -- writing ---------------------------------------------------------------------------------------
class _Numbers(dict[Any, Any]):
    """Values to their numbers in a table, each numbered when first seen (``None``: ``None``)."""

    def __init__(self, entry: Callable[[Any], Any]) -> None:
        super().__init__({None: None})
        self.table: list[Any] = []
        self._entry = entry

    def __missing__(self, key: Any) -> int:
        number = self[key] = len(self.table)
        self.table.append(self._entry(key))
        return number


class _FactNumbers(dict[frozenset[Fact], list[int]]):
    """An allocation's facts to their string numbers, in the order of their values."""

    def __init__(self, strings: _Numbers) -> None:
        super().__init__()
        self._strings = strings

    def __missing__(self, facts: frozenset[Fact]) -> list[int]:
        found = self[facts] = [self._strings[f] for f in sorted(facts, key=attrgetter("value"))]
        return found


class Tables:
    """The site, string and shape tables of one log, filled as its columns are written: a value gets
    its number the first time a column holds it, so the tables are complete once every column is."""

    def __init__(self) -> None:
        self._strings = _Numbers(str)  # a Phase or Fact member is its value (str-valued enums)
        self._shapes = _Numbers(list)
        self.sites: list[Site] = []
        self._site_by_value: dict[Site, int] = {}
        # Sites are shared objects (the recorder keeps one per frame and line): looked up by identity,
        # which skips hashing the dataclass; an equal but distinct object gets the same number
        self._site_by_id: dict[int, int | None] = {id(None): None}
        self._facts = _FactNumbers(self._strings)

    @property
    def strings(self) -> list[str]:
        return self._strings.table

    @property
    def shapes(self) -> list[list[int]]:
        return self._shapes.table

    def site(self, chunk: list[Site | None]) -> list[int | None]:
        ids = list(map(id, chunk))
        by_id = self._site_by_id
        try:
            return list(map(by_id.__getitem__, ids))
        except KeyError:
            for key, site in zip(ids, chunk, strict=True):
                if key not in by_id:
                    number = self._site_by_value.setdefault(site, len(self.sites))  # type: ignore[arg-type]
                    if number == len(self.sites):
                        self.sites.append(site)  # type: ignore[arg-type]
                    by_id[key] = number
            return list(map(by_id.__getitem__, ids))

    def string(self, chunk: list[Any]) -> list[int | None]:
        return list(map(self._strings.__getitem__, chunk))

    def shape(self, chunk: list[tuple[int, ...]]) -> list[int]:
        return list(map(self._shapes.__getitem__, chunk))

    def facts(self, chunk: list[frozenset[Fact]]) -> list[list[int]]:
        return list(map(self._facts.__getitem__, chunk))


Column = tuple[str, Callable[[], Iterable[Any]], Callable[[list[Any]], list[Any]] | None]
"""A column's name, its values (made anew for each pass), and what turns a chunk of them into the
numbers written (``None``: written as they are)."""


def op_columns(log: TraceLog, tables: Tables) -> list[Column]:
    rows = log.ops.rows

    def field(i: int) -> Callable[[], Iterable[Any]]:
        return lambda: map(itemgetter(i), rows)

    return [
        ("tick", field(0), None),
        ("op", field(1), tables.string),
        ("phase", field(2), tables.string),
        ("site", field(3), tables.site),
        ("node", field(4), tables.string),
        ("module", field(5), tables.string),
        ("input_count", lambda: map(len, map(itemgetter(6), rows)), None),
        ("inputs", lambda: chain.from_iterable(map(itemgetter(6), rows)), None),
    ]


def allocation_columns(log: TraceLog, tables: Tables) -> list[Column]:
    allocations = log.allocations
    convert: dict[str, Callable[[list[Any]], list[Any]]] = {
        **dict.fromkeys(("dtype", "device", "op", "phase", "free_phase", "node", "module"), tables.string),
        "site": tables.site,
        "call_site": tables.site,
        "facts": tables.facts,
        "shape": tables.shape,
    }

    def field(name: str) -> Callable[[], Iterable[Any]]:
        return lambda: map(attrgetter(name), allocations)

    return [(name, field(name), convert.get(name)) for name in ALLOCATION_FIELDS]


def column_chunks(column: Column, size: int) -> Iterator[list[Any]]:
    """A column's values as written, in lists of ``size``."""
    _, source, convert = column
    values = iter(source())
    while chunk := list(islice(values, size)):
        yield chunk if convert is None else convert(chunk)


# -- reading ---------------------------------------------------------------------------------------
Fail = Callable[[str, str, Any], Exception]
Field = Callable[[Mapping[str, Any], str, str], Any]


class _Reader:
    """Reads one section (``ops`` or ``allocations``) of a /3 file, column by column."""

    def __init__(
        self, data: Any, section: str, fail: Fail, field: Callable[[Mapping[str, Any], str, str], Any]
    ):
        if not isinstance(data, dict):
            raise fail(section, "an object of columns", data)
        count = field(data, "count", section)
        if type(count) is not int or not 0 <= count < MAX_INT:
            raise fail(section + ".count", "an integer from 0 to 2**62", count)
        self.data, self.section, self.count, self.fail, self._field = data, section, count, fail, field

    def where(self, i: int, name: str) -> str:
        return f"ops[{i}] {name}" if self.section == "ops" else f"allocations[{i}].{name}"

    def column(self, name: str) -> list[Any]:
        values = self._field(self.data, name, self.section)
        if type(values) is not list or len(values) != self.count:
            raise self.fail(f"{self.section}.{name}", f"a list of {self.count} values", _Cut(values))
        return values

    def bad(self, name: str, values: Sequence[Any], ok: Callable[[Any], bool], expected: str) -> Exception:
        """The error naming the first value of a column that ``ok`` refuses."""
        for i, value in enumerate(values):
            if not ok(value):
                return self.fail(self.where(i, name), expected, value)
        return self.fail(f"{self.section}.{name}", expected, _Cut(values))  # not reached

    def ints(self, name: str, *, low: int = 0, nullable: bool = False) -> list[int | None]:
        values = self.column(name)
        if _ints(values, low=low, nullable=nullable):
            return values

        def ok(v: Any) -> bool:
            return (v is None and nullable) or (type(v) is int and low <= v < MAX_INT)

        return _raise(self.bad(name, values, ok, f"an integer from {low} to 2**62" + " or null" * nullable))

    def bools(self, name: str) -> list[bool]:
        values = self.column(name)
        if values and not set(map(type, values)) <= {bool}:
            raise self.bad(name, values, lambda v: type(v) is bool, "true or false")
        return values

    def refs(
        self, name: str, table: Mapping[Any, Any], expected: str, *, nullable: bool = False
    ) -> list[Any]:
        """The column's values looked up in ``table`` (numbers to values; ``None`` to ``None`` when
        ``nullable``): only ints (never a bool or a float equal to one) that ``table`` holds."""
        values = self.column(name)
        types = set(map(type, values))
        if types <= ({int, _NONE} if nullable else {int}):
            try:
                return list(map(table.__getitem__, values))
            except KeyError:
                pass

        def ok(v: Any) -> bool:
            return (v is None and nullable) or (type(v) is int and v in table)

        return _raise(self.bad(name, values, ok, expected + " or null" * nullable))

    def flat_lists(self, name: str, count_name: str) -> list[tuple[int, ...]]:
        """Column ``name`` (every row's list, end to end) cut into rows by the lengths in ``count_name``."""
        counts: list[int] = self.ints(count_name)  # type: ignore[assignment]
        values = self._field(self.data, name, self.section)
        total = sum(counts)
        if type(values) is not list or len(values) != total:
            expected = f"a list of {total} values (the sum of {count_name})"
            raise self.fail(f"{self.section}.{name}", expected, _Cut(values))
        if not _ints(values):
            ends = list(accumulate(counts))
            for k, v in enumerate(values):
                if type(v) is not int or not 0 <= v < MAX_INT:
                    i = bisect_right(ends, k)
                    where = f"{self.where(i, name)}[{k - (ends[i - 1] if i else 0)}]"
                    raise self.fail(where, "an integer from 0 to 2**62", v)
        flat = iter(values)
        return list(map(tuple, map(islice, repeat(flat), counts)))


class _Cut:
    """A column shown in an error by its start."""

    def __init__(self, values: Any) -> None:
        self.values = values

    def __repr__(self) -> str:
        text = repr(self.values[:5] if isinstance(self.values, list) else self.values)
        return text


def _raise(error: Exception) -> Any:
    raise error


def _ints(values: list[Any], *, low: int = 0, nullable: bool = False) -> bool:
    if not values:
        return True
    types = set(map(type, values))
    if types == {int}:
        return min(values) >= low and max(values) < MAX_INT
    if nullable and types == {int, _NONE}:
        present = [v for v in values if v is not None]
        return min(present) >= low and max(present) < MAX_INT
    return nullable and types == {_NONE}


def _shapes(values: Any, fail: Fail) -> dict[int, tuple[int, ...]]:
    """The shape table: numbers to shapes."""
    if type(values) is list and set(map(type, values)) <= {list} and _ints(list(chain.from_iterable(values))):
        return dict(enumerate(map(tuple, values)))
    if type(values) is not list:
        raise fail("shapes", "a list", _Cut(values))
    for i, shape in enumerate(values):
        if type(shape) is not list:
            raise fail(f"shapes[{i}]", "a list", shape)
        for j, v in enumerate(shape):
            if type(v) is not int or not 0 <= v < MAX_INT:
                raise fail(f"shapes[{i}][{j}]", "an integer from 0 to 2**62", v)
    raise fail("shapes", "lists of integers", _Cut(values))  # not reached


def _fact_sets(a: _Reader, facts: dict[int, Fact], expected: str) -> list[frozenset[Fact]]:
    """The facts column as sets: each distinct list made a set once."""
    values = a.column("facts")
    if set(map(type, values)) <= {list}:
        flat = set(chain.from_iterable(values))
        if set(map(type, flat)) <= {int} and flat <= facts.keys():
            keys = list(map(tuple, values))
            sets = {key: frozenset(map(facts.__getitem__, key)) for key in dict.fromkeys(keys)}
            return list(map(sets.__getitem__, keys))
    for i, numbers in enumerate(values):
        if type(numbers) is not list:
            raise a.fail(a.where(i, "facts"), "a list", numbers)
        for j, n in enumerate(numbers):
            if type(n) is not int or n not in facts:
                raise a.fail(f"{a.where(i, 'facts')}[{j}]", expected, n)
    raise a.fail("allocations.facts", expected, _Cut(values))  # not reached


def _kind_table(strings: list[str], kind: type[Phase] | type[Fact]) -> dict[int, Any]:
    members = {m.value: m for m in kind}
    return {i: members[s] for i, s in enumerate(strings) if s in members}


def read(
    data: Mapping[str, Any],
    sites: list[Site],
    fail: Fail,
    field: Field,
) -> tuple[OpLog, list[Allocation]]:
    """The ops and allocations of a /3 file (``sites`` already read and checked)."""
    strings = field(data, "strings", "the trace")
    if type(strings) is not list or not set(map(type, strings)) <= {str}:
        if type(strings) is not list:
            raise fail("strings", "a list", _Cut(strings))
        i = next(i for i, s in enumerate(strings) if type(s) is not str)
        raise fail(f"strings[{i}]", "a string", strings[i])
    text: dict[Any, Any] = dict(enumerate(strings))
    text_or_none = {**text, None: None}
    site_of: dict[Any, Site | None] = {**dict(enumerate(sites)), None: None}
    phases, facts = _kind_table(strings, Phase), _kind_table(strings, Fact)
    phase_names = ", ".join(repr(p.value) for p in Phase)
    fact_names = ", ".join(repr(f.value) for f in Fact)
    string_number = f"a string number below {len(strings)}"
    site_number = f"a site number below {len(sites)}"
    shape_number = "a number in shapes"
    phase_number = f"one of {phase_names} (its number in strings)"

    o = _Reader(field(data, "ops", "the trace"), "ops", fail, field)
    op_values = (
        o.ints("tick"),
        o.refs("op", text, string_number),
        o.refs("phase", phases, phase_number),
        o.refs("site", site_of, site_number, nullable=True),
        o.refs("node", text_or_none, string_number, nullable=True),
        o.refs("module", text_or_none, string_number, nullable=True),
        o.flat_lists("inputs", "input_count"),
    )
    make_row = tuple.__new__
    ops = OpLog(list(map(make_row, repeat(OpRow), zip(*op_values, strict=True))))

    a = _Reader(field(data, "allocations", "the trace"), "allocations", fail, field)
    preexisting = a.bools("preexisting")
    alloc_tick: list[int] = a.ints("alloc_tick", low=-1)  # type: ignore[assignment]
    if alloc_tick and min(alloc_tick) < 0:
        for i, (tick, before) in enumerate(zip(alloc_tick, preexisting, strict=True)):
            if tick < 0 and not before:
                raise fail(a.where(i, "alloc_tick"), "an integer from 0 to 2**62", tick)
    free_tick = a.ints("free_tick", nullable=True)
    free_phase = a.refs("free_phase", {**phases, None: None}, phase_number, nullable=True)
    if list(map(is_, free_tick, repeat(None))) != list(map(is_, free_phase, repeat(None))):
        i = next(
            i
            for i, (t, p) in enumerate(zip(free_tick, free_phase, strict=True))
            if (t is None) != (p is None)
        )
        raise fail(a.where(i, "free_phase"), "set exactly when free_tick is", a.column("free_phase")[i])
    fact_sets = _fact_sets(a, facts, f"one of {fact_names} (its number in strings)")
    columns = (
        range(a.count),
        a.ints("bytes"),
        a.refs("dtype", text, string_number),
        a.refs("shape", _shapes(field(data, "shapes", "the trace"), fail), shape_number),
        a.refs("device", text, string_number),
        a.refs("op", text, string_number),
        a.refs("phase", phases, phase_number),
        alloc_tick,
        free_tick,
        free_phase,
        a.refs("site", site_of, site_number, nullable=True),
        a.refs("call_site", site_of, site_number, nullable=True),
        a.refs("node", text_or_none, string_number, nullable=True),
        a.refs("module", text_or_none, string_number, nullable=True),
        a.bools("saved"),
        preexisting,
        fact_sets,
    )
    return ops, list(map(Allocation, *columns))
