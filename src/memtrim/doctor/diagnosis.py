"""How to cut the peak: a registry of small rules, each reading an :class:`Analysis` and proposing a fix.

Every finding carries the peak the same timeline would have had with the fix applied — a what-if replay
of the recorded events with allocations removed, shrunk, moved or freed earlier and the fix's own
buffers added (:class:`~memtrim.analysis.whatif.Edits`) — so advice comes with the bytes it is worth,
and the conditions the rule checked on the trace for the fix to keep results (``safe_because``, and
the ``memtrim.verify`` mode that proves it).

Add a rule with ``@DIAGNOSES.register("name")``: it receives the analysis and returns findings, built
with :func:`finding` (which runs the what-if and drops fixes that would not lower the peak by at least
:data:`MATERIAL` of it). Rules read the data-flow index ``analysis.flow`` (producer and readers of
every allocation) and never scan the trace per allocation. The rules live in
:mod:`memtrim.doctor.rules`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from memtrim.analysis.whatif import Edits
from memtrim.registry import Registry
from memtrim.trace.collector import collector_paused
from memtrim.trace.model import Allocation, Site

if TYPE_CHECKING:
    from memtrim.analysis.analysis import Analysis

VerifyMode = Literal["exact", "reference"]
Keeps = Literal["exact", "reference", "changes-training"]
"""What a fix keeps: ``exact`` (results and gradients bit for bit), ``reference`` (no less accurate than
the original against a float64 reference: ``memtrim.verify.verify(..., mode="reference")`` proves it), or
``changes-training`` (a different optimizer, precision or batch statistics: a choice, not a rewrite)."""
KEEPS: tuple[Keeps, ...] = ("exact", "reference", "changes-training")

PROOF_NAMES = "# with original, rewrite, inputs: the code before and after the fix, a tuple of its arguments"
PROOF = {
    keeps: f"{PROOF_NAMES}\nfrom memtrim.verify import verify\n"
    f"verify(original, rewrite, inputs, mode={keeps!r}).assert_ok()"
    for keeps in ("exact", "reference")
}
"""The default runnable check per ``keeps``. Its first line names what it needs bound (``# with NAME,
NAME: what they are``): ``original`` and ``rewrite``, the code before and after the fix as functions of
the tuple ``inputs``."""

MODULE_PROOF_NAMES = (
    "# with original, rewrite, inputs: model-calling code before and after the fix, a tuple of args"
)
"""The first line of :func:`module_proof` (at most 94 characters: 100 columns where a report indents it)."""


def module_proof(keeps: VerifyMode, dtype: str) -> str:
    """The runnable check of a rewrite of code that calls a module: ``verify`` draws its inputs in the
    module's own dtype only (its weights stay in theirs, so other dtypes would not run)."""
    return (
        f"{MODULE_PROOF_NAMES}\nimport torch\nfrom memtrim.verify import verify\n"
        f"verify(original, rewrite, inputs, mode={keeps!r}, dtypes=[torch.{dtype}]).assert_ok()"
    )


LIVE_PROOF_NAMES = (
    "# with model, batch, loss_fn: the model before apply, a batch, loss_fn(model, batch) its loss"
)


def live_proof(code: str, keeps: VerifyMode) -> str:
    """The runnable check of apply code that changes the live ``model``: ``verify_fix`` runs one step of
    the model as it is and of a deep copy the code changed (loss, gradients, updated buffers)."""
    body = "\n".join(f"    {line}" for line in code.splitlines())
    return (
        f"{LIVE_PROOF_NAMES}\nfrom memtrim.verify import verify_fix\ndef fix(model):\n{body}\n"
        f"verify_fix(model, fix, batch, loss=loss_fn, mode={keeps!r}).assert_ok()"
    )


MATERIAL = 0.01
"""A fix is reported when it lowers the peak by at least this share of it (1%): advice worth less is
noise a reader has to rule out."""


