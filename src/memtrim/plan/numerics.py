"""The numeric check of a plan: one step with and one without it, from the same state and seed, compared.

:class:`StepCapture` watches a run of the program without changing it: every scalar ``backward()`` is
called on (the loss), each parameter's gradient as it was last accumulated (a post-accumulate-grad hook,
so a step that ends with ``zero_grad(set_to_none=True)`` still shows it), and every parameter's value when
the run ends (what the optimizer made of the gradients). Parameters are named by the module they were
first called through (``Stack.blocks.0.up.weight``), so two runs of a script — two sets of objects —
pair by name. Copies go to the CPU with the dispatch modes suspended: a memtrim recorder running
around the step does not see them, so the recorded peak is the program's own.

:func:`compare` decides: bit for bit when every lever of the plan keeps ``exact``. A plan with a
``reference`` lever differs in rounding by design; bit-for-bit cannot judge it, and this check says so
(``not-run``) rather than call it safe.

:class:`StateSnapshot` saves and restores what a step changes — the models' parameters and buffers,
their gradients, the optimizers' state, the random generators — so that :func:`memtrim.fit`'s two
checked calls of a step start from the same state.
"""

from __future__ import annotations

import contextlib
import copy
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._python_dispatch import _disable_current_modes

from memtrim.plan.file import Numerics, Plan, Verdict

LARGEST_SHOWN = 3
"""Gradients named in :attr:`Numerics.max_differences` besides the totals: the largest differences."""


def _cpu_copy(t: torch.Tensor) -> torch.Tensor:
    with _disable_current_modes(), torch.no_grad():
        return t.detach().to("cpu", copy=True)


@dataclass
class Captured:
    """What one run did, by name: the losses in order, the last gradient and the final value of each
    parameter."""

    losses: list[torch.Tensor] = field(default_factory=list)
    gradients: dict[str, torch.Tensor] = field(default_factory=dict)
    parameters: dict[str, torch.Tensor] = field(default_factory=dict)


