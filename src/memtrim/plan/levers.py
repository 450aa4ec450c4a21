"""Levers: changes memtrim can both predict on a recorded timeline and apply to a live program.

Each lever is registered once in :data:`LEVERS` (the one :class:`~memtrim.registry.Registry` idiom) and
offers :class:`Option` s for a recorded analysis — one per independent choice (one block to checkpoint),
each with the :class:`~memtrim.analysis.whatif.Edits` that predict it and its cost. A combination of
options is predicted by replaying their merged edits together, never by summing savings.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from memtrim.analysis.whatif import Added, Edits
from memtrim.doctor import diagnoses
from memtrim.doctor.diagnosis import Keeps
from memtrim.doctor.rules.checkpoint import block_recomputes
from memtrim.fixes.checkpoint import checkpoint_modules
from memtrim.fixes.hf_loss import chunked_loss
from memtrim.registry import Registry
from memtrim.trace.model import Phase

if TYPE_CHECKING:
    from memtrim.analysis.analysis import Analysis


@dataclass(frozen=True)
class Option:
    """One choice a lever offers: applied to ``target`` with ``params``, costing ``cost``."""

    lever: str
    target: str
    params: dict[str, Any]
    keeps: Keeps
    cost: float
    """Extra work it makes (recompute FLOPs); 0 for a free change."""
    edits: Edits = field(repr=False, compare=False)
    exclusive: str | None = None
    """Options with the same key are alternatives: a combination takes at most one of them."""


Undo = Callable[[], None]
Uses = Sequence[dict[str, Any]]
"""A plan's uses of one lever: their ``params``, in plan order."""


@dataclass(frozen=True)
class Lever:
    """A registered lever: what it keeps at best (an option may keep less: :attr:`Option.keeps`), the
    options it offers on a recording, the code a user would paste to get the same change without
    memtrim, and how :func:`memtrim.applied` applies it — to a module, to an optimizer, or once for the
    block (one of the three)."""

    name: str
    keeps: Keeps
    options: Callable[[Analysis], list[Option]]
    code: Callable[[Uses], str]
    """The code for a plan's uses of this lever, from their ``params`` (in plan order)."""
    apply: Callable[[nn.Module, Uses], Undo | None] | None = None
    """Apply the plan's uses of this lever to a module the program calls for the first time (before
    its forward runs); an undo, or None where the module is not what they name."""
    apply_optimizer: Callable[[torch.optim.Optimizer, Uses], Undo | None] | None = None
    """Apply them to an optimizer of the program's parameters, before their first forward in the block
    (or before its first step there, for one built later); an undo, or None where it does not apply."""
    install: Callable[[Uses], Undo] | None = None
    """Apply them once for the whole block (a change of torch.optim's own behaviour); the undo."""


LEVERS: Registry[str, Lever] = Registry("plan lever", "memtrim.plan.levers.LEVERS.add(name, Lever(...))")


def merged(edits: Iterable[Edits]) -> Edits:
    """One what-if from several: each lever's edits touch its own allocations, so they merge."""
    remove: set[int] = set()
    resize: dict[int, int] = {}
    alloc_at: dict[int, float] = {}
    free_at: dict[int, float | None] = {}
    add: list[Added] = []
    for e in edits:
        remove |= e.remove
        resize.update(e.resize)
        alloc_at.update(e.alloc_at)
        free_at.update(e.free_at)
        add += e.add
    return Edits(frozenset(remove), resize, alloc_at, free_at, tuple(add))


# -- activation checkpointing, block by block --------------------------------------------------------
def _checkpoint_options(analysis: Analysis) -> list[Option]:
    options = []
    for recomputes in block_recomputes(analysis).values():
        for r in recomputes:
            options.append(
                Option("checkpoint", r.attribute, {"module": r.attribute}, "exact", float(r.flops), r.edits)
            )
    return options


def _checkpoint_code(params: Uses) -> str:
    names = [p["module"] for p in params]
    return f"memtrim.fixes.checkpoint_modules(model, {names!r})  # model: the module they are named in"


def _checkpoint_apply(module: nn.Module, params: Uses) -> Undo | None:
    names = {p["module"] for p in params}
    present = [name for name, _ in module.named_modules() if name in names]
    return checkpoint_modules(module, present).undo if present else None


LEVERS.add(
    "checkpoint", Lever("checkpoint", "exact", _checkpoint_options, _checkpoint_code, apply=_checkpoint_apply)
)


# -- use_cache=False (the doctor's cache-in-training finding) ---------------------------------------
def _finding_root(module_path: str | None) -> str:
    """The class of the outermost module of a recorded module path (``GPT2LMHeadModel#2.transformer``)."""
    return (module_path or "").partition(".")[0].partition("#")[0]


def _no_cache_options(analysis: Analysis) -> list[Option]:
    return [
        Option("use-cache-off", "config.use_cache", {}, "exact", 0.0, d.edits)
        for d in diagnoses(analysis)
        if d.rule == "cache-in-training"
    ][:1]


