"""The trace: a plain, versioned event log of one tracked region. It holds no tensors and answers no
questions: peaks, categories, roles and diagnoses are computed from it by :mod:`memtrim.analysis`.

This package imports nothing else of memtrim (a test guards the edge): it is the data every stage
reads, so it must not depend on any of them.

Row layouts (what the recorder appends on its hot path; see docs/ARCHITECTURE.md):

- :class:`OpRow` ``(tick, op, phase, site, node, module, inputs)``, one per aten op; an op's number
  (its ``seq``) is its index in the log; ``inputs`` are the allocation rows of the storages it read
  (or wrote in place): the data flow the diagnoses follow.
- :class:`AllocRow` ``(seq, bytes, dtype, shape, device, tick, call_site)``, one per storage; ``seq``
  is the number of the op that made it, or -1 for a storage that existed before the region.
- :class:`FreeRow` ``(tick, phase)`` per freed allocation, keyed by the allocation's row number.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple, overload

from memtrim.trace.packed import PackedAllocations, PackedOps

SCHEMA = "memtrim.trace/3"
"""What :func:`~memtrim.trace.save` writes. /2 added allocation facts and regions to /1; /3 holds /2's
values as columns with string and site tables (:mod:`memtrim.trace.columns`). /1 and /2 load too."""

SCALAR_OPS = frozenset(
    f"aten.{name}.{overload}"
    for name in ("mul", "div", "add", "sub", "rsub")
    for overload in ("Tensor", "Scalar")
) | {"aten.slice.Tensor"}
"""The ops whose Python-number operands the recorder keeps (:attr:`TraceLog.scalars`): arithmetic with
a number, and ``slice`` (its dim, start, end and step: a copy of ``logits[:, :-1]`` before a loss)."""


class Phase(str, Enum):
    """Which part of a training step an op ran in."""

    FORWARD = "forward"
    """Grad mode on, or inside a custom ``autograd.Function.forward``."""
    BACKWARD = "backward"
    """Run by the autograd engine (built-in nodes, custom ``Function.backward``, the seed gradient)."""
    OPTIMIZER = "optimizer"
    """Inside a ``torch.optim`` optimizer (``step``, ``zero_grad``)."""
    OTHER = "other"
    """``no_grad``/``inference_mode`` code outside an optimizer."""

    def __str__(self) -> str:
        return self.value


class Fact(str, Enum):
    """What the recorder saw a storage used as, beyond the op that made it. Roles are decided from
    these (:mod:`memtrim.analysis.roles`); an allocation can have several."""

    PARAMETER = "parameter"
    """Held by an ``nn.Parameter``, or by a leaf tensor that requires grad."""
    GRADIENT = "gradient"
    """Held as a leaf's ``.grad``, or made by autograd's gradient accumulation."""
    OPTIMIZER_STATE = "optimizer_state"
    """Held in a ``torch.optim.Optimizer``'s ``state``."""
    BUFFER = "buffer"
    """Held by an ``nn.Module`` buffer."""
    SHARDED_PARAMETER = "sharded_parameter"
    """This rank's shard of a parameter sharded over ranks (the local tensor of a DTensor parameter
    with a ``Shard`` placement: FSDP2's sharded parameters)."""
    UNSHARDED_PARAMETER = "unsharded_parameter"
    """A whole parameter gathered from the ranks' shards for compute (FSDP2's per-parameter
    all-gather outputs)."""
    ALL_GATHER_BUFFER = "all_gather_buffer"
    """What an all-gather into one tensor wrote (``all_gather_into_tensor``; FSDP2's flat buffer,
    copied out into the unsharded parameters)."""
    REDUCE_SCATTER_BUFFER = "reduce_scatter_buffer"
    """What a reduce-scatter of one tensor read (``reduce_scatter_tensor``: FSDP2's flat gradients),
    and a backend's own copy of it (gloo reduces a clone)."""
    GRADIENT_BUCKET = "gradient_bucket"
    """A flat tensor all-reduced in backward (DDP's gradient buckets)."""

    def __str__(self) -> str:
        return self.value


_FACT_ORDER = tuple(Fact)  # a packed row's facts: bit i for the i-th


@dataclass(frozen=True, slots=True)
class Region:
    """A named span of the recorded timeline (``memtrim.region("step")``); ``end_tick`` is None while
    it is open (or when the program stopped inside it)."""

    name: str
    start_tick: int
    end_tick: int | None = None


