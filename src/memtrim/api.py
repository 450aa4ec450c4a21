"""The public face: ``memtrim.track()`` and ``memtrim.load()`` give a :class:`Trace`, the recorded log
with its analysis and reports one attribute away.

This module sits on top of the pipeline (capture -> trace -> analysis -> report): the stages below
never import it. A ``Trace`` computes its :class:`~memtrim.analysis.Analysis` once, the first time a
figure is asked for after the region has finished.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from memtrim.analysis import Analysis, LineGroup, Peak, analyze
from memtrim.analysis.diff import LineChange, TraceDiff
from memtrim.analysis.diff import diff as diff_analyses
from memtrim.analysis.rankdiff import RankSetDiff, diff_rank_sets
from memtrim.doctor import Diagnosis, diagnoses
from memtrim.report import json as report_json
from memtrim.report import rankdiff as report_rankdiff
from memtrim.report.diff import render_html as render_diff_html
from memtrim.report.diff import render_markdown as render_diff_markdown
from memtrim.report.diff import render_text as render_diff_text
from memtrim.report.diff import to_dict as diff_to_dict
from memtrim.report.terminal import render
from memtrim.trace import serialize, stream
from memtrim.trace.collector import collector_paused
from memtrim.trace.model import Allocation, OpCall, OpLog, TraceLog
from memtrim.trace.ranks import rank_files

if TYPE_CHECKING:
    from memtrim.plan.file import Plan


class Trace:
    """Everything recorded in one tracked region, and what memtrim makes of it."""

    def __init__(self, log: TraceLog) -> None:
        self.log = log
        self._analysis: Analysis | None = None

    # -- the recorded log ---------------------------------------------------------------------------
    @property
    def allocations(self) -> list[Allocation]:
        """Every allocation, in the order made (pre-region storages where first seen)."""
        return self.log.allocations

    @property
    def ops(self) -> OpLog:
        return self.log.ops

    @property
    def fake(self) -> bool:
        return self.log.fake

    @property
    def error(self) -> str | None:
        return self.log.error

    @property
    def failed_op(self) -> OpCall | None:
        return self.log.failed_op

    @property
    def cuda_max_allocated(self) -> dict[str, int]:
        return self.log.cuda_max_allocated

    @property
    def finished(self) -> bool:
        return self.log.finished

    # -- its analysis -------------------------------------------------------------------------------
    @property
    def analysis(self) -> Analysis:
        """Every derived figure, computed once the region has finished (while it is still recording,
        a fresh snapshot each time)."""
        if self._analysis is not None:
            return self._analysis
        analysis = analyze(self.log)
        if self.log.finished:
            self._analysis = analysis
        return analysis

    @property
    def peak(self) -> Peak:
        return self.analysis.peak

    @property
    def peak_bytes(self) -> int:
        """Peak bytes above the region's start, on the device with the largest peak."""
        return self.analysis.peak.bytes

    def peak_bytes_as(self, allocator: str) -> int:
        """The peak if every block were charged by ``allocator``'s rule, e.g. ``"cuda"`` (512-byte
        rounding): a GPU prediction from a trace recorded on the CPU or with ``fake=True``."""
        return self.analysis.peak_as(allocator).bytes

    def peak_bytes_by_device(self) -> dict[str, int]:
        return {device: peak.bytes for device, peak in self.analysis.peaks.items()}

    def live_at_peak(self) -> list[LineGroup]:
        """What was alive at the peak, grouped by the source line that made it, largest first."""
        return list(self.analysis.lines_at_peak)

    def largest_temporaries(self, n: int = 10) -> list[Allocation]:
        """The n largest allocations made and freed in the same phase, largest first."""
        return self.analysis.largest_temporaries(n)

    def category(self, allocation: Allocation) -> str:
        """Why ``allocation`` was alive, from its lifetime (``saved``, ``temporary``, ...)."""
        return self.analysis.category(allocation).value

    def role(self, allocation: Allocation) -> str:
        """What ``allocation`` is for (``parameter``, ``gradient``, ``optimizer_state``, ``activation``,
        ``temporary``, ...)."""
        return self.analysis.role(allocation).value

    def breakdown_at_peak(self) -> dict[str, int]:
        """Bytes by role alive at the peak, made in the region (``trace.analysis.breakdown_at_peak``
        also has what existed before the region)."""
        return {role.value: n for role, n in self.analysis.breakdown_at_peak.made.items()}

    def alive_at(self, tick: int) -> list[Allocation]:
        """Allocations made inside the region and alive just after ``tick`` (an op's or event's tick)."""
        return self.analysis.alive_at(tick)

    def diagnoses(self) -> list[Diagnosis]:
        """The "How to cut it" findings, largest saving first."""
        return list(diagnoses(self.analysis))

    # -- reports --------------------------------------------------------------------------------------
    def report(self, *, top: int = 5) -> str:
        """The terminal summary."""
        return render(self.analysis, top=top)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: the summary figures first (peak, live set, temporaries, diagnoses), then the
        raw log that :func:`load` reads back."""
        raw = serialize.log_to_dict(self.log)
        return {"schema": raw.pop("schema"), **report_json.summary(self.analysis), **raw}

    def save(self, path: str) -> None:
        """Write the JSON form to ``path`` atomically, in bounded memory (:mod:`memtrim.trace.stream`)."""
        stream.save(self.log, path, report_json.summary(self.analysis))

    def save_html(self, path: str) -> None:
        """Write the HTML report (one self-contained file) to ``path`` atomically."""
        from memtrim.report.files import write_text
        from memtrim.report.html import report_html

        with collector_paused():
            write_text(path, report_html(self.analysis))

    def save_png(self, path: str) -> None:
        """Write the timeline as a PNG to ``path`` (needs matplotlib: ``pip install 'memtrim[plots]'``)."""
        from memtrim.report.plot import save_png

        save_png(self.analysis, path)

    def _repr_html_(self) -> str:
        """What a notebook shows: the compact report and the timeline by role (no script needed)."""
        from memtrim.report.html import notebook_html

        return notebook_html(self.analysis)

    def __repr__(self) -> str:
        state = "finished" if self.log.finished else "recording"
        return f"<memtrim.Trace {state}: {len(self.log.ops)} ops, {len(self.log.allocations)} allocations>"

    def __str__(self) -> str:
        return self.report()


def _remember_all(logs: list[TraceLog]) -> None:
    from memtrim.capture.source import remember_source_lines

    for log in logs:
        remember_source_lines(log)


@contextlib.contextmanager
def track(*, fake: bool = False, steps: range | None = None) -> Iterator[Trace]:
    """Record every storage the code inside the ``with`` block allocates and frees.

    Yields a :class:`Trace` that is complete when the block exits — also when it exits by an
    exception (an out-of-memory error, say): the trace then holds everything up to the failure and
    ``trace.error`` names it.

    ``fake=True`` runs the block under ``FakeTensorMode``: tensors have shapes, dtypes and devices but
    no data, so a full-size program is measured on a CPU without allocating it. Tensors created before
    the block are turned into fake ones when used. Code that reads values (``.item()``, printing,
    data-dependent shapes) cannot run fake.

    ``steps=range(a, b)`` records only training steps ``a`` to ``b - 1`` (a step ends when an
    optimizer's ``step()`` returns) and runs the rest at full speed: for runs of hours.

    >>> import torch, memtrim
    >>> with memtrim.track() as trace:
    ...     y = torch.ones(1024)
    >>> trace.peak_bytes
    4096
    """
    # torch is imported here, not with memtrim: reading, exporting and diffing saved traces need none
    from memtrim.capture.api import record

    with contextlib.ExitStack() as stack:
        # runs after the recorder has finished: the text of the lines the trace names, for the views
        # and for diffs against a later version of the file
        finished: list[TraceLog] = []
        stack.callback(_remember_all, finished)
        log = stack.enter_context(record(fake=fake, steps=steps))
        finished.append(log)
        yield Trace(log)


class Diff:
    """Two traces compared (:func:`diff`): ``str()`` for a terminal, :meth:`markdown` for a pull request,
    :meth:`to_dict` for programs, and an HTML view in a notebook."""

    def __init__(self, result: TraceDiff) -> None:
        self.result = result

    @property
    def empty(self) -> bool:
        """True when nothing differs."""
        return self.result.empty

    @property
    def peak(self) -> tuple[int, int]:
        return self.result.peak

    @property
    def lines(self) -> tuple[LineChange, ...]:
        """Per source line, what changed, largest change first."""
        return self.result.lines

    def report(self, *, top: int = 10) -> str:
        return render_diff_text(self.result, top=top)

    def markdown(self, *, top: int = 10) -> str:
        return render_diff_markdown(self.result, top=top)

    def to_dict(self) -> dict[str, Any]:
        return diff_to_dict(self.result)

    def html(self) -> str:
        return render_diff_html(self.result)

    def _repr_html_(self) -> str:
        return self.html()

    def __str__(self) -> str:
        return self.report()

    def __repr__(self) -> str:
        return f"<memtrim.Diff peak {self.peak[0]} -> {self.peak[1]} B, {len(self.lines)} lines changed>"


def diff(before: Trace | str, after: Trace | str) -> Diff:
    """Compare two traces (``Trace`` objects or saved files): peaks, per-phase peaks, bytes by role at
    the peak, and per source line the bytes alive at the peak and the largest temporary. Lines that
    moved between two versions of a file are matched by function and code text.

    >>> import torch, memtrim
    >>> with memtrim.track() as a:
    ...     x = torch.ones(1024)
    >>> memtrim.diff(a, a).empty
    True
    """
    first = load(before) if isinstance(before, str) else before
    second = load(after) if isinstance(after, str) else after
    return Diff(diff_analyses(first.analysis, second.analysis))


class RanksDiff:
    """Two torchrun jobs compared rank by rank (:func:`diff_ranks`): ``str()`` for a terminal,
    :meth:`markdown` for a pull request, :meth:`to_dict` for programs."""

    def __init__(self, result: RankSetDiff) -> None:
        self.result = result

    @property
    def empty(self) -> bool:
        """True when no rank differs."""
        return self.result.empty

    @property
    def peak(self) -> tuple[int, int]:
        """The job's peak (its highest rank's) before and after."""
        return self.result.peak

    @property
    def highest(self) -> tuple[int, int]:
        """The rank with the highest peak before, and after."""
        return self.result.highest

    @property
    def ranks(self) -> dict[int, Diff]:
        """Each rank's one-trace diff, by rank."""
        return {r.rank: Diff(r.diff) for r in self.result.ranks}

    @property
    def focus(self) -> tuple[int, Diff]:
        """The rank whose peak after the change is the job's peak, and its diff."""
        return self.result.focus.rank, Diff(self.result.focus.diff)

    def report(self, *, top: int = 10) -> str:
        return report_rankdiff.render_text(self.result, top=top)

    def markdown(self, *, top: int = 10) -> str:
        return report_rankdiff.render_markdown(self.result, top=top)

    def to_dict(self) -> dict[str, Any]:
        return report_rankdiff.to_dict(self.result)

    def __str__(self) -> str:
        return self.report()

    def __repr__(self) -> str:
        ranks, (b, a) = len(self.result.ranks), self.peak
        return f"<memtrim.RanksDiff {ranks} ranks, the job's peak {b} -> {a} B>"


