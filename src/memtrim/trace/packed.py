"""Sealed rows: what the recorder wrote a while ago, packed into arrays while the region still runs.

As the recorder writes them, an op is an :class:`~memtrim.trace.model.OpRow` tuple with its tick and
its inputs tuple, an allocation an ``AllocRow`` with its numbers, a free a ``FreeRow`` in a dict and
facts a set in another: about 400 B of Python objects per recorded op, which a 20,000-step loop of
small ops (600k ops) grows to a quarter of a GiB. Every few thousand ops the recorder seals all but
its latest rows (:data:`SEAL_EVERY`, :data:`KEEP_RECENT`): ticks, sizes and inputs go into
``array`` columns, the repeated parts of a row (op name, phase, site, node and module; dtype, device,
shape and call site) become a number in a table, frees and facts become columns of their own, and
the row's slot in its list becomes ``None``. Nothing is derived or dropped. A seal is C-level
iteration (``map``, ``zip``, ``array.fromlist``) but for the few values a chunk meets for the first
time: it must not slow down the program it records.

Reading a log (:attr:`OpLog.rows <memtrim.trace.model.OpLog.rows>`, ``AllocationLog.rows``,
``.frees``, ``.facts``) unpacks it in place first, once: readers get back the rows that were written.
Sites are numbered by identity, so an unpacked row holds the very ``Site`` object it was written with
(an allocation's call site is compared to its op's site with ``is``); strings, phases, dtypes,
devices and shapes by value.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import accumulate, chain, islice, repeat
from operator import itemgetter
from typing import Any

SEAL_EVERY = 8192
"""Op rows written between two seals."""
KEEP_RECENT = 1024
"""The latest rows a seal leaves as tuples: the recorder reads its newest rows back (the last op's
phase and site, a storage's row when it is resized)."""

_FIELDS = [itemgetter(i) for i in range(7)]


class _Kinds:
    """The repeated fields of rows (an op's op, phase, site, node and module) as one number each.

    A field is keyed by value, or with ``by_identity`` by the object itself (a ``Site``: read back as
    the same object; the table holds it, so no other object can take its id).
    """

    __slots__ = ("by_identity", "numbers", "positions", "values")

    def __init__(self, positions: Sequence[int], by_identity: Sequence[bool]) -> None:
        self.positions = tuple(positions)
        self.by_identity = tuple(by_identity)
        self.numbers: dict[tuple[Any, ...], int] = {}
        self.values: list[tuple[Any, ...]] = []

    def _keys(self, rows: Iterable[Sequence[Any]]) -> list[tuple[Any, ...]]:
        columns = [map(_FIELDS[at], rows) for at in self.positions]
        keyed = [
            map(id, column) if identity else column
            for column, identity in zip(columns, self.by_identity, strict=True)
        ]
        return list(zip(*keyed, strict=True))

    def numbers_of(self, rows: list[Any]) -> Iterator[int]:
        """The kind numbers of ``rows``, numbering the kinds first seen."""
        keys, numbers = self._keys(rows), self.numbers
        new = [key for key in dict.fromkeys(keys) if key not in numbers]
        if new:
            row_of = dict(zip(keys, rows, strict=True))
            for key in new:
                numbers[key] = len(self.values)
                self.values.append(tuple(map(row_of[key].__getitem__, self.positions)))
        return map(numbers.__getitem__, keys)

    def replace(self, at: int, new: dict[Any, Any]) -> None:
        """Field ``at`` (its index in the kinds) becomes ``new[value]`` where ``new`` has it."""
        self.values = [(*kind[:at], new.get(kind[at], kind[at]), *kind[at + 1 :]) for kind in self.values]
        self.numbers = {
            tuple(id(v) if identity else v for v, identity in zip(kind, self.by_identity, strict=True)): n
            for n, kind in enumerate(self.values)
        }


class PackedOps:
    """Op rows ``[0, end)`` as columns: tick, the kind (op, phase, site, node, module), and the inputs
    as one flat column with each row's end in it."""

    __slots__ = ("end", "input_ends", "inputs", "kinds", "ticks", "types")

    def __init__(self) -> None:
        self.end = 0
        self.ticks = array("q")
        self.kinds = array("q")
        self.inputs = array("q")
        self.input_ends = array("q")
        self.types = _Kinds((1, 2, 3, 4, 5), (False, True, True, False, False))

    def seal(self, rows: list[Any], end: int) -> None:
        """Pack ``rows[self.end:end]`` and leave ``None`` in their slots."""
        start = self.end
        if end <= start:
            return
        chunk = rows[start:end]
        self.ticks.fromlist(list(map(_FIELDS[0], chunk)))
        self.kinds.fromlist(list(self.types.numbers_of(chunk)))
        lengths = map(len, map(_FIELDS[6], chunk))
        self.input_ends.fromlist(list(islice(accumulate(lengths, initial=len(self.inputs)), 1, None)))
        self.inputs.fromlist(list(chain.from_iterable(map(_FIELDS[6], chunk))))
        rows[start:end] = repeat(None, end - start)
        self.end = end

    def row(self, make: Callable[[tuple[Any, ...]], Any], index: int) -> Any:
        first = self.input_ends[index - 1] if index else 0
        inputs = tuple(self.inputs[first : self.input_ends[index]])
        return make((self.ticks[index], *self.types.values[self.kinds[index]], inputs))

    def unpack(self, make: Callable[[tuple[Any, ...]], Any], rows: list[Any]) -> None:
        """Put every packed row back in ``rows`` (a slot written since it was sealed is kept)."""
        kinds, flat, ends = self.types.values, self.inputs, self.input_ends
        starts = chain((0,), ends)
        unpacked = [
            make((tick, *kinds[kind], tuple(flat[first:last])))
            for tick, kind, first, last in zip(self.ticks, self.kinds, starts, ends, strict=False)
        ]
        _keep_written(rows, unpacked)

    def sites(self) -> list[Any]:
        return [kind[2] for kind in self.types.values]

    def modules(self) -> list[str]:
        return [kind[4] for kind in self.types.values if kind[4]]

    def rename_modules(self, new: dict[str, str]) -> None:
        self.types.replace(4, new)


class PackedAllocations:
    """Allocation rows ``[0, end)`` as columns (op number, bytes, tick, the kind: dtype, shape,
    device and call site), and the frees and facts sealed so far, each as row numbers with the free's
    tick and phase, the facts' bits (bit ``i``: ``fact_order[i]``)."""

    __slots__ = (
        "bytes",
        "end",
        "fact_bits",
        "fact_rows",
        "free_phases",
        "free_rows",
        "free_ticks",
        "kinds",
        "phases",
        "seqs",
        "ticks",
        "types",
    )

    def __init__(self) -> None:
        self.end = 0
        self.seqs = array("q")
        self.bytes = array("q")
        self.ticks = array("q")
        self.kinds = array("q")
        self.types = _Kinds((2, 3, 4, 6), (False, False, False, True))
        self.free_rows = array("q")
        self.free_ticks = array("q")
        self.free_phases = array("q")
        self.phases = _Kinds((1,), (True,))
        self.fact_rows = array("q")
        self.fact_bits = array("q")

    def seal(
        self,
        rows: list[Any],
        end: int,
        frees: dict[int, Any],
        facts: dict[int, set[Any]],
        fact_order: Sequence[Any],
    ) -> None:
        """Pack ``rows[self.end:end]`` (their slots become ``None``), and move every free and fact
        written so far out of ``frees`` and ``facts``."""
        start = self.end
        if end > start:
            chunk = rows[start:end]
            self.seqs.fromlist(list(map(_FIELDS[0], chunk)))
            self.bytes.fromlist(list(map(_FIELDS[1], chunk)))
            self.ticks.fromlist(list(map(_FIELDS[5], chunk)))
            self.kinds.fromlist(list(self.types.numbers_of(chunk)))
            rows[start:end] = repeat(None, end - start)
            self.end = end
        if frees:
            sealed = list(frees.values())
            self.free_rows.fromlist(list(frees))
            self.free_ticks.fromlist(list(map(_FIELDS[0], sealed)))
            self.free_phases.fromlist(list(self.phases.numbers_of(sealed)))
            frees.clear()
        if facts:
            bit = {fact: 1 << i for i, fact in enumerate(fact_order)}.__getitem__
            self.fact_rows.fromlist(list(facts))
            self.fact_bits.fromlist(list(sum(map(bit, found)) for found in facts.values()))
            facts.clear()

    def row(self, make: Callable[[tuple[Any, ...]], Any], index: int) -> Any:
        dtype, shape, device, call_site = self.types.values[self.kinds[index]]
        return make((self.seqs[index], self.bytes[index], dtype, shape, device, self.ticks[index], call_site))

    def seqs_of(self, rows: list[Any]) -> Iterator[int]:
        """Every row's op number, packed or not."""
        return chain(self.seqs, map(_FIELDS[0], rows[self.end :]))

    def unpack(
        self,
        make: Callable[[tuple[Any, ...]], Any],
        make_free: Callable[[tuple[Any, ...]], Any],
        rows: list[Any],
        frees: dict[int, Any],
        facts: dict[int, set[Any]],
        fact_order: Sequence[Any],
    ) -> None:
        """Put every packed row, free and fact back (what was written since it was sealed wins)."""
        kinds = self.types.values
        unpacked = [
            make((seq, size, dtype, shape, device, tick, call_site))
            for seq, size, tick, (dtype, shape, device, call_site) in zip(
                self.seqs, self.bytes, self.ticks, map(kinds.__getitem__, self.kinds), strict=True
            )
        ]
        _keep_written(rows, unpacked)
        phases = self.phases.values
        sealed = {
            index: make_free((tick, phases[phase][0]))
            for index, tick, phase in zip(self.free_rows, self.free_ticks, self.free_phases, strict=True)
        }
        sealed.update(frees)  # (in the order freed: every sealed free came before those in frees)
        frees.clear()
        frees.update(sealed)
        for index, bits in zip(self.fact_rows, self.fact_bits, strict=True):
            facts.setdefault(index, set()).update(fact for i, fact in enumerate(fact_order) if bits >> i & 1)


def _keep_written(rows: list[Any], unpacked: list[Any]) -> None:
    """``rows[:len(unpacked)] = unpacked``, but a slot written since it was sealed keeps that row."""
    for index, row in enumerate(rows[: len(unpacked)]):
        if row is not None:
            unpacked[index] = row
    rows[: len(unpacked)] = unpacked
