"""The trace: a plain, JSON-serialisable event log of one tracked region. It holds no tensors.

Everything here is data. Questions about the data (peak, live set, categories, temporaries) are
answered by :mod:`memtrim.analysis`; the thin methods on :class:`Trace` only delegate there so that
the public API reads naturally (``trace.peak_bytes``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, overload

if TYPE_CHECKING:
    from memtrim.analysis.timeline import LineGroup, Peak

SCHEMA = "memtrim.trace/1"

PHASES = ("forward", "backward", "other")


@dataclass(frozen=True, slots=True)
class Site:
    """A source line in the user's code."""

    file: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} ({self.function})"


@dataclass(slots=True)
class OpCall:
    """One aten op call seen inside the region."""

    seq: int
    tick: int
    op: str
    phase: str
    site: Site | None
    node: str | None = None
    module: str | None = None


OpRow = tuple[int, str, str, "Site | None", "str | None", "str | None"]


class OpLog(Sequence[OpCall]):
    """Every op call, stored as a row ``(tick, op, phase, site, node, module)``: recording appends one
    tuple per op instead of building an object (cheaper, and no work for the garbage collector);
    reading yields :class:`OpCall` objects."""

    __slots__ = ("rows",)

    def __init__(self) -> None:
        self.rows: list[OpRow] = []

    def append(self, op: OpCall) -> None:
        self.rows.append((op.tick, op.op, op.phase, op.site, op.node, op.module))

    def __len__(self) -> int:
        return len(self.rows)

    @overload
    def __getitem__(self, index: int) -> OpCall: ...
    @overload
    def __getitem__(self, index: slice) -> list[OpCall]: ...
    def __getitem__(self, index: int | slice) -> OpCall | list[OpCall]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        return OpCall(index, *self.rows[index])

    def __iter__(self) -> Iterator[OpCall]:
        return (self[i] for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OpLog) and self.rows == other.rows

    __hash__ = None  # type: ignore[assignment]


@dataclass(slots=True)
class Allocation:
    """One storage allocation (or, with ``preexisting``, a storage that existed before the region).

    ``site`` is where a person should look: the user's line that ran the op, or — for an op that the
    autograd engine ran for a built-in backward node — the forward line that created the node.
    ``call_site`` is the innermost user frame at the time of the op, when it differs.
    """

    id: int
    bytes: int
    dtype: str
    shape: tuple[int, ...]
    device: str
    op: str
    phase: str
    alloc_tick: int
    free_tick: int | None = None
    free_phase: str | None = None
    site: Site | None = None
    call_site: Site | None = None
    node: str | None = None
    module: str | None = None
    saved: bool = False
    preexisting: bool = False

    @property
    def file(self) -> str | None:
        return self.site.file if self.site else None

    @property
    def line(self) -> int | None:
        return self.site.line if self.site else None

    @property
    def function(self) -> str | None:
        return self.site.function if self.site else None

    @property
    def category(self) -> str:
        from memtrim.analysis.categories import categorize

        return categorize(self)

    def describe(self) -> dict[str, Any]:
        """The allocation as a flat JSON object (the shape reporters and users consume)."""
        return {
            "bytes": self.bytes,
            "op": self.op,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "device": self.device,
            "phase": self.phase,
            "category": self.category,
            "file": self.file,
            "line": self.line,
            "function": self.function,
            "node": self.node,
            "module": self.module,
            "alloc_tick": self.alloc_tick,
            "free_tick": self.free_tick,
        }


