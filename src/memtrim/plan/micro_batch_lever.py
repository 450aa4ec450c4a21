"""The micro-batches lever: gradient accumulation over the same batch (:func:`memtrim.fixes.micro_batches`).

Offered for a transformers causal LM, masked LM or encoder-decoder that computed its own loss
(``model(..., labels=...)``: the loss's ``nll_loss`` ran in the model's own forward), once per
micro-batch count that divides the batch (2, 4, 8). Its what-if, on the recorded step:

- every activation and temporary of the forward and backward whose first dimension is a multiple of
  the batch (``[batch, ...]``, ``[batch * heads, ...]``, ``[batch * tokens, ...]``) and that is not
  shaped as a parameter is resized to one micro-batch's share;
- the gradients the backward made exist from the start of the forward, as they do from the second
  micro-batch on, and each gradient computed there is a transient added into them.

The peak it predicts is that of the second and later micro-batches (the first has no gradients yet, the
loss's pass saves nothing). Its cost is one more forward's matmul and convolution FLOPs, and per
micro-batch beyond the first 2 FLOPs per parameter element (each part reads every weight again): of two
counts that fit, the fewer micro-batches. It keeps
``reference`` (the same mean loss, other rounding); ``changes-training`` where the forward drew random
numbers (dropout) or normalised over the batch (BatchNorm). It does not combine with the optimizer step
fused into backward, which would step on the first micro-batch's gradients.
"""

from __future__ import annotations

import bisect
import math
from typing import TYPE_CHECKING

from torch import nn

from memtrim.analysis.allocator import charged_bytes
from memtrim.analysis.roles import Role
from memtrim.analysis.whatif import Added, Edits
from memtrim.doctor.diagnosis import Keeps
from memtrim.doctor.rules.checkpoint import matmul_flops
from memtrim.fixes.gradient_accumulation import MODEL_NAMES, micro_batches, shifted_labels
from memtrim.plan.levers import LEVERS, Lever, Option, Undo, Uses
from memtrim.trace.model import Phase

if TYPE_CHECKING:
    from memtrim.analysis.analysis import Analysis

COUNTS = (2, 4, 8)
"""The micro-batch counts offered, each where it divides the batch."""

_LOSSES = frozenset({"nll_loss_forward", "nll_loss2d_forward", "nll_loss", "nll_loss_nd"})
_CHANGES_TRAINING = frozenset(
    {
        "bernoulli",
        "native_dropout",
        "rand",
        "rand_like",
        "randn",
        "randn_like",
        "randint",
        "randint_like",
        "randperm",
        "multinomial",
        "uniform",
        "normal",
        "exponential",
        "geometric",
        "cauchy",
        "log_normal",
        "random",
        "rrelu_with_noise",
        "native_batch_norm",
        "_native_batch_norm_legit",
        "_native_batch_norm_legit_functional",
        "_native_batch_norm_legit_no_stats",
        "cudnn_batch_norm",
        "miopen_batch_norm",
    }
)
"""Forward ops whose result depends on how the batch is cut: random draws, batch statistics."""
_SCALED = frozenset({Role.ACTIVATION, Role.TEMPORARY, Role.OUTPUT})


def _own_loss_model(analysis: Analysis) -> tuple[str, int] | None:
    """The root module path of the model that computed its loss in its own forward, and its batch size
    (the first dimension of the first embedding's indices in it)."""
    flow, ops = analysis.flow, analysis.flow.ops
    root = None
    for seq, row in enumerate(ops):
        if row.phase is Phase.FORWARD and flow.names[seq] in _LOSSES and row.module:
            root = row.module.partition(".")[0]
            break
    if root is None or not root.partition("#")[0].endswith(MODEL_NAMES):
        return None  # no loss in a model's forward, or not a model micro_batches knows the loss of
    for seq, row in enumerate(ops):
        if row.phase is not Phase.FORWARD or flow.names[seq] != "embedding" or len(row.inputs) < 2:
            continue
        if _inside(row.module, root):
            shape = analysis.allocations[row.inputs[1]].shape
            return (root, shape[0]) if len(shape) >= 1 and shape[0] >= 2 else None
    return None