PRE_REGION_OP = "(before the region)"
"""The op name of a storage that existed before the region (first seen as an input)."""


@dataclass(frozen=True, slots=True)
class Site:
    """A source line in the user's code."""

    file: str
    line: int
    function: str

    def text(self, *, path_parts: int | None = 2) -> str:
        """``prog.py:4 in <module>``; ``path_parts`` keeps that many trailing parts of the path
        (``None``: the whole path)."""
        return f"{shorten_path(self.file, path_parts)}:{self.line} in {self.function}"

    def __str__(self) -> str:
        return self.text(path_parts=None)


def site_text(site: Site | None, *, path_parts: int | None = 2) -> str:
    """:meth:`Site.text`, or ``(no user frame)`` for an op no user code ran."""
    return "(no user frame)" if site is None else site.text(path_parts=path_parts)


def shorten_path(path: str, parts: int | None = 2) -> str:
    """The last ``parts`` components of ``path`` (all of it for ``None``)."""
    if not path:
        return "?"
    if parts is None:
        return path
    return "/".join(path.replace("\\", "/").split("/")[-parts:])


def shape_text(shape: Sequence[int]) -> str:
    """``64x12x64x768``; ``scalar`` for a 0-dim tensor."""
    return "x".join(map(str, shape)) or "scalar"


_names: dict[Any, str] = {}


def dtype_name(value: Any) -> str:
    """``float32`` for ``torch.float32``, ``cuda:0`` for a device: how names are kept in a trace."""
    name = _names.get(value)
    if name is None:
        name = _names[value] = str(value).removeprefix("torch.")
    return name


class OpRow(NamedTuple):
    """One aten op call as the recorder stores it."""

    tick: int
    op: str
    phase: Phase
    site: Site | None
    node: str | None
    module: str | None
    inputs: tuple[int, ...] = ()
    """Allocation rows of the storages the op was handed (each once, in argument order)."""


class AllocRow(NamedTuple):
    """One storage as the recorder stores it; dtype, shape and device as torch gave them."""

    seq: int
    bytes: int
    dtype: Any
    shape: Any
    device: Any
    tick: int
    call_site: Site | None


class FreeRow(NamedTuple):
    tick: int
    phase: Phase


@dataclass(slots=True)
class OpCall:
    """One aten op call seen inside the region."""

    seq: int
    tick: int
    op: str
    phase: Phase
    site: Site | None
    node: str | None = None
    module: str | None = None
    inputs: tuple[int, ...] = ()
    """Ids of the allocations whose storages the op was handed."""


class OpLog(Sequence[OpCall]):
    """Every op call as :class:`OpRow` rows (one tuple per op while recording: cheap, and no work for
    the garbage collector; older ones packed every few thousand ops, :mod:`memtrim.trace.packed`);
    reading yields :class:`OpCall` objects."""

    __slots__ = ("_packed", "_rows")

    def __init__(self, rows: list[OpRow] | None = None) -> None:
        self._rows: list[OpRow] = rows if rows is not None else []
        self._packed: PackedOps | None = None

    @property
    def rows(self) -> list[OpRow]:
        """Every row, as written (packed rows are unpacked first, once)."""
        if self._packed is not None:
            self._packed.unpack(_op_row, self._rows)
            self._packed = None
        return self._rows

    def writing_rows(self) -> list[OpRow]:
        """The list the recorder appends to, as it is: a sealed row's slot holds ``None``."""
        return self._rows

    def seal(self, end: int) -> None:
        """Pack the rows before ``end`` (the recorder, every :data:`~memtrim.trace.packed.SEAL_EVERY`
        ops)."""
        if self._packed is None:
            self._packed = PackedOps()
        self._packed.seal(self._rows, end)

    def row(self, index: int) -> OpRow:
        """Row ``index`` (from 0), packed or not."""
        row = self._rows[index]
        if row is None:
            assert self._packed is not None
            row = self._packed.row(_op_row, index if index >= 0 else index + len(self._rows))
        return row

    def sites(self) -> set[Site]:
        """The sites of every row (nothing is unpacked)."""
        found: set[Site | None] = {row[3] for row in self._rows if row is not None}
        if self._packed is not None:
            found.update(self._packed.sites())
        return {site for site in found if site is not None}

    def module_paths(self) -> set[str]:
        """The module paths of every row."""
        paths = {m for row in self._rows if row is not None and (m := row[5])}
        if self._packed is not None:
            paths.update(self._packed.modules())
        return paths

    def rename_modules(self, new: dict[str, str]) -> None:
        """Rewrite module paths (a finished region's: ``model.encoder`` for what ran as ``encoder``)."""
        rows = self._rows
        for i, row in enumerate(rows):
            if row is not None and (path := row[5]) in new:
                rows[i] = row._replace(module=new[path])
        if self._packed is not None:
            self._packed.rename_modules(new)

    def append(self, op: OpCall) -> None:
        self._rows.append(OpRow(op.tick, op.op, op.phase, op.site, op.node, op.module, op.inputs))

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, index: int) -> OpCall: ...
    @overload
    def __getitem__(self, index: slice) -> list[OpCall]: ...
    def __getitem__(self, index: int | slice) -> OpCall | list[OpCall]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        return OpCall(index, *self.row(index))

    def __iter__(self) -> Iterator[OpCall]:
        return (OpCall(i, *row) for i, row in enumerate(self.rows))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OpLog) and self.rows == other.rows

    __hash__ = None  # type: ignore[assignment]


