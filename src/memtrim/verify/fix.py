"""``verify_fix(model, fix, batch)``: prove that a change applied to a live model keeps its training step.

A memory fix for a model (checkpointing blocks, a chunked loss patched in, another attention kernel)
is a change to an object, not a rewrite of a function. :func:`verify_fix` turns it into one: the model
becomes a function of its parameters, buffers and batch (``torch.func.functional_call``), once as it
is and once with ``fix`` applied to a deep copy, and :func:`memtrim.verify.verify` compares the two —
the loss, every parameter's gradient, and every buffer the step updates in place (BatchNorm's running
statistics) — bit for bit (``mode="exact"``) or against the float64 oracle with the derived rounding
budget (``mode="reference"``). The model handed in is never changed.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from memtrim.verify.api import verify
from memtrim.verify.config import MODES, Mode
from memtrim.verify.results import VerifyReport

Batch = Mapping[str, Any] | Sequence[Any] | torch.Tensor
LossFn = Callable[[nn.Module, Any], torch.Tensor]


def model_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The default loss of a step: ``model(**batch)`` for a dict, ``model(*batch)`` for a tuple or list,
    ``model(batch)`` for a tensor; then the output's ``.loss`` (a transformers ``ModelOutput``), its
    ``"loss"`` key, or the output itself when it is a scalar."""
    if isinstance(batch, Mapping):
        out = model(**batch)
    elif isinstance(batch, (tuple, list)):
        out = model(*batch)
    else:
        out = model(batch)
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if loss is None and isinstance(out, torch.Tensor) and out.numel() == 1:
        loss = out
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"the model returned {type(out).__name__} with no loss: pass loss=lambda model, batch: ... "
            "that returns the scalar the step calls backward() on"
        )
    return loss


def _float_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    raise ValueError("the model has no floating-point parameter: there is no gradient to compare")


def verify_fix(
    model: nn.Module,
    fix: Callable[[nn.Module], object],
    batch: Batch,
    *,
    loss: LossFn | None = None,
    mode: Mode = "reference",
    seed: int = 0,
    memory: bool = False,
    progress: bool | None = False,
) -> VerifyReport:
    """Compare one step of ``model`` on ``batch`` (the loss, its gradient with respect to every
    parameter, every buffer it updates in place) with the same step after ``fix(model)``.

    ``fix`` receives a deep copy of ``model`` and changes it in place (what it returns is ignored):
    ``lambda m: memtrim.fixes.checkpoint_modules(m, ["transformer.h.*"])``. ``loss(model, batch)``
    gives the scalar the step calls ``backward()`` on (default :func:`model_loss`). Both runs start
    from the same RNG state (``seed``), so dropout draws the same masks. The model's own dtype is the
    case's; ``mode="reference"`` also runs the original in float64 as the oracle.

    >>> import torch, memtrim.fixes
    >>> from memtrim.verify import verify_fix
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
    >>> x = torch.randn(4, 8)
    >>> step = lambda m, batch: m(batch).square().mean()
    >>> report = verify_fix(model, lambda m: memtrim.fixes.checkpoint_modules(m, ["[02]"]), x,
    ...                     loss=step, mode="exact")
    >>> report.passed, len(report.cases)
    (True, 1)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    if not callable(fix):
        raise TypeError(f"fix must be a callable that changes the model given, not {type(fix).__name__}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    loss_of = loss or model_loss
    dtype = _float_dtype(model)
    original = copy.deepcopy(model)
    fixed = copy.deepcopy(model)
    fix(fixed)
    params = dict(original.named_parameters())
    buffers = dict(original.named_buffers())

    def step(module: nn.Module) -> Callable[[dict[str, torch.Tensor], Any], torch.Tensor]:
        slots = _slots(module)
        changed = _changed_state(module, {**params, **buffers})

        def run(state: dict[str, torch.Tensor], given: Any) -> torch.Tensor:
            if changed:
                raise ValueError(
                    f"the fix changed the model's weights ({changed}): verify_fix runs both steps on the "
                    "same parameters and buffers, and a fix that changes them is not a memory rewrite"
                )
            # the case's tensors stay in the module after the loss returns: backward (a checkpoint's
            # recompute, a hook) must see the same tensors the forward did
            for name, places in slots.items():
                for table, key in places:
                    table[key] = state[name]
            return loss_of(module, given)

        return run

    def inputs(case_dtype: torch.dtype, device: torch.device, seed: int) -> tuple[Any, ...]:
        def cast(t: Any, grad: bool) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            t = t.detach().to(device)
            if t.is_floating_point():
                t = t.to(case_dtype)
            return t.clone().requires_grad_(grad and t.is_floating_point())

        state = {name: cast(p, p.requires_grad) for name, p in params.items()}
        state |= {name: cast(b, False) for name, b in buffers.items()}
        return state, tree_map(lambda x: cast(x, False), batch)

    return verify(
        step(original),
        step(fixed),
        inputs,
        mode=mode,
        dtypes=(dtype,),
        layouts=("contiguous",),
        seeds=(seed,),
        memory=memory,
        progress=progress,
        device=next(original.parameters()).device,
    )


def _changed_state(module: nn.Module, original: dict[str, torch.Tensor]) -> str:
    """What ``fix`` did to the weights: names it added, removed, or gave other values, dtypes or
    shapes (empty when it left them as they were)."""
    now = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    added = sorted(set(now) - set(original))
    removed = sorted(set(original) - set(now))
    other = [
        name
        for name in now.keys() & original.keys()
        if now[name].dtype != original[name].dtype
        or now[name].shape != original[name].shape
        or not torch.equal(now[name].detach().cpu(), original[name].detach().cpu())
    ]
    parts = [
        f"{label} {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"
        for label, names in (("added", added), ("removed", removed), ("changed", sorted(other)))
        if names
    ]
    return "; ".join(parts)


def _slots(module: nn.Module) -> dict[str, list[tuple[dict[str, Any], str]]]:
    """For each parameter and buffer (by its first ``named_parameters()``/``named_buffers()`` name), every
    place a module holds it: ``(module._parameters, "weight")`` — tied weights are held in two places."""
    first: dict[int, str] = {}
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        first.setdefault(id(t), name)
    slots: dict[str, list[tuple[dict[str, Any], str]]] = {}
    for _, owner in module.named_modules(remove_duplicate=False):
        for table in (owner._parameters, owner._buffers):
            for key, t in table.items():
                if t is not None and id(t) in first:
                    places = slots.setdefault(first[id(t)], [])
                    if not any(tb is table and k == key for tb, k in places):
                        places.append((table, key))
    return slots