@dataclass(frozen=True)
class Diagnosis:
    """One finding: what is wrong at a line, the fix, and what the peak would be with it."""

    rule: str
    site: Site | None
    problem: str
    fix: str
    allocations: tuple[Allocation, ...]
    """The recorded allocations the fix removes, shrinks, moves or frees earlier."""
    peak_before: int
    peak_after: int
    """The what-if peak with the fix applied to the recorded timeline."""
    safe_because: tuple[str, ...] = ()
    """The conditions the rule checked on the trace for the fix to keep results."""
    keeps: Keeps | None = None
    """What the fix keeps (:data:`Keeps`): bit for bit, no less accurate, or it changes training."""
    module: str | None = None
    """The module path of the line (as recorded)."""
    sites: tuple[Site, ...] = ()
    """Every line involved, ``site`` first (the lm_head and the loss, say)."""
    cost: str | None = None
    """What the fix costs besides memory (recomputed FLOPs), when it costs something."""
    note: str | None = None
    """What a reader must know before applying it (a rounding caveat, what the what-if assumes)."""
    code: str | None = None
    """Python that applies the fix to the program's live objects, runnable exactly as printed once the
    names in :attr:`binds` are bound (None where the fix is a rewrite of the user's own line)."""
    binds: tuple[tuple[str, str], ...] = ()
    """(name, what it is) for each free name :attr:`code` uses: ``("model", "the GPT2LMHeadModel the
    step calls")``."""
    proof: str | None = None
    """Runnable code that proves the fix keeps what :attr:`keeps` says; its first line names what it
    needs bound. By default :func:`live_proof` of :attr:`code` that changes ``model``, else :data:`PROOF`."""
    edits: Edits = field(default_factory=Edits, repr=False, compare=False)
    """The what-if the peak after was replayed with."""

    @property
    def verify_mode(self) -> VerifyMode | None:
        """The ``memtrim.verify`` mode that proves the fix, where one does (not for changes-training)."""
        return "exact" if self.keeps == "exact" else "reference" if self.keeps == "reference" else None

    @property
    def bytes_at_stake(self) -> int:
        return sum(a.bytes for a in self.allocations)

    @property
    def saving(self) -> int:
        return self.peak_before - self.peak_after

    @property
    def ops(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(a.op for a in self.allocations))


Rule = Callable[["Analysis"], Iterable[Diagnosis]]
DIAGNOSES: Registry[str, Rule] = Registry(
    "diagnosis rule", "memtrim.doctor.diagnosis.DIAGNOSES.register(name)"
)


def finding(
    analysis: Analysis,
    *,
    rule: str,
    site: Site | None,
    problem: str,
    fix: str,
    allocations: Iterable[Allocation],
    edits: Edits,
    safe_because: Iterable[str] = (),
    keeps: Keeps | None = None,
    module: str | None = None,
    sites: Iterable[Site | None] = (),
    cost: str | None = None,
    note: str | None = None,
    code: str | None = None,
    binds: Iterable[tuple[str, str]] = (),
    proof: str | None = None,
) -> Diagnosis | None:
    """A :class:`Diagnosis` with its what-if peak, or None when the fix would not lower the peak by
    :data:`MATERIAL` of it (or touches nothing alive at the peak, which cannot lower it)."""
    peak = analysis.peak
    blamed = tuple(allocations)
    named = tuple(binds)
    device = peak.device
    touched = edits.touched()
    if device is None or not touched & analysis.alive_ids_at_peak:
        return None
    curve = analysis.curve(device)
    if any(ident not in curve.charged for ident in touched):
        return None  # on another device: that device's peak is not the headline
    after = analysis.peak_with(edits)
    if peak.bytes - after < max(1, MATERIAL * peak.bytes):
        return None
    every = tuple(dict.fromkeys(s for s in (site, *sites) if s is not None))
    return Diagnosis(
        rule=rule,
        site=site,
        problem=problem,
        fix=fix,
        allocations=blamed,
        peak_before=peak.bytes,
        peak_after=after,
        safe_because=tuple(safe_because),
        keeps=keeps,
        module=module,
        sites=every,
        cost=cost,
        note=note,
        code=code,
        binds=named,
        proof=proof if proof is not None else _default_proof(code, named, keeps, module, blamed),
        edits=edits,
    )


def _default_proof(
    code: str | None,
    binds: tuple[tuple[str, str], ...],
    keeps: Keeps | None,
    module: str | None,
    blamed: tuple[Allocation, ...],
) -> str | None:
    """:func:`live_proof` of apply code that changes ``model``; else, for a rewrite of code inside a
    module, :func:`module_proof` in the dtype of what the fix removes; else :data:`PROOF`."""
    if keeps not in ("exact", "reference"):
        return None
    if code is not None and "model" in dict(binds):
        return live_proof(code, keeps)
    dtypes = [a.dtype for a in blamed if a.dtype in _FLOATING]
    if module and dtypes:
        return module_proof(keeps, dtypes[0])
    return PROOF[keeps]


_FLOATING = frozenset({"float64", "float32", "float16", "bfloat16"})


def diagnose(analysis: Analysis) -> list[Diagnosis]:
    """Every rule's findings, largest saving first."""
    with collector_paused():
        findings = [d for rule in DIAGNOSES.values() for d in rule(analysis)]
    peak = analysis.peak.bytes
    return sorted((d for d in findings if d.peak_after < peak), key=lambda d: (d.peak_after, d.rule))


# The rules register themselves on import; they import this module's names, defined above.
from memtrim.doctor import rules as _rules  # noqa: E402, F401