_op_row: Callable[[tuple[Any, ...]], OpRow] = OpRow._make
_alloc_row: Callable[[tuple[Any, ...]], AllocRow] = AllocRow._make
_free_row: Callable[[tuple[Any, ...]], FreeRow] = FreeRow._make


@dataclass(slots=True)
class Allocation:
    """One storage allocation (or, with ``preexisting``, a storage that existed before the region).

    ``site`` is where a person should look: the user's line that ran the op, or — for an op that the
    autograd engine ran for a built-in backward node — the forward line that created the node.
    ``call_site`` is the innermost user frame at the time of the op, when it differs. ``id`` is the
    allocation's index in :attr:`TraceLog.allocations`.
    """

    id: int
    bytes: int
    dtype: str
    shape: tuple[int, ...]
    device: str
    op: str
    phase: Phase
    alloc_tick: int
    free_tick: int | None = None
    free_phase: Phase | None = None
    site: Site | None = None
    call_site: Site | None = None
    node: str | None = None
    module: str | None = None
    saved: bool = False
    preexisting: bool = False
    facts: frozenset[Fact] = frozenset()

    @property
    def file(self) -> str | None:
        return self.site.file if self.site else None

    @property
    def line(self) -> int | None:
        return self.site.line if self.site else None

    @property
    def function(self) -> str | None:
        return self.site.function if self.site else None

    def alive_at(self, tick: int) -> bool:
        """Made inside the region at or before ``tick`` and not freed by then."""
        return (
            not self.preexisting
            and self.alloc_tick <= tick
            and (self.free_tick is None or self.free_tick > tick)
        )


