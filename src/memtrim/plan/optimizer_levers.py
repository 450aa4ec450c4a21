"""Levers on the optimizer step, from the doctor's ``optimizer-step`` and ``optimizer-state`` findings,
applied by :func:`memtrim.applied` to the program's own ``torch.optim`` optimizers (each one before its
parameters' first forward in the block) or once for the block:

- ``optimizer-in-backward``: :func:`memtrim.fixes.optimizer_in_backward` — each parameter stepped, and
  its gradient freed, as soon as backward has made it. Bit for bit where the finding says so; where the
  program clips the gradients' global norm or accumulates them, the finding says it changes training,
  and so does the option (used only with ``--allow changes-training``).
- ``optimizer-fused``: Adam/AdamW's groups set to ``fused=True`` (and ``foreach=False``): the fused
  step makes no temporaries. It rounds differently from the foreach/for-loop step: ``reference``.
- ``optimizer-foreach-off``: ``foreach=False`` — one parameter's temporaries at a time, not every
  parameter's at once. Rounds like the for-loop step, not like foreach: ``reference``.
- ``zero-grad-to-none``: gradients set to None where the program zeroes them in place
  (``zero_grad(set_to_none=False)``), or right after the step where it zeroes them only after the next
  forward began: the next backward's gradient is the same bits (``0 + g == g``): ``exact``.

Each is predicted by its finding's what-if; the optimizer-step levers cost no FLOPs (``cost`` 0).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from memtrim.analysis.whatif import Edits
from memtrim.doctor import diagnoses
from memtrim.doctor.diagnosis import Keeps
from memtrim.fixes.optimizer import fusable, optimizer_in_backward, optimizer_options
from memtrim.plan.levers import LEVERS, Lever, Option, Undo, Uses

if TYPE_CHECKING:
    from memtrim.analysis.analysis import Analysis
    from memtrim.doctor.diagnosis import Diagnosis


def _found(analysis: Analysis, rule: str, marker: str) -> list[Diagnosis]:
    return [
        d for d in diagnoses(analysis) if d.rule == rule and (marker in d.fix or marker in (d.code or ""))
    ]


_STEP = "optimizer-step"
"""The exclusive key of the levers that change how the step runs: the step in backward, fused, foreach
off. The step in backward and fused together is an option of its own (its what-if makes no per-gradient
temporaries), so no combination takes two of them."""

_KEEPS_ORDER: tuple[Keeps, ...] = ("exact", "reference", "changes-training")


def _option(lever: str, d: Diagnosis, params: dict[str, Any] | None = None) -> Option:
    return Option(lever, "optimizer", params or {}, d.keeps or "changes-training", 0.0, d.edits, _STEP)


def _weaker(a: Keeps, b: Keeps) -> Keeps:
    return max(a, b, key=_KEEPS_ORDER.index)


# -- the step fused into backward ---------------------------------------------------------------------
def _in_backward_options(analysis: Analysis) -> list[Option]:
    found = _found(analysis, "optimizer-state", "optimizer_in_backward")[:1]
    options = [_option("optimizer-in-backward", d) for d in found]
    fused = _found(analysis, "optimizer-step", "fused=True")[:1]
    for d, f in zip(found, fused, strict=False):
        # each parameter's fused step in its hook: no temporaries per gradient
        e = d.edits
        edits = Edits(e.remove | f.edits.remove, e.resize, e.alloc_at, e.free_at, ())
        keeps = _weaker(d.keeps or "changes-training", f.keeps or "changes-training")
        params = {"fused": True}
        options.append(Option("optimizer-in-backward", "optimizer, fused", params, keeps, 0.0, edits, _STEP))
    return options


def _in_backward_code(uses: Uses) -> str:
    fused = any(u.get("fused") for u in uses)
    return (
        ("optimizer = torch.optim.AdamW(params, ..., fused=True)  # or Adam's, where it is built\n" * fused)
        + "handle = memtrim.fixes.optimizer_in_backward(optimizer)  # then optimizer.step() and "
        "zero_grad() have nothing left to do"
    )


def _in_backward_apply(optimizer: torch.optim.Optimizer, uses: Uses) -> Undo | None:
    # the loop's own optimizer.step() and zero_grad() stay: every gradient is None by then, so the step
    # skips every parameter, and the state lives in the per-parameter optimizers until the undo
    unfuse = _fused_apply(optimizer, uses) if any(u.get("fused") for u in uses) else None
    remove = optimizer_in_backward(optimizer).remove  # the per-parameter optimizers take fused=True too

    def undo() -> None:
        remove()
        if unfuse is not None:
            unfuse()

    return undo


LEVERS.add(
    "optimizer-in-backward",
    Lever(
        "optimizer-in-backward",
        "exact",
        _in_backward_options,
        _in_backward_code,
        apply_optimizer=_in_backward_apply,
    ),
)


# -- fused=True (Adam, AdamW) -----------------------------------------------------------------------
def _fused_options(analysis: Analysis) -> list[Option]:
    return [_option("optimizer-fused", d) for d in _found(analysis, "optimizer-step", "fused=True")][:1]


def _fused_code(uses: Uses) -> str:
    return "memtrim.fixes.optimizer_options(optimizer, fused=True, foreach=False)  # on the live optimizer"


def _fused_options_of(optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
    return {"fused": True, "foreach": False} if fusable(optimizer) is None else None


def _fused_apply(optimizer: torch.optim.Optimizer, uses: Uses) -> Undo | None:
    values = _fused_options_of(optimizer)
    return None if values is None else optimizer_options(optimizer, **values).remove


LEVERS.add(
    "optimizer-fused",
    Lever("optimizer-fused", "reference", _fused_options, _fused_code, apply_optimizer=_fused_apply),
)


# -- foreach=False ----------------------------------------------------------------------------------
def _foreach_off_options(analysis: Analysis) -> list[Option]:
    return [
        _option("optimizer-foreach-off", d)
        for d in _found(analysis, "optimizer-step", "construct the optimizer with foreach=False")
    ][:1]


def _foreach_off_code(uses: Uses) -> str:
    return "optimizer = torch.optim.SGD(params, ..., foreach=False)  # your optimizer's class, where built"


def _foreach_off_options_of(optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
    if not all("foreach" in group for group in optimizer.param_groups):
        return None  # an optimizer without a foreach option
    return {"foreach": False}


def _foreach_off_apply(optimizer: torch.optim.Optimizer, uses: Uses) -> Undo | None:
    values = _foreach_off_options_of(optimizer)
    return None if values is None else optimizer_options(optimizer, **values).remove


LEVERS.add(
    "optimizer-foreach-off",
    Lever(
        "optimizer-foreach-off",
        "reference",
        _foreach_off_options,
        _foreach_off_code,
        apply_optimizer=_foreach_off_apply,
    ),
)


# -- gradients set to None ----------------------------------------------------------------------------
_ZEROED = "instead of set_to_none=False"
_AFTER_STEP = "right after the step"


def _to_none_options(analysis: Analysis) -> list[Option]:
    options = []
    for d in diagnoses(analysis):
        if d.rule != "optimizer-step" or d.keeps != "exact":
            continue
        if _ZEROED in d.fix:
            options.append(_option("zero-grad-to-none", d, {"when": "zero_grad"}))
        elif _AFTER_STEP in d.fix:
            options.append(_option("zero-grad-to-none", d, {"when": "after-step"}))
    return options[:1]


def _to_none_code(uses: Uses) -> str:
    if any(u.get("when") == "after-step" for u in uses):
        return "optimizer.zero_grad(set_to_none=True)  # right after optimizer.step()"
    return "optimizer.zero_grad(set_to_none=True)  # the default; in place of set_to_none=False"


_BASES: tuple[type, ...] = (torch.optim.Optimizer, torch.nn.Module)


def _zero_grad_owners() -> list[type]:
    """``Optimizer``, ``Module`` and every subclass defined so far that has a ``zero_grad`` of its own
    taking ``set_to_none`` (an optimizer library's that zeroes in place itself, never reaching the base
    class's): each is made to set gradients to None. One whose ``zero_grad`` takes no ``set_to_none``
    is left alone; the plan's re-measurement then shows the saving missing."""
    owners: list[type] = []
    seen: set[type] = set()
    todo: list[type] = list(_BASES)
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        todo.extend(cls.__subclasses__())
        own = cls.__dict__.get("zero_grad")
        if inspect.isfunction(own) and _takes_set_to_none(own):
            owners.append(cls)
    return owners


def _takes_set_to_none(function: Any) -> bool:
    try:
        return "set_to_none" in inspect.signature(function).parameters
    except (TypeError, ValueError):  # a builtin or an object without a signature
        return False


def _to_none(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` called with ``set_to_none=True`` whatever its caller passed, its other arguments as
    given (bound to its own signature: a subclass's ``zero_grad`` may take more than the base's)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def zero_grad(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.arguments["set_to_none"] = True
        return original(*bound.args, **bound.kwargs)

    return zero_grad


def _to_none_install(uses: Uses) -> Undo:
    stack = contextlib.ExitStack()
    whens = {u.get("when") for u in uses}
    if "zero_grad" in whens:
        for owner in _zero_grad_owners():
            original = owner.__dict__["zero_grad"]  # the class's own, restored as it was
            owner.zero_grad = _to_none(original)  # type: ignore[attr-defined]
            stack.callback(setattr, owner, "zero_grad", original)
    if "after-step" in whens:

        def to_none(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            optimizer.zero_grad(set_to_none=True)

        stack.callback(register_optimizer_step_post_hook(to_none).remove)
    return stack.close


LEVERS.add(
    "zero-grad-to-none",
    Lever("zero-grad-to-none", "exact", _to_none_options, _to_none_code, install=_to_none_install),
)


GroupOptions = Callable[[torch.optim.Optimizer], dict[str, Any] | None]


def group_options(lever: str, params: dict[str, Any]) -> GroupOptions | None:
    """For a ``reference`` optimizer lever of a plan: the group options it sets on an optimizer (None
    from the function: it leaves that optimizer alone), which
    :func:`memtrim.plan.optimizer_check.optimizer_check` verifies. None for other levers."""
    if lever == "optimizer-fused" or (lever == "optimizer-in-backward" and params.get("fused")):
        return _fused_options_of
    if lever == "optimizer-foreach-off":
        return _foreach_off_options_of
    return None