def rank_set(side: str | Sequence[Trace | str]) -> list[tuple[Trace | str, str]]:
    """One job's traces as (trace or file, name): a base name whose file does not exist stands for
    its rank traces (``trace.json``: ``trace.rank0.json``, ``trace.rank1.json``, ...)."""
    items = [side] if isinstance(side, str) else list(side)
    found: list[tuple[Trace | str, str]] = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            ranks = [] if os.path.exists(item) else rank_files(item)
            found += [(path, path) for path in ranks or [item]]
        else:
            found.append((item, f"trace {i + 1}"))
    return found


def diff_ranks(before: str | Sequence[Trace | str], after: str | Sequence[Trace | str]) -> RanksDiff:
    """Compare two torchrun jobs rank by rank: each side is its ranks' traces (``Trace`` objects or
    files, in any order) or the base name given to ``memtrim run -o`` (``"before.json"`` for
    ``before.rank0.json``, ``before.rank1.json``, ...). Ranks are paired by the rank each trace recorded;
    traces that cannot be paired (different world sizes, a rank given on one side only, a single
    process's trace) raise :class:`~memtrim.analysis.rankdiff.RankSetError` naming the fix."""
    sides = [rank_set(before), rank_set(after)]
    traces = [[load(t) if isinstance(t, str) else t for t, _ in side] for side in sides]
    names = ([n for _, n in sides[0]], [n for _, n in sides[1]])
    return RanksDiff(diff_rank_sets([t.analysis for t in traces[0]], [t.analysis for t in traces[1]], names))