class AllocationLog:
    """Allocations as the recorder writes them: one row per storage, frees and saves by row number.

    :class:`Allocation` objects are made from the rows when a trace is first read, not while the
    program runs: what an op made (name, phase, site, node, module) is looked up in the op log by
    the row's op number, and dtypes, devices and shapes are kept as torch gave them until then.
    A row's op number is -1 for a storage that existed before the region.
    """

    __slots__ = ("frees", "rows", "saved")

    def __init__(self) -> None:
        # (op seq, bytes, dtype, shape, device, alloc tick, call site)
        self.rows: list[tuple[Any, ...]] = []
        self.frees: dict[int, tuple[int, str]] = {}  # row -> (free tick, phase at the free)
        self.saved: set[int] = set()

    def materialize(self, ops: OpLog) -> list[Allocation]:
        op_rows = ops.rows
        frees, saved = self.frees, self.saved
        allocations = []
        for i, (seq, nbytes, dtype, shape, device, tick, call_site) in enumerate(self.rows):
            free_tick, free_phase = frees.get(i, (None, None))
            if seq < 0:  # from before the region
                op, phase, site, node, module = "(before the region)", "other", None, None, None
            else:
                _, op, phase, site, node, module = op_rows[seq]
            allocations.append(
                Allocation(
                    i,
                    nbytes,
                    _name(dtype),
                    tuple(shape),
                    _name(device),
                    op,
                    phase,
                    tick,
                    free_tick,
                    free_phase,
                    site,
                    call_site if call_site is not site else None,
                    node,
                    module,
                    saved=seq >= 0 and i in saved,
                    preexisting=seq < 0,
                )
            )
        return allocations


_names: dict[Any, str] = {}


def _name(value: Any) -> str:
    """``float32`` for torch.float32, ``cuda:0`` for a device (names are kept in the trace as text)."""
    name = _names.get(value)
    if name is None:
        name = _names[value] = str(value).removeprefix("torch.")
    return name


class Trace:
    """Everything recorded in one ``memtrim.track()`` region."""

    def __init__(
        self,
        *,
        ops: OpLog | None = None,
        allocations: list[Allocation] | None = None,
        end_tick: int = 0,
        fake: bool = False,
        error: str | None = None,
        failed_op: OpCall | None = None,
        cuda_max_allocated: dict[str, int] | None = None,
        finished: bool = False,
    ) -> None:
        self.ops = ops if ops is not None else OpLog()
        self._allocations = allocations if allocations is not None else []
        self.recorded: AllocationLog | None = None  # set by the recorder; read into allocations
        self.end_tick = end_tick
        self.fake = fake
        self.error = error
        self.failed_op = failed_op
        self.cuda_max_allocated = cuda_max_allocated if cuda_max_allocated is not None else {}
        self.finished = finished

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
        return f"<memtrim.Trace {state}: {len(self.ops)} ops, {len(self.allocations)} allocations>"

    # -- analysis (delegated; see memtrim.analysis) -------------------------------------------------
    @property
    def peak_bytes(self) -> int:
        """Peak bytes above the region's start, on the device with the largest peak."""
        return self.peak.bytes

    def peak_bytes_as(self, allocator: str) -> int:
        """The peak if every block were charged by ``allocator``'s rule, e.g. ``"cuda"`` (512-byte
        rounding): a GPU prediction from a trace recorded on the CPU or with ``fake=True``."""
        from memtrim.analysis.timeline import find_peak

        return find_peak(self, charge_as=allocator).bytes

    @property
    def peak(self) -> Peak:
        from memtrim.analysis.timeline import find_peak

        return find_peak(self)

    def live_at_peak(self) -> list[LineGroup]:
        from memtrim.analysis.timeline import live_at_peak

        return live_at_peak(self)

    def largest_temporaries(self, n: int = 10) -> list[Allocation]:
        from memtrim.analysis.timeline import largest_temporaries

        return largest_temporaries(self, n)

    def peak_bytes_by_device(self) -> dict[str, int]:
        from memtrim.analysis.timeline import peaks_by_device

        return {device: peak.bytes for device, peak in peaks_by_device(self).items()}

    # -- reporting -------------------------------------------------------------------------------
    def report(self, *, top: int = 5) -> str:
        from memtrim.report.terminal import render

        return render(self, top=top)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: the raw log plus derived figures (peak, temporaries, diagnoses)."""
        from memtrim.report.json import trace_json

        return trace_json(self)

    def save(self, path: str) -> None:
        from memtrim.trace.serialize import save

        save(self, path)