class StepCapture:
    """Inside the ``with`` block: the models called (by the first module called through), the
    optimizers stepped, and what :class:`Captured` lists. ``captured`` is complete when the block exits."""

    def __init__(self, *, values: bool = True) -> None:
        self.values = values
        """False: only find the models and optimizers (no copies)."""
        self.captured = Captured()
        self.models: list[nn.Module] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self._names: dict[int, str] = {}
        self._params: dict[str, nn.Parameter] = {}
        self._handles: list[Any] = []
        self._root_names: dict[str, int] = {}
        self.calls: list[tuple[nn.Module, tuple[Any, ...], dict[str, Any]]] = []
        """Each model's first call (the module, its arguments): what a ``reference`` check replays.
        Held until :meth:`release`."""

    def _name_root(self, module: nn.Module) -> str:
        base = type(module).__name__
        n = self._root_names.get(base, 0)
        self._root_names[base] = n + 1
        return base if n == 0 else f"{base}#{n}"

    def _seen_module(self, module: nn.Module, args: Any) -> None:
        if id(module) in self._names:
            return
        if not any(id(p) not in self._names for p in module.parameters()):
            self._names[id(module)] = ""
            return
        self.models.append(module)
        root = self._name_root(module)
        self._names[id(module)] = root
        for name, p in module.named_parameters():
            if id(p) in self._names:
                continue
            key = f"{root}.{name}"
            self._names[id(p)] = key
            self._params[key] = p
            if self.values and p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_hook(key)))

    def _called(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if any(m is module for m in self.models) and all(m is not module for m, _, _ in self.calls):
            self.calls.append((module, tuple(args), dict(kwargs)))

    def release(self) -> None:
        """Let go of the program's models and arguments."""
        self.calls.clear()
        self.models.clear()
        self.optimizers.clear()

    def _grad_hook(self, key: str) -> Any:
        def keep(p: torch.Tensor) -> None:
            if p.grad is not None:
                self.captured.gradients[key] = _cpu_copy(p.grad)

        return keep

    def _seen_optimizer(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if all(o is not optimizer for o in self.optimizers):
            self.optimizers.append(optimizer)

    @contextlib.contextmanager
    def _losses(self) -> Iterator[None]:
        original = torch.autograd.backward

        def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(tensors, torch.Tensor) and tensors.numel() == 1:
                self.captured.losses.append(_cpu_copy(tensors))
            return original(tensors, *args, **kwargs)

        torch.autograd.backward = backward
        try:
            yield
        finally:
            torch.autograd.backward = original

    def __enter__(self) -> StepCapture:
        self._stack = contextlib.ExitStack()
        self._stack.callback(self._finish)
        self._stack.enter_context(register_module_forward_pre_hook(self._seen_module))
        self._stack.enter_context(register_optimizer_step_pre_hook(self._seen_optimizer))
        if self.values:
            self._stack.enter_context(self._losses())
            self._stack.enter_context(register_module_forward_hook(self._called, with_kwargs=True))
        return self

    def _finish(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self.values:
            self.captured.parameters = {k: _cpu_copy(p) for k, p in self._params.items()}
        self._params.clear()  # the program's parameters are its own again

    def __exit__(self, *exc: object) -> None:
        self._stack.close()


def _largest(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape or a.dtype != b.dtype:
        return float("inf")
    if torch.equal(a, b):
        return 0.0
    difference = (a.double() - b.double()).abs()
    nan_mismatch = bool((a.isnan() != b.isnan()).any())
    value = float(difference.nan_to_num(nan=0.0, posinf=float("inf")).max())
    return float("inf") if nan_mismatch else value


def _finite(x: float) -> float:
    return x if x != float("inf") else sys.float_info.max


def compare(plan: Plan, unplanned: Captured, planned: Captured, *, where: str) -> Numerics:
    """The numeric verdict of ``plan`` from a run without it and one with it (``where`` names the
    program checked, for the note)."""
    not_exact = [lever.lever for lever in plan.levers if lever.keeps != "exact"]
    if not_exact:
        return Numerics(
            "not-run",
            note=f"{', '.join(sorted(set(not_exact)))} keeps rounding, not bits: a bit-for-bit check "
            "cannot judge it; prove it with memtrim.verify.verify_fix",
        )
    if not unplanned.losses and not unplanned.gradients:
        return Numerics("not-run", note=f"{where}: no backward() ran, so there was nothing to compare")
    names = sorted(set(unplanned.gradients) | set(planned.gradients))
    missing = [n for n in names if n not in unplanned.gradients or n not in planned.gradients]
    if len(unplanned.losses) != len(planned.losses) or missing:
        what = f"gradient of {missing[0]}" if missing else f"{len(planned.losses)} losses"
        return Numerics("fail", note=f"{where}: the runs differ in what they computed ({what})")
    loss = max((_largest(a, b) for a, b in zip(unplanned.losses, planned.losses, strict=True)), default=0.0)
    grads = {n: _largest(unplanned.gradients[n], planned.gradients[n]) for n in names}
    params = [
        _largest(v, planned.parameters[k]) if k in planned.parameters else float("inf")
        for k, v in unplanned.parameters.items()
    ]
    differences = {
        "loss": _finite(loss),
        "gradients": _finite(max(grads.values(), default=0.0)),
        "parameters": _finite(max(params, default=0.0)),
    }
    for name, value in sorted(grads.items(), key=lambda kv: -kv[1])[:LARGEST_SHOWN]:
        if value > 0:
            differences[f"gradient {name}"] = _finite(value)
    counted = (
        f"{len(unplanned.losses)} loss(es), {len(names)} gradients, {len(params)} parameters after the step"
    )
    if any(v > 0 for v in differences.values()):
        return Numerics("fail", differences, note=f"{where}: not bit for bit ({counted})")
    return Numerics("pass", differences, note=f"{where}: bit for bit ({counted})")


def reference_check(plan: Plan, capture: StepCapture) -> Numerics:
    """A plan with a ``reference`` lever: :func:`memtrim.verify.verify_fix` on each model the run called
    that the plan changes, with its first call's arguments — the loss (the output's ``.loss``) and
    every parameter's gradient with and without the plan's module levers, against the float64 oracle
    within verify's rounding budget — and :func:`~memtrim.plan.optimizer_check.optimizer_check` of the
    optimizers the run stepped that its optimizer levers change. Passes only if every check passes."""
    from memtrim.plan.optimizer_check import optimizer_check
    from memtrim.plan.optimizer_levers import group_options

    checks = [_models_check(plan, capture)]
    changes = [(lv.lever, f) for lv in plan.levers if (f := group_options(lv.lever, lv.params)) is not None]
    if changes:
        checks.append(optimizer_check(capture.optimizers, changes))
    ran = [c for c in checks if c is not None]
    if not ran:
        return Numerics(
            "not-run", note="no model or optimizer the program used is one the plan's levers change"
        )
    if any(c.verdict == "not-run" for c in ran):
        return next(c for c in ran if c.verdict == "not-run")
    differences: dict[str, float] = {}
    for c in ran:
        for key, value in c.max_differences.items():
            differences[key] = max(differences.get(key, 0.0), value)
    verdict: Verdict = "fail" if any(c.verdict == "fail" for c in ran) else "pass"
    return Numerics(verdict, differences, note="; ".join(c.note for c in ran))


_CHECKED = "memtrim.verify.verify_fix (reference): "


def _models_check(plan: Plan, capture: StepCapture) -> Numerics | None:
    """verify_fix of each called model the plan's module levers change (None: none is). A lever with
    probes (a change the model's output does not show) is checked by its probes instead."""
    from memtrim.plan.levers import LEVERS
    from memtrim.verify.fix import verify_fix

    uses: dict[str, list[dict[str, Any]]] = {}
    probed: dict[str, list[dict[str, Any]]] = {}
    for lever in plan.levers:
        known = LEVERS[lever.lever]
        if known.apply is not None:
            (probed if known.probes is not None else uses).setdefault(lever.lever, []).append(lever.params)

    def changed(model: nn.Module) -> list[Any]:
        found = []
        for name, params in uses.items():
            apply = LEVERS[name].apply
            if apply is not None and (undo := apply(model, params)) is not None:
                found.append(undo)
        return found

    checked, notes = 0, []
    differences: dict[str, float] = {}

    def count(report: Any, what: str) -> None:
        for case in report.cases:
            for q in case.quantities:
                key = {"output": "loss", "grad": "gradients"}.get(q.kind, "buffers")
                differences[key] = max(differences.get(key, 0.0), _finite(q.max_abs_diff))
                if q.budget_used is not None:
                    used = differences.get("budget_used", 0.0)
                    differences["budget_used"] = max(used, _finite(q.budget_used))
        notes.append(f"{what}: {'passed' if report.passed else 'FAILED'}")

    for model, args, kwargs in capture.calls if uses or probed else ():
        for name, params in probed.items():
            make = LEVERS[name].probes
            for probe in make(model, params) if make is not None else ():
                report = verify_fix(probe.module, probe.fix, probe.batch, loss=probe.loss, mode="reference")
                checked += 1
                count(report, f"{name} on {probe.what}")
                if not report.passed:
                    return _unproven(report, probe.what) or Numerics(
                        "fail", differences, note=_CHECKED + "; ".join(notes)
                    )
        if not uses:
            continue
        with _disable_current_modes():
            probe_model = copy.deepcopy(model)
        if not changed(probe_model):
            continue  # not a model the plan changes
        if args and kwargs:
            return Numerics(
                "not-run",
                note=f"{type(model).__name__} was called with positional and keyword "
                "arguments; check it with memtrim.verify.verify_fix(model, fix, batch)",
            )
        try:
            report = verify_fix(model, changed, kwargs or args, mode="reference")
        except (TypeError, ValueError) as error:
            return Numerics("not-run", note=f"{type(model).__name__}: {error}")
        checked += 1
        count(report, type(model).__name__)
        if not report.passed:
            return _unproven(report, type(model).__name__) or Numerics(
                "fail", differences, note=_CHECKED + "; ".join(notes)
            )
    if not checked:
        return None
    return Numerics("pass", differences, note=_CHECKED + "; ".join(notes))


def _unproven(report: Any, what: str) -> Numerics | None:
    """``not-run`` when verify_fix failed only because the float64 reference could not run (a kernel
    with no float64 version, as transformers' grouped-mm experts on CPU): nothing was compared, so
    the plan is neither proven nor shown to change the numbers."""
    if not report.failures or any(f.what != "oracle" for f in report.failures):
        return None
    return Numerics(
        "not-run",
        note=f"{what}: memtrim.verify.verify_fix could not prove the plan no less accurate: "
        f"{report.failures[0].message.split('; reference mode')[0]}. The plan is applied and "
        "re-measured; compare the loss and gradients with and without it yourself",
    )


def identical(a: Captured, b: Captured) -> bool:
    """Whether two runs computed the same bits (the losses, gradients and parameters)."""
    if len(a.losses) != len(b.losses) or set(a.gradients) != set(b.gradients):
        return False
    if set(a.parameters) != set(b.parameters):
        return False
    pairs = [
        *zip(a.losses, b.losses, strict=True),
        *((a.gradients[k], b.gradients[k]) for k in a.gradients),
        *((a.parameters[k], b.parameters[k]) for k in a.parameters),
    ]
    return all(_largest(x, y) == 0.0 for x, y in pairs)


class StateSnapshot:
    """What a training step changes, saved, to be put back with :meth:`restore`."""

    def __init__(self, models: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
        with torch.no_grad():
            self.models = [(m, copy.deepcopy(m.state_dict())) for m in models]
            self.grads = [
                (p, None if p.grad is None else p.grad.detach().clone())
                for m in models
                for p in m.parameters()
            ]
        self.optimizers = [(o, copy.deepcopy(o.state_dict())) for o in optimizers]
        self.torch_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.python_rng = random.getstate()
        numpy = sys.modules.get("numpy")
        self.numpy_rng = numpy.random.get_state() if numpy is not None else None

    def restore(self) -> None:
        with torch.no_grad():
            for model, state in self.models:
                model.load_state_dict(state)
            for p, grad in self.grads:
                p.grad = None if grad is None else grad.clone()
        for optimizer, state in self.optimizers:
            optimizer.load_state_dict(copy.deepcopy(state))
        torch.set_rng_state(self.torch_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        random.setstate(self.python_rng)
        numpy = sys.modules.get("numpy")
        if numpy is not None and self.numpy_rng is not None:
            numpy.random.set_state(self.numpy_rng)


def seed_everything(seed: int = 0) -> None:
    """The generators a script may draw from, seeded: two runs of it start from the same state."""
    torch.manual_seed(seed)
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed)
