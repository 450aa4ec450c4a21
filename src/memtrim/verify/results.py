"""Every result memtrim.verify hands back, in one module, each with ``__str__``, ``to_dict()`` and
``to_markdown()``:

* :class:`VerifyReport` — the whole verdict (what :func:`memtrim.verify.verify` returns);
* :class:`CaseResult` — one cell of the matrix, with its :class:`Quantity` verdicts (one per compared
  output or gradient) and both callables' memory (:class:`memtrim.analysis.Footprint`);
* :class:`Failure` — one reason the candidate is not accepted, naming its case and the fix;
* :class:`ProbeResult` — one cancellation probe;
* :class:`RunResult` and :class:`CallError` — what one run of one callable gave (internal, but printable).

>>> f = Failure("float32/contiguous/seed=0", "output", "mismatch", "output differs (case float32/...)")
>>> str(f)
'output differs (case float32/...)'
>>> f.to_markdown()
'- `float32/contiguous/seed=0`: output differs (case float32/...)'
>>> f.to_dict()["kind"]
'mismatch'
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from rich.console import Console
from rich.table import Table

from memtrim.analysis.footprint import Footprint, peak_change
from memtrim.trace import dtype_name
from memtrim.units import format_bytes
from memtrim.verify.cases import Case

Status = Literal["passed", "failed", "skipped"]
Held = Literal["exact", "reference"]
QuantityKind = Literal["output", "grad", "grad2", "update"]
FailureKind = Literal[
    "inputs",
    "budget",
    "reference",
    "exception",
    "structure",
    "output-type",
    "out-of-bounds write",
    "mutation",
    "detached",
    "no-grad",
    "meta",
    "mismatch",
    "probe",
    "update",
    "aliasing",
]

SCHEMA = "memtrim.verify/1"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


# -- one run of one callable --------------------------------------------------------------------------
@dataclass
class CallError:
    """An exception raised by a callable: in which phase, what, and the user's line that raised it."""

    phase: str
    type: str
    message: str
    where: str | None

    def describe(self) -> str:
        at = f" at {self.where}" if self.where else ""
        msg = self.message.strip().splitlines()[0] if self.message.strip() else ""
        return f"{self.type} in {self.phase}{at}: {msg}"

    def __str__(self) -> str:
        return self.describe()

    def to_dict(self) -> dict[str, Any]:
        return {"phase": self.phase, "type": self.type, "message": self.message, "where": self.where}

    def to_markdown(self) -> str:
        return (
            f"`{self.type}` in {self.phase}"
            + (f" at `{self.where}`" if self.where else "")
            + (f": {self.message.strip().splitlines()[0]}" if self.message.strip() else "")
        )


