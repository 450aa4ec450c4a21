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
import torch.nn.functional as F
from torch import nn

from memtrim.analysis.whatif import Added, Edits
from memtrim.doctor import diagnoses
from memtrim.doctor.diagnosis import Keeps
from memtrim.doctor.rules.checkpoint import block_recomputes
from memtrim.doctor.rules.loss import head_losses
from memtrim.fixes.checkpoint import checkpoint_modules
from memtrim.fixes.head_loss import chunked_head_loss
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
    excludes: frozenset[str] = frozenset()
    """Levers a combination with this option does not take (changes that would undo each other)."""


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
    probes: Callable[[nn.Module, Uses], list[Probe]] | None = None
    """For a module lever whose change the model's own output does not show (the loss is computed
    outside the model): what ``memtrim.verify.verify_fix`` checks instead of the model's call, for a model
    the program called; empty where the model is not what the uses name."""


@dataclass(frozen=True)
class Probe:
    """One ``memtrim.verify.verify_fix(module, fix, batch, loss=loss)``: a lever proven on a model's part."""

    what: str
    module: nn.Module
    fix: Callable[[nn.Module], object]
    batch: tuple[Any, ...]
    loss: Callable[[nn.Module, Any], torch.Tensor]


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


# -- the chunked loss of a plain-code head: F.cross_entropy(model(x).logits.view(-1, V), y) ----------
def _attribute_path(module_path: str) -> str:
    """The attribute path below the root of a recorded module path (``GPT.lm_head`` -> ``lm_head``;
    ``Net#2.head#1`` -> ``head``: the ``#n`` tell repeated calls apart, not attributes)."""
    return ".".join(segment.partition("#")[0] for segment in module_path.split(".")[1:])


def _head_loss_options(analysis: Analysis) -> list[Option]:
    options = []
    for loss in head_losses(analysis):
        root, module = _finding_root(loss.head), _attribute_path(loss.head)
        params = {
            "model": root,
            "module": module,
            "chunk_size": loss.chunk,
            "weight_shape": list(loss.weight_shape),
            "upcast": loss.upcast,
            "tokens": loss.tokens,
        }
        options.append(Option("chunked-head-loss", loss.head, params, "reference", loss.flops, loss.edits))
    return options


def _head_loss_code(params: Uses) -> str:
    return "\n".join(
        f"handle = memtrim.fixes.chunked_head_loss(model.{p['module']}, chunk_size={p['chunk_size']})"
        f"  # model: your {p['model']}"
        for p in params
    )


def _head_layers(module: nn.Module, params: Uses) -> list[tuple[nn.Linear, dict[str, Any]]]:
    """The plan's heads in ``module`` (the model they were recorded in), each with its use."""
    found = []
    for p in params:
        if type(module).__name__ != p["model"]:
            continue
        try:
            layer = module.get_submodule(str(p["module"]))
        except AttributeError:
            continue
        weight = getattr(layer, "weight", None)
        if (
            isinstance(layer, nn.Linear)
            and type(layer).forward is nn.Linear.forward
            and isinstance(weight, torch.Tensor)
            and list(weight.shape) == list(p["weight_shape"])
            and "forward" not in layer.__dict__  # patched already: a second use of the same layer
        ):
            found.append((layer, p))
    return found


def _head_loss_apply(module: nn.Module, params: Uses) -> Undo | None:
    undos = [
        chunked_head_loss(layer, chunk_size=p["chunk_size"]).remove
        for layer, p in _head_layers(module, params)
    ]
    if not undos:
        return None

    def undo() -> None:
        for remove in reversed(undos):
            remove()

    return undo


def _head_loss_probes(module: nn.Module, params: Uses) -> list[Probe]:
    """The chunked loss against ``F.cross_entropy`` of the layer's own logits, on the layer's weights:
    random hidden states for several chunks and a ragged last one, targets with an ignored token, the
    fp32 upcast where the program made one."""
    probes = []
    for layer, p in _head_layers(module, params):
        chunk, vocab = int(p["chunk_size"]), layer.out_features
        tokens = max(2, min(int(p["tokens"]), 2 * chunk + chunk // 2 + 1))
        generator = torch.Generator().manual_seed(0)
        weight = layer.weight
        hidden = torch.randn(tokens, layer.in_features, generator=generator).to(weight.device, weight.dtype)
        target = torch.randint(0, vocab, (tokens,), generator=generator).to(weight.device)
        target[tokens // 2] = -100  # F.cross_entropy's default ignore_index
        upcast = bool(p["upcast"])

        def loss(m: nn.Module, batch: Any, upcast: bool = upcast, vocab: int = vocab) -> torch.Tensor:
            logits = m(batch[0])
            logits = logits.float() if upcast else logits
            return F.cross_entropy(logits.view(-1, vocab), batch[1])

        def fix(m: nn.Module, chunk: int = chunk) -> object:
            return chunked_head_loss(m, chunk_size=chunk)  # type: ignore[arg-type]

        probes.append(Probe(f"{p['model']}.{p['module']}", layer, fix, (hidden, target), loss))
    return probes


LEVERS.add(
    "chunked-head-loss",
    Lever(
        "chunked-head-loss",
        "reference",
        _head_loss_options,
        _head_loss_code,
        apply=_head_loss_apply,
        probes=_head_loss_probes,
    ),
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