def _inside(module: str | None, root: str) -> bool:
    return module is not None and (module == root or module.startswith(root + "."))


def _keeps(analysis: Analysis, root: str) -> Keeps:
    """What cutting the batch keeps: ``changes-training`` where the model's forward drew random numbers
    or normalised over the batch (the program's own draws, its data, are not the model's)."""
    flow = analysis.flow
    cut = any(
        # in-place forms (dropout's bernoulli_) by their base name
        row.phase is Phase.FORWARD
        and _inside(row.module, root)
        and flow.names[seq].rstrip("_") in _CHANGES_TRAINING
        for seq, row in enumerate(flow.ops)
    )
    return "changes-training" if cut else "reference"


def _edits(analysis: Analysis, batch: int, count: int) -> Edits:
    allocations = analysis.allocations
    ops = analysis.flow.ops
    # where each forward run starts (a step's forward after its backward or optimizer step): a
    # gradient exists from the start of its own step's forward, from the second micro-batch on
    starts = [
        row.tick
        for i, row in enumerate(ops)
        if row.phase is Phase.FORWARD and (i == 0 or ops[i - 1].phase is not Phase.FORWARD)
    ]
    part = -(-batch // count)
    parameter_shapes = {tuple(a.shape) for a in allocations if analysis.role(a) is Role.PARAMETER}
    resize: dict[int, int] = {}
    alloc_at: dict[int, float] = {}
    added: list[Added] = []
    for a in allocations:
        if a.preexisting or a.phase not in (Phase.FORWARD, Phase.BACKWARD):
            continue
        role = analysis.role(a)
        if role is Role.GRADIENT and a.phase is Phase.BACKWARD:
            at = bisect.bisect_right(starts, a.alloc_tick) - 1
            if at >= 0:
                alloc_at[a.id] = starts[at]
            added.append(Added(charged_bytes(a.bytes, a.device), a.alloc_tick, a.alloc_tick + 0.5))
        elif (
            role in _SCALED
            and a.shape
            and a.shape[0] >= batch
            and a.shape[0] % batch == 0
            and tuple(a.shape) not in parameter_shapes
        ):
            resize[a.id] = charged_bytes(-(-a.bytes * part // batch), a.device)
    return Edits(resize=resize, alloc_at=alloc_at, add=tuple(added))


def _options(analysis: Analysis) -> list[Option]:
    found = _own_loss_model(analysis)
    if found is None:
        return []
    root, batch = found
    model = root.partition("#")[0]
    keeps = _keeps(analysis, root)
    forward = float(
        matmul_flops(analysis, (s for s, row in enumerate(analysis.flow.ops) if row.phase is Phase.FORWARD))
    )
    weights = sum(math.prod(a.shape) for a in analysis.allocations if analysis.role(a) is Role.PARAMETER)
    return [
        Option(
            "micro-batches",
            f"{model}, {count} micro-batches",
            {"model": model, "count": count, "batch": batch},
            keeps,
            forward + 2.0 * weights * (count - 1),
            _edits(analysis, batch, count),
            exclusive="micro-batches",
            excludes=frozenset({"optimizer-in-backward"}),
        )
        for count in COUNTS
        if count <= batch and batch % count == 0
    ]


def _code(uses: Uses) -> str:
    return "\n".join(
        f"handle = memtrim.fixes.micro_batches(model, {p['count']})  # your {p['model']}: the batch of "
        f"{p['batch']} as {p['count']} micro-batches of {p['batch'] // p['count']}, one optimizer step"
        for p in uses
    )


def _apply(module: nn.Module, uses: Uses) -> Undo | None:
    for p in uses:
        if type(module).__name__ != p["model"] or getattr(module, "config", None) is None:
            continue
        try:
            shifted_labels(module)
        except TypeError:
            return None
        return micro_batches(module, int(p["count"])).remove
    return None


LEVERS.add("micro-batches", Lever("micro-batches", "reference", _options, _code, apply=_apply))