def _tensor_text(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return f"{dtype_name(t.dtype)}{list(t.shape)}"
    return "None" if t is None else type(t).__name__


@dataclass
class RunResult:
    """One run of one callable: flat outputs (detached), gradients per differentiable input, and what it
    did to its inputs: ``mutated`` (its version counter moved or its bits changed), ``mutated_silently``
    (bits changed, counter not: a ``.data`` write), ``updates`` (per input, its value after the call if it
    changed), ``poisoned`` (hidden NaN slots overwritten), ``aliases`` (per output, the input whose memory
    it shares)."""

    outputs: list[Any] = field(default_factory=list)
    spec: Any = None
    out_requires_grad: list[bool] = field(default_factory=list)
    detached: list[int] = field(default_factory=list)
    grads: list[torch.Tensor | None] | None = None
    grads2: list[torch.Tensor | None] | None = None
    not_differentiable: list[int] = field(default_factory=list)
    mutated: list[int] = field(default_factory=list)
    mutated_silently: list[int] = field(default_factory=list)
    updates: list[torch.Tensor | None] = field(default_factory=list)
    poisoned: list[int] = field(default_factory=list)
    aliases: list[int | None] = field(default_factory=list)
    error: CallError | None = None

    def to_dict(self) -> dict[str, Any]:
        def texts(ts: list[Any] | None) -> list[str] | None:
            return None if ts is None else [_tensor_text(t) for t in ts]

        return {
            "outputs": texts(self.outputs),
            "grads": texts(self.grads),
            "grads2": texts(self.grads2),
            "detached": list(self.detached),
            "not_differentiable": list(self.not_differentiable),
            "mutated": list(self.mutated),
            "mutated_silently": list(self.mutated_silently),
            "poisoned": list(self.poisoned),
            "aliases": list(self.aliases),
            "error": None if self.error is None else self.error.to_dict(),
        }

    def __str__(self) -> str:
        if self.error is not None:
            return f"raised {self.error}"
        parts = [f"outputs {', '.join(_tensor_text(o) for o in self.outputs) or 'none'}"]
        if self.grads is not None:
            parts.append(f"grads {', '.join(_tensor_text(g) for g in self.grads)}")
        if self.mutated:
            parts.append(f"mutated inputs {self.mutated}")
        return "; ".join(parts)

    def to_markdown(self) -> str:
        return f"`{self}`"


# -- one compared tensor -------------------------------------------------------------------------------
@dataclass
class Quantity:
    """The verdict on one compared tensor (an output, a gradient, a second derivative)."""

    name: str
    kind: QuantityKind
    passed: bool
    rule: str
    exact: bool
    numel: int = 0
    n_differ: int = 0
    max_abs_diff: float = 0.0
    n_over: int = 0
    worst: dict[str, Any] | None = None
    offending: list[dict[str, Any]] = field(default_factory=list)
    norm_err: float | None = None
    """max |cand - oracle| / S over elements with S > 0: the error per unit of magnitude."""
    norm_err_orig: float | None = None
    budget_used: float | None = None
    """max |cand - oracle| / budget: at most 1 where the candidate passed."""
    u_out: float | None = None
    u: float | None = None
    u_acc: float | None = None
    assert_close: bool | None = None
    assert_close_orig: bool | None = None
    assert_close_msg: str = ""
    message: str = ""

    def to_dict(self) -> dict[str, Any]:
        return _jsonable(dict(self.__dict__))

    def __str__(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        text = f"{self.name}: {verdict} ({self.rule or 'no rule'}), max |diff| {self.max_abs_diff:.3g}"
        if self.budget_used is not None:
            text += f", {self.budget_used:.2g} of the budget used"
        return text if self.passed else f"{text}: {self.message}"

    def to_markdown(self) -> str:
        return f"- {_cell(str(self))}"


# -- one case, one failure, one probe ------------------------------------------------------------------
@dataclass
class Failure:
    """One reason the candidate is not accepted, with the case it happened in."""

    case: str
    what: str
    kind: FailureKind
    message: str
    details: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.message  # names its case already

    def to_dict(self) -> dict[str, Any]:
        return {
            "case": self.case,
            "what": self.what,
            "kind": self.kind,
            "message": self.message,
            "details": _jsonable(self.details),
        }

    def to_markdown(self) -> str:
        return f"- `{self.case}`: {self.message}"


@dataclass
class CaseResult:
    """One cell of the matrix: its status, which rule held, each compared tensor, both sides' memory."""

    case: Case
    status: Status = "passed"
    held: Held | None = None
    quantities: list[Quantity] = field(default_factory=list)
    memory_ref: Footprint | str | None = None
    memory_cand: Footprint | str | None = None
    note: str = ""
    budget_note: str = ""
    """Why the per-element budget could not be derived here (empty when it was)."""
    remarks: list[str] = field(default_factory=list)
    """What differs without failing the case (an output that no longer aliases an input)."""
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        def mem(m: Footprint | str | None) -> Any:
            return m.to_dict() if isinstance(m, Footprint) else m

        return {
            "case": self.case.id,
            "dtype": dtype_name(self.case.dtype) if self.case.dtype else None,
            "layout": self.case.layout,
            "seed": self.case.seed,
            "variant": self.case.variant,
            "autocast": self.case.autocast,
            "status": self.status,
            "held": self.held,
            "note": self.note,
            "budget_note": self.budget_note,
            "remarks": list(self.remarks),
            "seconds": round(self.seconds, 4),
            "quantities": [q.to_dict() for q in self.quantities],
            "memory": {"reference": mem(self.memory_ref), "candidate": mem(self.memory_cand)},
        }

    def __str__(self) -> str:
        head = f"{self.case.id}: {self.status}"
        if self.held:
            head += f" (held {self.held})"
        if self.note and self.status != "passed":
            head += f": {self.note}"
        return "\n".join([head, *(f"  {q}" for q in self.quantities)])

    def to_markdown(self) -> str:
        return "\n".join([f"**{self.case.id}**: {self.status}", *(q.to_markdown() for q in self.quantities)])


@dataclass
class ProbeResult:
    """One cancellation probe: how many exact zeros it found and whether the candidate kept them."""

    name: str
    passed: bool
    zeros: int
    message: str
    original_passed: bool | None = None

    def __str__(self) -> str:
        return f"probe {self.name}: {'ok' if self.passed else 'FAILED'} - {self.message}"

    def to_dict(self) -> dict[str, Any]:
        return _jsonable(dict(self.__dict__))

    def to_markdown(self) -> str:
        return f"- probe `{self.name}`: {'ok' if self.passed else '**FAILED**'} - {self.message}"


# -- the whole verdict -----------------------------------------------------------------------------
@dataclass
class VerifyReport:
    """What :func:`memtrim.verify.verify` found. ``passed`` is True only if every case ran and held."""

    mode: str
    cases: list[CaseResult] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    probes: list[ProbeResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.failures and any(c.status != "skipped" for c in self.cases)

    # -- text --------------------------------------------------------------------------------------
    def summary(self) -> str:
        ran = [c for c in self.cases if c.status != "skipped"]
        skipped = len(self.cases) - len(ran)
        held = {h: sum(c.held == h for c in ran) for h in ("exact", "reference")}
        verdict = "PASSED" if self.passed else "FAILED"
        parts = [f"{verdict}: {len(ran)} cases ran in {self.seconds:.1f} s ({self.mode} mode)"]
        if self.mode != "exact":
            parts.append(f"exact held in {held['exact']}, reference in {held['reference']}")
        if self.failures:
            failed_cases = len({f.case for f in self.failures})
            parts.append(f"{len(self.failures)} failures in {failed_cases} cases")
        if skipped:
            parts.append(f"{skipped} skipped")
        if self.probes:
            parts.append(f"probes {sum(p.passed for p in self.probes)}/{len(self.probes)} passed")
        line = "; ".join(parts)
        mem = self.memory_summary()
        return f"{line}\n{mem}" if mem else line

    def memory_summary(self) -> str | None:
        """'equal results, 571 MiB less at peak' — for the case where the reference peaks highest."""
        measured = [
            c
            for c in self.cases
            if isinstance(c.memory_ref, Footprint) and isinstance(c.memory_cand, Footprint)
        ]
        if not measured:
            return None
        case = max(
            measured, key=lambda c: c.memory_ref.peak_bytes if isinstance(c.memory_ref, Footprint) else 0
        )
        ref, cand = case.memory_ref, case.memory_cand
        assert isinstance(ref, Footprint) and isinstance(cand, Footprint)
        head = "equal results" if self.passed else "results differ"
        return (
            f"memory ({case.case.id}): {head}, {peak_change(ref, cand)}; "
            f"largest temporary {ref.temporary_text()} -> {cand.temporary_text()}"
        )

    def table(self) -> Table:
        t = Table(title="memtrim.verify", title_justify="left")
        for col in _COLUMNS:
            # the case id is what a reader searches for: never break it across lines
            t.add_column(col, overflow="fold", no_wrap=col in ("case", "peak ref→cand"))
        for c in self.cases:
            t.add_row(*_row(c))
        return t

    def render(self, width: int = 160) -> str:
        buf = io.StringIO()
        console = Console(file=buf, width=width, force_terminal=False, color_system=None)
        self.print(console)
        return buf.getvalue()

    def print(self, console: Console | None = None) -> None:
        console = console or Console()
        console.print(self.table())
        console.print(self.summary(), markup=False)
        for f in self.failures[:10]:
            console.print(f"  x {f}", markup=False)
        if len(self.failures) > 10:
            console.print(f"  ... and {len(self.failures) - 10} more (see .failures)", markup=False)
        for p in self.probes:
            console.print(f"  {p}", markup=False)
        for n in self.notes:
            console.print(f"  note: {n}", markup=False)

    def __str__(self) -> str:
        return self.render()

    # -- machine-readable --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "passed": self.passed,
            "mode": self.mode,
            "summary": self.summary(),
            "settings": _jsonable(self.settings),
            "seconds": round(self.seconds, 4),
            "failures": [f.to_dict() for f in self.failures],
            "cases": [c.to_dict() for c in self.cases],
            "probes": [p.to_dict() for p in self.probes],
            "notes": list(self.notes),
        }

    def to_json(self, indent: int | None = 2) -> str:
        """``json.dumps(self.to_dict())``."""
        return json.dumps(self.to_dict(), indent=indent)

    def to_markdown(self) -> str:
        lines = [f"**memtrim.verify: {'passed' if self.passed else 'FAILED'}**", ""]
        lines += [f"- {ln}" for ln in self.summary().splitlines()]
        lines += ["", "| " + " | ".join(_MD_COLUMNS) + " |", "|" + "---|" * len(_MD_COLUMNS)]
        for c in self.cases:
            lines.append("| " + " | ".join(_cell(cell) for cell in _row(c)) + " |")
        if self.failures:
            lines += ["", "Failures:", ""]
            lines += [f.to_markdown() for f in self.failures[:20]]
        if self.probes:
            lines += ["", *(p.to_markdown() for p in self.probes)]
        if self.notes:
            lines += ["", *[f"> {n}" for n in self.notes]]
        return "\n".join(lines) + "\n"

    def assert_ok(self) -> None:
        """Raise ``AssertionError`` naming the first failing case and its numbers."""
        if self.passed:
            return
        if self.failures:
            first = self.failures[0]
            more = f" (and {len(self.failures) - 1} more failures)" if len(self.failures) > 1 else ""
            raise AssertionError(f"memtrim.verify failed in case {first.case}: {first.message}{more}")
        raise AssertionError("memtrim.verify ran no case: every case was skipped; " + "; ".join(self.notes))


_COLUMNS = ("case", "result", "held", "worst", "max |Δ|", "budget used", "assert_close", "peak ref→cand")
_MD_COLUMNS = (
    "case",
    "result",
    "held",
    "worst",
    "max abs diff",
    "budget used",
    "assert_close",
    "peak ref → cand",
)


def _row(c: CaseResult) -> list[str]:
    worst = _worst(c.quantities)
    if worst is None:
        cells = ["-", "-", "-", "-"]
    else:
        ne = f"{worst.budget_used:.2g}" if worst.budget_used is not None else "-"
        ac = (
            "-"
            if worst.assert_close is None
            else f"{_yn(worst.assert_close)} (orig {_yn(worst.assert_close_orig)})"
        )
        cells = [worst.name, f"{worst.max_abs_diff:.3g}", ne, ac]
    result = c.status if not c.note or c.status == "passed" else f"{c.status}: {c.note}"
    return [c.case.id, result, c.held or "-", *cells, _mem(c)]


def _worst(qs: list[Quantity]) -> Quantity | None:
    if not qs:
        return None
    failing = [q for q in qs if not q.passed]
    pool = failing or qs
    return max(pool, key=lambda q: (q.budget_used if q.budget_used is not None else -1.0, q.max_abs_diff))


def _yn(v: bool | None) -> str:
    return "-" if v is None else ("ok" if v else "fail")


def _mem(c: CaseResult) -> str:
    r, k = c.memory_ref, c.memory_cand
    if isinstance(r, Footprint) and isinstance(k, Footprint):
        return f"{format_bytes(r.peak_bytes)} → {format_bytes(k.peak_bytes)}"
    return "-"


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float):
        return x if x == x and abs(x) != float("inf") else str(x)
    if isinstance(x, (str, int, bool)) or x is None:
        return x
    return str(x)