class AllocationLog:
    """Allocations as the recorder writes them: :class:`AllocRow` rows, frees and saves by row number
    (older rows, frees and facts packed every few thousand ops: :mod:`memtrim.trace.packed`).

    :class:`Allocation` objects are made from the rows when a trace is first read, not while the
    program runs: what an op made (name, phase, site, node, module) is looked up in the op log by the
    row's op number, and dtypes, devices and shapes are kept as torch gave them until then.
    """

    __slots__ = ("_facts", "_frees", "_packed", "_rows", "saved")

    def __init__(self) -> None:
        self._rows: list[AllocRow] = []
        self._frees: dict[int, FreeRow] = {}
        self._facts: dict[int, set[Fact]] = {}
        self._packed: PackedAllocations | None = None
        self.saved: set[int] = set()

    def _unpacked(self) -> None:
        if self._packed is not None:
            self._packed.unpack(_alloc_row, _free_row, self._rows, self._frees, self._facts, _FACT_ORDER)
            self._packed = None

    @property
    def rows(self) -> list[AllocRow]:
        """Every row, as written (what is packed is unpacked first, once)."""
        self._unpacked()
        return self._rows

    @property
    def frees(self) -> dict[int, FreeRow]:
        """Row number -> its free."""
        self._unpacked()
        return self._frees

    @property
    def facts(self) -> dict[int, set[Fact]]:
        """Row number -> its facts."""
        self._unpacked()
        return self._facts

    def writing(self) -> tuple[list[AllocRow], dict[int, FreeRow], dict[int, set[Fact]]]:
        """The rows, frees and facts the recorder writes to, as they are: a sealed row's slot holds
        ``None``, sealed frees and facts are no longer in the dicts."""
        return self._rows, self._frees, self._facts

    def seal(self, end: int) -> None:
        """Pack the rows before ``end`` and every free and fact so far (the recorder, every
        :data:`~memtrim.trace.packed.SEAL_EVERY` ops)."""
        if self._packed is None:
            self._packed = PackedAllocations()
        self._packed.seal(self._rows, end, self._frees, self._facts, _FACT_ORDER)

    def row(self, index: int) -> AllocRow:
        """Row ``index`` (from 0), packed or not."""
        row = self._rows[index]
        if row is None:
            assert self._packed is not None
            row = self._packed.row(_alloc_row, index)
        return row

    def seqs(self) -> Iterator[int]:
        """Each row's op number, in row order (nothing is unpacked)."""
        if self._packed is None:
            return (row.seq for row in self._rows)
        return self._packed.seqs_of(self._rows)

    def add_fact(self, row: int, fact: Fact) -> None:
        self._facts.setdefault(row, set()).add(fact)

    def materialize(self, ops: OpLog) -> list[Allocation]:
        op_rows = ops.rows
        frees, saved, facts = self.frees, self.saved, self.facts
        allocations = []
        for i, row in enumerate(self.rows):
            free = frees.get(i)
            if row.seq < 0:  # from before the region
                op, phase, site, node, module = PRE_REGION_OP, Phase.OTHER, None, None, None
            else:
                _, op, phase, site, node, module, _ = op_rows[row.seq]
            allocations.append(
                Allocation(
                    id=i,
                    bytes=row.bytes,
                    dtype=dtype_name(row.dtype),
                    shape=tuple(row.shape),
                    device=dtype_name(row.device),
                    op=op,
                    phase=phase,
                    alloc_tick=row.tick,
                    free_tick=None if free is None else free.tick,
                    free_phase=None if free is None else free.phase,
                    site=site,
                    call_site=row.call_site if row.call_site is not site else None,
                    node=node,
                    module=module,
                    saved=row.seq >= 0 and i in saved,
                    preexisting=row.seq < 0,
                    facts=frozenset(facts[i]) if i in facts else frozenset(),
                )
            )
        return allocations


@dataclass
class TraceLog:
    """Everything recorded in one tracked region: ops, allocations and what happened at the end.

    ``allocations`` are read from the recorder's rows on first access once the region is finished;
    while it is still recording, each access gives a snapshot of what is known so far.
    """

    ops: OpLog = field(default_factory=OpLog)
    end_tick: int = 0
    fake: bool = False
    error: str | None = None
    failed_op: OpCall | None = None
    cuda_max_allocated: dict[str, int] = field(default_factory=dict)
    finished: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)
    """Free-form JSON facts about the run (rank, world size, torch version, ...)."""
    regions: list[Region] = field(default_factory=list)
    """Named spans marked inside the region, in the order opened."""
    scalars: dict[int, tuple[tuple[str, float], ...]] = field(default_factory=dict)
    """The finite Python numbers handed to elementwise arithmetic (``mul``, ``div``, ``add``, ``sub``,
    ``rsub``; :data:`SCALAR_OPS`), by op number: ``(argument name, value)`` in argument order, so a
    rule can restate ``logits / 30.0`` (``(("other", 30.0),)``)."""
    recorded: AllocationLog | None = None
    """Set by the recorder; read into :attr:`allocations`."""
    _allocations: list[Allocation] = field(default_factory=list, repr=False)

    @classmethod
    def of(cls, allocations: list[Allocation], ops: OpLog | None = None, **fields: Any) -> TraceLog:
        """A finished log from allocations made elsewhere (a loaded file, a hand-built test trace)."""
        log = cls(ops=ops if ops is not None else OpLog(), finished=True, **fields)
        log._allocations = allocations
        return log

    @property
    def allocations(self) -> list[Allocation]:
        """Every allocation, in the order made (pre-region storages where first seen)."""
        if self.recorded is not None:
            if not self.finished:  # read while recording: a snapshot of what is known so far
                return self.recorded.materialize(self.ops)
            self._allocations = self.recorded.materialize(self.ops)
            self.recorded = None
        return self._allocations

    def __repr__(self) -> str:
        state = "finished" if self.finished else "recording"
        return f"<memtrim.TraceLog {state}: {len(self.ops)} ops, {len(self.allocations)} allocations>"
