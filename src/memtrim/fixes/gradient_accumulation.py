"""``micro_batches(model, count)``: gradient accumulation without a loop of one's own — a transformers
model's ``model(..., labels=labels).loss`` and its gradients computed over ``count`` micro-batches.

The patch replaces the instance's ``forward`` (not the class's). In training (``model.training``,
gradients enabled) with ``labels`` passed, every argument whose first dimension is the batch's is cut
into ``count`` parts (``Tensor.tensor_split``: the parts differ by at most one row). The forward runs
once per part without saving anything for backward, to give the loss: each part's loss weighted by its
share of the counted tokens (labels other than -100, after the shift of a causal LM), so that the sum
is the whole batch's mean loss. When that loss's ``backward()`` runs, each part is run again, with the
random generators it first saw and under the autocast it first ran in, and back-propagated at once:
one part's activations are alive at a time, while the gradients add up in place; the loss's node
returns them, so autograd puts them in ``.grad`` (``backward()``) or hands them back
(``torch.autograd.grad``) as for the whole batch.

What it keeps: the same mean loss and the same gradients to rounding (sums taken in another order; the
loss is a weighted sum of the parts' means). It changes training where the forward draws random numbers
(dropout: other masks) or normalises over the batch (BatchNorm: statistics per part, and running
statistics updated by both passes). It costs one more forward of the batch (the loss's pass). The
output carries the loss only: ``.logits`` and the rest are None. Without labels, in ``eval()`` or under
``torch.no_grad()``, the model's own forward runs unchanged. Hooks that fire as a gradient is
accumulated (``register_post_accumulate_grad_hook``: the optimizer step in backward) fire once, with
the whole batch's gradient. ``handle.remove()`` undoes it.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memtrim.fixes.cross_entropy import is_fake
from memtrim.fixes.hf_loss import ChunkedLossHandle

IGNORE_INDEX = -100
"""The label transformers' losses skip (their ``ignore_index``): not counted in the mean."""

_NOT_SPLIT = frozenset({"cache_position", "num_items_in_batch", "logits_to_keep"})
"""Arguments never cut even where their first dimension equals the batch size (positions, counts)."""


@dataclass
class MicroBatchesHandle(ChunkedLossHandle):
    """What :func:`micro_batches` returns: ``remove()`` restores the forward it wrapped (the same
    instance-forward patch as :func:`~memtrim.fixes.hf_loss.chunked_loss`'s)."""

    count: int = 0


def shifted_labels(model: nn.Module) -> bool:
    """Whether ``model``'s loss is the mean over ``labels[..., 1:]`` (a causal LM's shift) or over all of
    ``labels`` (a masked LM, an encoder-decoder's decoder targets); a TypeError for any other model,
    whose loss is not known to be a mean over counted labels."""
    config = getattr(model, "config", None)
    name = type(model).__name__
    loss_type = getattr(model, "loss_type", None)
    if config is not None and getattr(config, "is_encoder_decoder", False):
        if name.endswith("ForConditionalGeneration"):
            return False  # their own CrossEntropyLoss() of the logits and labels, unshifted
    elif config is not None and loss_type == "ForMaskedLM":
        return False
    elif config is not None and (
        loss_type in ("ForCausalLM", "ForConditionalGeneration")
        or (loss_type is None and name.endswith(_CAUSAL_NAMES))  # loss_function's default: ForCausalLM
    ):
        return True
    raise TypeError(
        f"micro_batches supports transformers causal LMs, masked LMs and encoder-decoder "
        f"...ForConditionalGeneration models, not {name}; for other models accumulate gradients in the "
        "training loop: for each part, (loss_of(part) * part_size / batch_size).backward(), then one "
        "optimizer.step()"
    )


_CAUSAL_NAMES = ("ForCausalLM", "LMHeadModel")
MODEL_NAMES = (*_CAUSAL_NAMES, "ForMaskedLM", "ForConditionalGeneration")
"""How the classes this fix supports are named (what a recording shows of a model)."""


