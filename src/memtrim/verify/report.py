"""VerifyReport: the verdict per case, the failures (each naming its case and the fix), and renderings."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from memtrim.analysis.footprint import Footprint, peak_change
from memtrim.units import format_bytes
from memtrim.verify.cases import Case
from memtrim.verify.compare import Quantity


@dataclass
class Failure:
    """One reason the candidate is not accepted, with the case it happened in."""

    case: str
    what: str
    kind: str
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


@dataclass
class CaseResult:
    case: Case
    status: str = "passed"  # passed | failed | skipped
    held: str | None = None  # exact | reference
    quantities: list[Quantity] = field(default_factory=list)
    memory_ref: Footprint | str | None = None
    memory_cand: Footprint | str | None = None
    note: str = ""
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        def mem(m: Footprint | str | None) -> Any:
            return m.to_dict() if isinstance(m, Footprint) else m

        return {
            "case": self.case.id,
            "dtype": str(self.case.dtype).removeprefix("torch.") if self.case.dtype else None,
            "layout": self.case.layout,
            "seed": self.case.seed,
            "variant": self.case.variant,
            "autocast": self.case.autocast,
            "status": self.status,
            "held": self.held,
            "note": self.note,
            "seconds": round(self.seconds, 4),
            "quantities": [_jsonable(q.to_dict()) for q in self.quantities],
            "memory": {"reference": mem(self.memory_ref), "candidate": mem(self.memory_cand)},
        }


@dataclass
class ProbeResult:
    name: str
    passed: bool
    zeros: int
    message: str
    original_passed: bool | None = None


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
        for col in (
            "case",
            "result",
            "held",
            "worst",
            "max |Δ|",
            "norm err / γn+u",
            "assert_close",
            "peak ref→cand",
        ):
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
            console.print(f"  probe {p.name}: {'ok' if p.passed else 'FAILED'} - {p.message}", markup=False)
        for n in self.notes:
            console.print(f"  note: {n}", markup=False)

    def __str__(self) -> str:
        return self.render()

    # -- machine-readable --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": "memtrim.verify/1",
            "passed": self.passed,
            "mode": self.mode,
            "summary": self.summary(),
            "settings": _jsonable(self.settings),
            "seconds": round(self.seconds, 4),
            "failures": [f.to_dict() for f in self.failures],
            "cases": [c.to_dict() for c in self.cases],
            "probes": [_jsonable(p.__dict__) for p in self.probes],
            "notes": list(self.notes),
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def to_markdown(self) -> str:
        lines = [f"**memtrim.verify: {'passed' if self.passed else 'FAILED'}**", ""]
        lines += [f"- {ln}" for ln in self.summary().splitlines()]
        lines += [
            "",
            "| case | result | held | worst | max abs diff | norm err / γn+u | assert_close "
            "| peak ref → cand |",
        ]
        lines += ["|---|---|---|---|---|---|---|---|"]
        for c in self.cases:
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in _row(c)) + " |")
        if self.failures:
            lines += ["", "Failures:", ""]
            lines += [f"- `{f.case}`: {f.message}" for f in self.failures[:20]]
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


def _row(c: CaseResult) -> list[str]:
    worst = _worst(c.quantities)
    if worst is None:
        cells = ["-", "-", "-", "-"]
    else:
        ne = (
            f"{worst.norm_err:.2g} / {worst.bound:.2g}" if worst.norm_err is not None and worst.bound else "-"
        )
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
    return max(pool, key=lambda q: (q.norm_err if q.norm_err is not None else -1.0, q.max_abs_diff))


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