def _no_cache_code(params: Uses) -> str:
    return "model.config.use_cache = False  # or model(..., use_cache=False) in the training step"


def _no_cache_apply(module: nn.Module, params: Uses) -> Undo | None:
    configs = {id(c): c for m in module.modules() if (c := getattr(m, "config", None)) is not None}
    changed = [(c, c.use_cache) for c in configs.values() if getattr(c, "use_cache", None) is True]
    for config, _ in changed:
        config.use_cache = False

    def undo() -> None:
        for config, value in changed:
            config.use_cache = value

    return undo if changed else None


LEVERS.add(
    "use-cache-off", Lever("use-cache-off", "exact", _no_cache_options, _no_cache_code, apply=_no_cache_apply)
)


# -- the chunked loss of a transformers causal LM (the doctor's logits-cross-entropy finding) ------
_CHUNK = re.compile(r"chunked_loss\(model, chunk_size=(\d+)\)")


def _chunked_loss_options(analysis: Analysis) -> list[Option]:
    options = []
    for d in diagnoses(analysis):
        found = _CHUNK.search(d.code or "") if d.rule == "logits-cross-entropy" else None
        root = _finding_root(d.module)
        if found is None or not root:
            continue  # not a transformers model's own loss: the fix is a rewrite of the user's line
        params = {"model": root, "chunk_size": int(found.group(1))}
        cost = _matmul_flops(d.cost)
        options.append(Option("chunked-loss", root, params, "reference", cost, d.edits))
    return options[:1]


def _matmul_flops(cost: str | None) -> float:
    # the finding states its recompute (one more lm_head matmul) only as text, to two digits: enough to
    # rank it against a checkpoint's FLOPs
    found = re.search(r"([0-9.e+-]+) GFLOP", cost or "")
    return float(found.group(1)) * 1e9 if found else 0.0


def _chunked_loss_code(params: Uses) -> str:
    return "\n".join(
        f"handle = memtrim.fixes.chunked_loss(model, chunk_size={p['chunk_size']})  # your {p['model']}"
        for p in params
    )


def _chunked_loss_apply(module: nn.Module, params: Uses) -> Undo | None:
    for p in params:
        if type(module).__name__ == p["model"] and getattr(module, "config", None) is not None:
            return chunked_loss(module, chunk_size=p["chunk_size"]).remove
    return None


LEVERS.add(
    "chunked-loss",
    Lever("chunked-loss", "reference", _chunked_loss_options, _chunked_loss_code, apply=_chunked_loss_apply),
)


# -- scaled-dot-product attention for a transformers model (the doctor's eager-attention finding) ----
_SCORE_PRODUCTS = frozenset({"bmm", "baddbmm", "mm", "matmul"})


def _attention_recompute_flops(analysis: Analysis, blamed: Iterable[int]) -> float:
    """What SDPA's backward computes again: the scores ``q @ k.T`` (``2 * b * h * s * t * d`` FLOPs per
    attention), read off the recorded scores' matmuls (their query operand gives ``d``)."""
    flow, allocations = analysis.flow, analysis.allocations
    flops = 0.0
    for ident in blamed:
        a = allocations[ident]
        producer = flow.producer[a.id]
        if producer < 0 or flow.names[producer] not in _SCORE_PRODUCTS or a.phase is not Phase.FORWARD:
            continue
        inputs = flow.ops[producer].inputs
        query = allocations[inputs[0]].shape if inputs else ()
        if len(a.shape) < 2 or not query:
            continue
        head_dim = query[-1]
        flops += 2.0 * math.prod(a.shape) * head_dim
    return flops


def _sdpa_options(analysis: Analysis) -> list[Option]:
    options = []
    for d in diagnoses(analysis):
        root = _finding_root(d.module)
        if d.rule != "eager-attention" or "set_attn_implementation" not in (d.code or "") or not root:
            continue
        cost = _attention_recompute_flops(analysis, (a.id for a in d.allocations))
        options.append(Option("sdpa-attention", root, {"model": root}, "reference", cost, d.edits))
    return options[:1]


def _sdpa_code(params: Uses) -> str:
    return "\n".join(
        f'model.set_attn_implementation("sdpa")  # your {p["model"]}; or from_pretrained(..., '
        'attn_implementation="sdpa")'
        for p in params
    )


def _sdpa_apply(module: nn.Module, params: Uses) -> Undo | None:
    config = getattr(module, "config", None)
    setter = getattr(module, "set_attn_implementation", None)
    if config is None or setter is None or not any(type(module).__name__ == p["model"] for p in params):
        return None
    before = getattr(config, "_attn_implementation", None)
    setter("sdpa")
    return (lambda: setter(before)) if before is not None else None


LEVERS.add(
    "sdpa-attention",
    Lever("sdpa-attention", "reference", _sdpa_options, _sdpa_code, apply=_sdpa_apply),
)