def _split(value: Any, batch: int, parts: int) -> list[Any]:
    if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == batch:
        return list(value.tensor_split(parts))
    return [value] * parts


class _Accumulated(torch.autograd.Function):
    """The loss's node. Its backward runs each part's forward and backward again (a reentrant
    backward, as reentrant checkpointing runs) and returns the gradients they accumulated for
    ``tensors`` (the model's parameters that require grad, leaf arguments that do): autograd puts them
    in ``.grad`` (``loss.backward()``) or hands them back (``torch.autograd.grad``)."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, run: Callable[[torch.Tensor], Any], *tensors: Any) -> Any:
        ctx.run = run
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        run, ctx.run = ctx.run, None
        if run is None:
            raise RuntimeError(
                "memtrim.fixes.micro_batches: backward through this loss ran already; call the model "
                "again for another backward (retain_graph cannot keep its parts' graphs)"
            )
        return None, None, *run(grad)


def _held_hooks(tensors: list[torch.Tensor]) -> list[tuple[Any, dict[Any, Any]]]:
    """The tensors' post-accumulate-grad hooks, taken out while the parts accumulate (put back with
    ``held.update(saved)``): they fire once, when autograd accumulates the whole batch's gradient.
    ``Tensor._post_accumulate_grad_hooks`` is the dict torch's autograd reads them from (private)."""
    held = []
    for t in tensors:
        hooks = getattr(t, "_post_accumulate_grad_hooks", None)
        if hooks:
            held.append((hooks, dict(hooks)))
            hooks.clear()
    return held


def _autocast_state() -> list[dict[str, Any]]:
    """``torch.autocast`` arguments that restore the autocast state of this moment, per device type."""
    kinds = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    return [
        {
            "device_type": kind,
            "dtype": torch.get_autocast_dtype(kind),
            "enabled": torch.is_autocast_enabled(kind),
            "cache_enabled": torch.is_autocast_cache_enabled(),
        }
        for kind in kinds
    ]


def _generators(tensors: list[torch.Tensor]) -> tuple[list[int], tuple[torch.Tensor, list[torch.Tensor]]]:
    """The random generators' states a part's forward starts from (CPU, and each CUDA device used)."""
    devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
    return devices, (torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices])


