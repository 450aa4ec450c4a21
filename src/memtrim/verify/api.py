"""``memtrim.verify.verify(reference, candidate, inputs)``: prove a memory rewrite safe."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from memtrim.trace import dtype_name
from memtrim.verify.budget import C_REORDER, K_FACTORS
from memtrim.verify.cases import (
    DEFAULT_SEEDS,
    LAYOUTS,
    CancellationProbe,
    Case,
    InputsSpec,
    default_dtypes,
    infer_device,
    parse_dtype,
)
from memtrim.verify.config import MODES, Mode, Settings
from memtrim.verify.judge import run_case
from memtrim.verify.oracle import OracleCache, oracle_key
from memtrim.verify.probes import run_probe
from memtrim.verify.results import VerifyReport


def verify(
    reference: Callable[..., Any],
    candidate: Callable[..., Any],
    inputs: InputsSpec,
    *,
    mode: Mode = "auto",
    dtypes: Sequence[torch.dtype | str] | None = None,
    grads: bool = True,
    second_order: bool = False,
    layouts: Sequence[str] = LAYOUTS,
    seeds: Sequence[int] = DEFAULT_SEEDS,
    autocast: bool = False,
    device: torch.device | str | None = None,
    variants: Mapping[str, InputsSpec] | None = None,
    probes: Sequence[CancellationProbe | Sequence[Any]] = (),
    abs_reference: Callable[..., Any] | None = None,
    reduction_length: int | None = None,
    c: float = C_REORDER,
    memory: bool = True,
    progress: bool | None = None,
    oracle_device: torch.device | str | None = None,
) -> VerifyReport:
    """Check that ``candidate`` computes what ``reference`` does, over a matrix of cases.

    ``inputs`` is either a builder ``inputs(dtype, device, seed) -> tuple of arguments`` or example
    arguments (a tensor or a sequence) whose tensors give shapes and ``requires_grad``; floating-point
    values are then drawn per seed. Gradients are checked for every input that requires grad, with a fixed
    random upstream gradient laid out like the case.

    Compared: every output (dicts key by key), every gradient, every input the reference updates in
    place, and with ``second_order=True`` second derivatives; inputs the candidate alone writes to (also
    through ``.data``), writes outside a strided input's view, and outputs that alias an input where the
    reference's do not, fail.

    ``mode``: ``"exact"`` demands the same bits (NaN in the same places; -0.0 is not 0.0), dtypes and
    shapes; ``"reference"`` judges each element against the float64 oracle with the rounding budget
    derived by tracing the reference (:mod:`memtrim.verify.budget`, :mod:`memtrim.verify.magnitudes`);
    ``"auto"`` tries exact first and falls back to reference.

    ``dtypes`` default to fp64, fp32, fp16, bf16 (or the inputs as given if none is floating point);
    ``layouts`` to contiguous, noncontiguous (NaN-poisoned strided slices), transposed, expanded; ``seeds``
    to 0, 1, 2. ``autocast=True`` adds autocast cases (bf16 on CPU; fp16 and bf16 on CUDA). ``variants``
    maps a name to more inputs (e.g. ``{"batchless": ..., "empty": ...}``) run over the same matrix.
    ``probes`` are cancellation probes: inputs whose exact result or gradient is zero somewhere, where the
    candidate must then give exactly zero. ``abs_reference`` is a stand-in whose traced budget replaces
    the reference's (for a reference with an op the tracer has no rule for); if it cannot be traced
    either, it is called on |inputs| in float64 and gives S, with ``reduction_length`` products summed per
    element. ``c`` is the reordering constant. ``memory`` tracks both callables' peak and largest
    temporary per case through memtrim's tracker.

    >>> import torch
    >>> r = verify(torch.relu, lambda x: x * (x > 0), (torch.randn(3, 4),), mode="exact", seeds=(0,),
    ...            dtypes=("fp32",), layouts=("contiguous",), memory=False)
    >>> r.passed, "other sign of zero" in r.failures[0].message   # -0.0 where x < 0
    (False, True)
    """
    t0 = time.perf_counter()
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    for label, fn in (("reference", reference), ("candidate", candidate)):
        if not callable(fn):
            raise TypeError(f"{label} must be callable, not {type(fn).__name__}")
    bad = [x for x in layouts if x not in LAYOUTS]
    if bad or not layouts:
        raise ValueError(f"layouts must be a non-empty subset of {LAYOUTS}; got {list(layouts)}")
    if not seeds:
        raise ValueError("seeds must name at least one seed")
    specs: dict[str, InputsSpec] = {"default": inputs, **dict(variants or {})}
    dev = torch.device(device) if device is not None else infer_device(inputs)
    odev = torch.device(oracle_device) if oracle_device is not None else _oracle_device(dev)
    cases = _matrix(specs, dtypes, layouts, seeds, autocast, dev)
    st = Settings(
        reference=reference,
        candidate=candidate,
        mode=mode,
        grads=grads,
        second_order=second_order,
        device=dev,
        oracle_device=odev,
        abs_reference=abs_reference,
        reduction_length=reduction_length,
        c=c,
        memory=memory,
    )
    cache = OracleCache([oracle_key(x) for x in cases])
    report = VerifyReport(mode=mode)
    report.settings = {
        "mode": mode,
        "device": str(dev),
        "oracle_device": str(odev),
        "c": c,
        "k": dict(K_FACTORS.items()),
        "dtypes": sorted({dtype_name(x.dtype) if x.dtype else "as-given" for x in cases}),
        "layouts": list(layouts),
        "seeds": list(seeds),
        "grads": grads,
        "second_order": second_order,
        "autocast": autocast,
        "variants": list(specs),
    }
    with _progress(progress, len(cases) + len(probes)) as advance:
        for case in cases:
            result, fails = run_case(st, cache, case, specs[case.variant])
            report.cases.append(result)
            report.failures.extend(fails)
            advance(case.id)
        for i, p in enumerate(probes):
            probe = p if isinstance(p, CancellationProbe) else CancellationProbe(list(p), name=f"probe {i}")
            pres, pfails = run_probe(reference, candidate, probe, dev, odev, grads)
            report.probes.append(pres)
            report.failures.extend(pfails)
            advance(probe.name)
    report.notes.extend(_notes(st, report))
    report.seconds = time.perf_counter() - t0
    return report


def _oracle_device(dev: torch.device) -> torch.device:
    return torch.device("cpu") if dev.type == "mps" else dev  # MPS has no float64


def _matrix(
    specs: Mapping[str, InputsSpec],
    dtypes: Sequence[torch.dtype | str] | None,
    layouts: Sequence[str],
    seeds: Sequence[int],
    autocast: bool,
    dev: torch.device,
) -> list[Case]:
    cases = []
    for variant, spec in specs.items():
        dts: Sequence[torch.dtype | None] = (
            [parse_dtype(d) for d in dtypes] if dtypes is not None else default_dtypes(spec)
        )
        # dtype, then seed, then layout: the cases that share an oracle run one after another
        for dt in dts:
            cases += [Case(dt, layout, seed, variant) for seed in seeds for layout in layouts]
        if autocast:
            ac = (torch.bfloat16,) if dev.type == "cpu" else (torch.float16, torch.bfloat16)
            for dt in ac:
                cases += [
                    Case(dt, layout, seed, variant, autocast=True) for seed in seeds for layout in layouts
                ]
    return cases


class _progress:
    """A rich progress bar over the matrix, on a terminal only (and when not turned off)."""

    def __init__(self, enabled: bool | None, total: int) -> None:
        on = sys.stderr.isatty() if enabled is None else enabled
        console = Console(stderr=True, force_terminal=True if enabled else None)
        self.bar = Progress(
            TextColumn("memtrim.verify"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.description}"),
            console=console,
            transient=True,
            disable=not on,
        )
        self.total = total

    def __enter__(self) -> Callable[[str], None]:
        self.bar.__enter__()
        task = self.bar.add_task("", total=self.total)
        return lambda label: self.bar.update(task, advance=1, description=label)

    def __exit__(self, *exc: object) -> None:
        self.bar.__exit__(None, None, None)


def _notes(st: Settings, report: VerifyReport) -> list[str]:
    notes = []
    firsts: dict[str, str] = {}
    for c in report.cases:
        for text in (c.budget_note, *c.remarks):
            if text:
                firsts.setdefault(text, c.case.id)
    for text, first in firsts.items():
        if any(text == c.budget_note for c in report.cases):
            notes.append(
                f"the budget could not be derived ({text}; first in {first}): only the k-times rule holds "
                "there, judged on tensor maxima as FlashAttention's tests do (max|cand - oracle| <= "
                "k*max(max|orig - oracle|, u_out*max|oracle|)); pass abs_reference= to judge each element"
            )
        else:
            notes.append(f"{text} (first in {first})")
    if any(q.rule.startswith("per element") for c in report.cases for q in c.quantities):
        notes.append(
            "reference budget: |cand - oracle| <= k*|orig - oracle| + (1 + r)*(E + u_out*|oracle|), E the "
            "first-order rounding error of the reference's steps in the case's precision (each step rounded "
            f"to its dtype, sums of N terms min({st.c:g}*sqrt(N), N)*u_acc*S), r = u_fp64/u (1 in fp64), "
            f"k = {K_FACTORS['output']:g} (outputs, updated inputs) / {K_FACTORS['grad']:g} (gradients)"
        )
    skipped = sorted({c.case.layout for c in report.cases if c.status == "skipped"})
    if skipped:
        notes.append(f"skipped layouts the reference rejects: {', '.join(skipped)} (see each case's note)")
    failing = {c.case.layout for c in report.cases if c.status == "failed"}
    passing = {c.case.layout for c in report.cases if c.status == "passed"}
    if failing and "contiguous" in passing and "contiguous" not in failing:
        notes.append(
            f"failures only in the {', '.join(sorted(failing))} layout(s) while contiguous cases hold: the "
            "candidate depends on memory layout (reads storage as if contiguous, or ignores strides)"
        )
    compared_grads = any(q.kind != "output" for c in report.cases for q in c.quantities)
    if st.grads and not compared_grads and report.cases and all(c.status != "failed" for c in report.cases):
        notes.append(
            "no gradient was compared: no input requires grad (set requires_grad=True to check them)"
        )
    return notes