def load(path: str) -> Trace:
    """Read a trace written by :meth:`Trace.save` (JSON only; a bad file raises
    :class:`~memtrim.trace.TraceFormatError` naming the field)."""
    return Trace(serialize.load(path))


def fit(
    step: Callable[[], object],
    budget: str | int,
    allow: Iterable[str] = ("exact", "reference"),
    fake: bool = False,
    check: Callable[[], object] | None = None,
) -> Plan:
    """The cheapest plan (levers of :mod:`memtrim.plan`) that brings ``step()``'s peak to ``budget``
    (``"24GiB"`` or bytes): ``step`` is recorded once, the levers' combinations are replayed on the
    recording, and the step is run again with the plan applied to measure it (``plan.measured_peak``).
    Then the numeric check (``plan.numerics``): the models and optimizers the step used are saved with
    the random generators, the step runs without and with the plan from that state, and the losses,
    every parameter's gradient and every parameter after the step are compared; the state is put back
    after each, so ``step()`` runs four times and the model is left as two steps leave it.
    ``fake=True`` records and re-measures under ``FakeTensorMode`` (as ``track(fake=True)``: a full-size
    step measured without allocating it) and runs the step twice; the numeric check is then not run
    (``plan.numerics.verdict == "not-run"``) unless ``check`` is given: a callable that builds a small
    config of the same model and runs one step of it from scratch (the same seeds each call); it runs
    on real tensors without and with the plan and the two are compared (levers whose targets the small
    model lacks are not applied there; the note gives both runs' peaks).
    Raises :class:`~memtrim.plan.fit.NoPlanFits` naming the floor when no combination fits."""
    from memtrim.doctor.diagnosis import KEEPS
    from memtrim.plan import parse_budget
    from memtrim.plan.apply import applied
    from memtrim.plan.fit import NoPlanFits, fit_analysis
    from memtrim.plan.numerics import StateSnapshot, StepCapture, compare, reference_check

    wanted = tuple(allow)
    unknown = [k for k in wanted if k not in KEEPS]
    if unknown:
        raise ValueError(f"allow names what levers keep: one of {', '.join(KEEPS)}; got {unknown[0]!r}")
    with StepCapture(values=False) as found, track(fake=fake) as trace:
        step()
    fitted = fit_analysis(trace.analysis, parse_budget(budget), frozenset(wanted))  # type: ignore[arg-type]
    if fitted.plan is None:
        raise NoPlanFits(fitted.floor_text)
    plan = fitted.plan
    with applied(plan), track(fake=fake) as measured:
        step()
    plan.measured_peak = measured.peak_bytes
    if fake:
        from memtrim.plan.command import FAKE_NOTE, small_config_check
        from memtrim.plan.file import Numerics

        if check is None:
            plan.numerics = Numerics("not-run", {}, FAKE_NOTE)
            return plan
        small_step = check

        def small() -> Analysis:
            with track() as small_trace:
                small_step()
            return small_trace.analysis

        label = getattr(check, "__name__", "check")
        plan.numerics = small_config_check(plan, small, f"{label}()")
        return plan
    # the numeric check: the same state and seed, once without and once with the plan; the models and
    # optimizers are put back after each, so the step leaves them as the measured run did
    saved = StateSnapshot(found.models, found.optimizers)
    with StepCapture() as unplanned:
        step()
    saved.restore()
    if all(lever.keeps == "exact" for lever in plan.levers):
        with StepCapture() as planned, applied(plan):
            step()
        saved.restore()
        plan.numerics = compare(plan, unplanned.captured, planned.captured, where="step()")
    else:
        plan.numerics = reference_check(plan, unplanned)
    unplanned.release()
    return plan