def micro_batches(model: nn.Module, count: int) -> MicroBatchesHandle:
    """Patch ``model`` (a transformers causal LM, masked LM or encoder-decoder) so that a training call
    with ``labels`` computes its loss and gradients over ``count`` micro-batches. Undo with
    ``handle.remove()``."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 2:
        raise ValueError(f"count must be an int of at least 2 (the micro-batches per batch), got {count!r}")
    shift = shifted_labels(model)
    original = model.forward
    had_instance_forward = "forward" in model.__dict__
    # the class's forward names the arguments, also where another patch's forward (*args, **kwargs) is
    # the one wrapped
    signature = inspect.signature(type(model).forward.__get__(model))
    recomputing = [False]

    def forward(*args: Any, **kwargs: Any) -> Any:
        if recomputing[0]:
            return original(*args, **kwargs)  # a part run again in backward, through functional_call
        named = _named(signature, args, kwargs)
        labels = None if named is None else named.get("labels")
        # the parameters as this call sees them: torch.func.functional_call's, where it substitutes them
        params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
        arguments = [v for v in (named or {}).values() if isinstance(v, torch.Tensor) and v.requires_grad]
        tensors = [p for p in params.values() if p.requires_grad] + arguments
        if (
            named is None
            or not isinstance(labels, torch.Tensor)
            or labels.dim() < 1
            or labels.shape[0] < 2
            or not (model.training and torch.is_grad_enabled())
            or not tensors
            or any(not t.is_leaf for t in arguments)  # a gradient to pass on upstream: not cut
            or named.get("return_dict") is False
        ):
            return original(*args, **kwargs)
        batch = labels.shape[0]
        parts = min(count, batch)
        split = {k: [v] * parts if k in _NOT_SPLIT else _split(v, batch, parts) for k, v in named.items()}
        calls = [{k: v[i] for k, v in split.items()} for i in range(parts)]
        weights = _weights(named, labels, calls, shift)
        if weights is None:
            return original(*args, **kwargs)  # no label is counted: the loss is the model's own NaN
        on = [*tensors, *(v for v in named.values() if isinstance(v, torch.Tensor))]
        autocast = _autocast_state()
        states, losses, output = [], [], None
        for call, weight in zip(calls, weights, strict=True):
            states.append(_generators(on))
            if weight is _SKIP:
                continue
            with torch.no_grad():
                output = original(**call)
                losses.append(output.loss if weight is None else output.loss * weight)
        total = torch.stack(losses).sum() if len(losses) > 1 else losses[0]

        def again(call: dict[str, Any]) -> torch.Tensor:
            recomputing[0] = True
            try:
                # under the autocast the loss's pass ran in (backward usually runs outside it)
                with contextlib.ExitStack() as stack:
                    for settings in autocast:
                        stack.enter_context(torch.autocast(**settings))
                    return torch.func.functional_call(model, {**params, **buffers}, (), call).loss
            finally:
                recomputing[0] = False

        def run(grad: torch.Tensor) -> list[torch.Tensor | None]:
            before = [t.grad for t in tensors]
            for t in tensors:
                t.grad = None
            hooks = _held_hooks(tensors)
            try:
                for call, weight, (devices, (cpu, cuda)) in zip(calls, weights, states, strict=True):
                    if weight is _SKIP:
                        continue
                    with torch.random.fork_rng(devices=devices), torch.enable_grad():
                        torch.set_rng_state(cpu)
                        for device, state in zip(devices, cuda, strict=True):
                            torch.cuda.set_rng_state(state, device)
                        part = again(call)
                        # accumulated into .grad as each is made (AccumulateGrad adds in place)
                        torch.autograd.backward(
                            part if weight is None else part * weight, grad, inputs=tensors
                        )
                        del part
                return [t.grad for t in tensors]
            finally:
                for t, g in zip(tensors, before, strict=True):
                    t.grad = g
                for held, saved in hooks:
                    held.update(saved)

        loss = _Accumulated.apply(total, run, *tensors)
        assert output is not None  # a counted label: some part ran
        return type(output)(loss=loss)

    model.forward = forward
    return MicroBatchesHandle(model, had_instance_forward, original, count)


_SKIP: Any = object()
"""A part none of whose labels is counted: it adds nothing to the loss or the gradients."""


def _named(signature: inspect.Signature, args: Any, kwargs: Any) -> dict[str, Any] | None:
    """The call's arguments by name (the ``**kwargs`` catch-all's merged in); None where they cannot be
    named (a ``*args`` catch-all, or arguments the signature does not take)."""
    try:
        bound = signature.bind_partial(*args, **kwargs).arguments
    except TypeError:
        return None
    named: dict[str, Any] = {}
    for name, value in bound.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                return None
        elif kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        else:
            named[name] = value
    return named


def _weights(
    named: dict[str, Any], labels: torch.Tensor, calls: list[dict[str, Any]], shift: bool
) -> list[Any] | None:
    """Each part's weight in the mean: its counted labels over the batch's (None: the model's loss is a
    sum over ``num_items_in_batch`` already, so the parts add up as they are). None for no counted label."""
    if named.get("num_items_in_batch") is not None:
        return [None] * len(calls)
    key = "shift_labels" if named.get("shift_labels") is not None else "labels"
    trim = shift and key == "labels"

    def counted(t: torch.Tensor) -> torch.Tensor:
        return ((t[..., 1:] if trim else t) != IGNORE_INDEX).sum()

    total = counted(named[key])
    fake = is_fake(labels)
    if not fake and int(total) == 0:
        return None
    weights: list[Any] = []
    for call in calls:
        n = counted(call[key])
        weights.append(_SKIP if not fake and int(n) == 0 else n / total)
    return weights
