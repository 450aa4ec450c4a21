"""The loss of a language model: full ``[tokens, vocab]`` logits feeding a cross-entropy
(``logits-cross-entropy``), and widening copies whose downstream buffers are all wide because of them
(``upcast-copy``: ``logits.float()`` before the loss, an fp32 norm of bf16 activations)."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from memtrim.analysis.whatif import Added, Edits
from memtrim.doctor.diagnosis import DIAGNOSES, Diagnosis, finding
from memtrim.doctor.rules.common import (
    HALF,
    ITEMSIZE,
    base_name,
    called_object,
    describe,
    dims,
    is_float,
    module_expression,
    numel,
    where,
)
from memtrim.doctor.rules.logit_chain import (
    LogitChain,
    Slice,
    fold,
    hidden_scales,
    only_feeds,
    walk_back,
)
from memtrim.trace.model import Allocation, Fact, OpRow, Phase, Site

if TYPE_CHECKING:
    from memtrim.analysis.analysis import Analysis
    from memtrim.analysis.flow import Flow

_MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul", "linear"})
_NLL = frozenset({"nll_loss_forward", "nll_loss2d_forward", "nll_loss_nd", "nll_loss"})
_LOG_SOFTMAX = frozenset({"_log_softmax", "log_softmax"})
VOCAB_FACTOR = 4
"""Logits at least this many times wider than the hidden states are worth never materialising."""

# memtrim.fixes.chunked_linear_cross_entropy's chunk_size=None, so the fix text and the what-if agree
# with what the prescription does by default (analysis may not import fixes: the rule is restated).
TILE_FRACTION = 8
MIN_TILE_BYTES = 8 * 2**20
CHUNK_MULTIPLE = 8


def bytes_per_logit(dtype: str) -> int:
    """Tile bytes per logit: fp32 softmax arithmetic, plus the half-precision copy the matmuls use."""
    size = ITEMSIZE.get(dtype, 4)
    return 4 + size if dtype in HALF else size


MIN_COLUMNS = 512
"""As ``memtrim.fixes.cross_entropy.MIN_COLUMNS``: a tile spans all tokens when that leaves it this many
vocabulary columns."""


def _tiling(tokens: int, vocab: int, chunk: int) -> tuple[int, int]:
    """The ``(rows, columns)`` of the fix's tiles of ``chunk * vocab`` logits
    (``memtrim.fixes.cross_entropy.tiling``; a test holds the two equal)."""
    budget = chunk * vocab
    rows = tokens if tokens * min(vocab, MIN_COLUMNS) <= budget else max(chunk, budget // MIN_COLUMNS)
    return rows, min(vocab, budget // rows)


def chunk_size(tokens: int, vocab: int, hidden: int, dtype: str) -> int:
    """Tokens per tile: the largest multiple of 8 whose ``[chunk, vocab]`` tile fits within
    ``max(weight bytes / 8, 8 MiB)`` (at least 8, at most ``tokens``)."""
    if tokens <= 0:
        return 1
    budget = max(vocab * hidden * ITEMSIZE.get(dtype, 4) // TILE_FRACTION, MIN_TILE_BYTES)
    rows = budget // max(vocab * bytes_per_logit(dtype), 1)
    return int(min(max(CHUNK_MULTIPLE, rows // CHUNK_MULTIPLE * CHUNK_MULTIPLE), tokens))


def _grads_in_backward(
    flow: Flow, allocations: list[Allocation], saved: Allocation, sizes: set[int]
) -> list[int]:
    """Backward buffers of one of ``sizes`` elements computed from ``saved`` (the saved log-softmax),
    then from those: the gradients of the logits (and of the logits a slice was copied from), until an op
    makes something of another size (the matmul's)."""
    found: list[int] = []
    frontier = deque([saved.id])
    seen = {saved.id}
    while frontier:
        ident = frontier.popleft()
        for seq in flow.readers[ident]:
            if flow.ops[seq].phase is not Phase.BACKWARD:
                continue
            for out in flow.outputs[seq]:
                if out not in seen and numel(allocations[out]) in sizes:
                    seen.add(out)
                    found.append(out)
                    frontier.append(out)
    return found


_LINEAR_LEAD = 8
"""How many ops before its matmul ``F.linear``'s ``aten.t`` of the weight may be: it runs a ``clone``
and a view of a non-contiguous input in between (an LSTM's output), nothing more."""


@dataclass(frozen=True)
class _Loss:
    """One cross-entropy on full logits, as the trace shows it."""

    chain: list[Allocation]
    """What log-softmax read, back through its copies and elementwise steps to the matmul's logits
    (last)."""
    log_probs: Allocation
    backward: list[Allocation]
    """The logits-sized gradients backward made from the saved log-softmax."""
    nll: OpRow
    matmul: OpRow
    weight: Allocation
    hidden: Allocation
    """What the fix takes as ``hidden``: the matmul's operand, or what it was scaled from."""
    steps: LogitChain
    scaled: list[Allocation]
    """The scaled copies of ``hidden`` the matmul read (none without a hidden scale)."""
    cut: Slice | None = None
    """The loss read a copy of a slice of the logits (``logits[:, :-1]``): the fix slices ``hidden``."""
    linear: bool = False
    """The head module transposed the weight with ``aten.t`` before the matmul, as ``F.linear`` does."""

    @property
    def logits(self) -> Allocation:
        return self.chain[-1]

    @property
    def vocab(self) -> int:
        return self.log_probs.shape[-1]

    @property
    def tokens(self) -> int:
        return numel(self.log_probs) // self.vocab

    @property
    def width(self) -> int:
        return numel(self.weight) // self.vocab


_Key = tuple[Site | None, Site | None, float, float | None, str | None]


def _losses(analysis: Analysis) -> dict[_Key, list[_Loss]]:
    """Every forward log-softmax a nll_loss reads, whose input is a matmul's output with a ``[vocab,
    width]`` weight, ``vocab >= 4 * width``, or made from one by copies and an elementwise chain the
    chunked loss reproduces (:mod:`.logit_chain`), read by nothing but the loss; by lines and chain."""
    flow, allocations = analysis.flow, analysis.allocations
    scalars = analysis.log.scalars
    ops = flow.ops
    found: dict[_Key, list[_Loss]] = {}
    for seq, row in enumerate(ops):
        if flow.names[seq] not in _LOG_SOFTMAX or row.phase is not Phase.FORWARD or not row.inputs:
            continue
        made = flow.outputs[seq]
        if len(made) != 1 or len(allocations[made[0]].shape) < 2:
            continue
        log_probs = allocations[made[0]]
        nll = [r for r in flow.readers[log_probs.id] if flow.names[r] in _NLL]
        chain, step_ops, cut = walk_back(flow, allocations, allocations[row.inputs[0]], scalars)
        matmul_seq = flow.producer[chain[-1].id]
        matmul = flow.made_by(chain[-1])
        if not nll or matmul is None or base_name(matmul.op) not in _MATMULS:
            continue
        vocab = log_probs.shape[-1]
        operands = [allocations[i] for i in matmul.inputs]
        weights = [a for a in operands if len(a.shape) == 2 and vocab in a.shape]
        hidden = [a for a in operands if a not in weights and a.shape != (vocab,)]  # not the bias
        if len(weights) != 1 or len(hidden) != 1 or vocab < VOCAB_FACTOR * numel(weights[0]) // vocab:
            continue
        has_bias = base_name(matmul.op) in ("addmm", "baddbmm", "linear")
        steps = fold(flow, allocations, scalars, chain, step_ops, has_bias)
        source, scaled = hidden[0], list[Allocation]()
        if steps is not None and steps.bias is None and not has_bias:
            source, scaled, pre, hidden_steps = hidden_scales(
                flow, allocations, scalars, hidden[0], matmul_seq
            )
            if scaled:
                steps = fold(flow, allocations, scalars, chain, step_ops, has_bias, pre, hidden_steps)
        if steps is None:
            continue  # an op between the matmul and the loss that the chunked loss does not reproduce
        one_row_each = numel(source) == numel(chain[-1]) // vocab * source.shape[-1]
        if cut is not None and (_in_transformers_loss(log_probs.site) or not one_row_each):
            continue  # a model's own loss sliced, or hidden states that are not one row per logits row
        sizes = {numel(log_probs), numel(chain[-1])}
        backward = [allocations[i] for i in _grads_in_backward(flow, allocations, log_probs, sizes)]
        own = set(step_ops) | {seq} | {flow.producer[g.id] for g in backward}
        if not all(only_feeds(flow, c, own) for c in chain):
            continue  # the logits are used for something besides the loss: they must exist
        linear = any(
            flow.names[i] == "t" and ops[i].module == chain[-1].module and weights[0].id in ops[i].inputs
            for i in range(max(0, matmul_seq - _LINEAR_LEAD), matmul_seq)
        )
        loss = _Loss(
            chain, log_probs, backward, ops[nll[0]], matmul, weights[0], source, steps, scaled, cut, linear
        )
        key = (log_probs.site, chain[-1].site, steps.logit_scale, steps.softcap, cut.index if cut else None)
        found.setdefault(key, []).append(loss)
    return found


def _chunked_edits(losses: list[_Loss], chunk: int) -> tuple[list[Allocation], Edits]:
    """The what-if of the chunked loss: no ``[tokens, vocab]`` buffer at all; one tile from the
    logits' matmul to the nll_loss, one during backward's gradients of them, the log-sum-exp per token
    between the two, and for fp16/bf16 the fp32 sums of the hidden states' (and bias's) gradient and of
    a block of the weight's gradient where the tiles split the tokens."""
    removed: list[Allocation] = []
    added: list[Added] = []
    free_at: dict[int, float | None] = {}
    for loss in losses:
        removed += [*loss.chain, loss.log_probs, *loss.backward, *loss.scaled]
        if loss.scaled:  # the fix is handed the unscaled hidden states: they live as long as the copy did
            _keep_until(free_at, loss.hidden, loss.scaled[0].free_tick)
        tile = chunk * loss.vocab * bytes_per_logit(loss.logits.dtype)
        start = loss.logits.alloc_tick
        added.append(Added(tile, start, loss.nll.tick + 0.5))
        if not loss.backward:
            continue
        begin = min(g.alloc_tick for g in loss.backward) - 0.5
        ends = [g.free_tick for g in loss.backward if g.free_tick is not None]
        end = max(ends) if len(ends) == len(loss.backward) else None
        added.append(Added(tile, begin, end))
        added.append(Added(loss.tokens * 4, start, end))
        if loss.cut is not None and (loss.cut.step > 1 or math.prod(loss.cut.full[: loss.cut.dim]) > 1):
            # hidden[:, :-1] is not contiguous: the fix flattens it into a copy it keeps for backward
            added.append(Added(loss.tokens * loss.width * ITEMSIZE.get(loss.hidden.dtype, 4), start, end))
        rows, columns = _tiling(loss.tokens, loss.vocab, chunk)
        if loss.logits.dtype in HALF:
            # the hidden states' gradient (and the bias's) summed over the tiles in fp32
            has_bias = base_name(loss.matmul.op) in ("addmm", "baddbmm", "linear")
            added.append(Added(4 * (loss.tokens * loss.width + (loss.vocab if has_bias else 0)), begin, end))
        if loss.logits.dtype in HALF and rows < loss.tokens:
            # the tiles split the tokens: a [columns, H] block of the weight's gradient sums over them in fp32
            added.append(Added(4 * columns * loss.width, begin, end))
        if loss.steps.softcap is not None:  # the softcap's derivative, a second tile in backward
            accumulate = 4 if loss.logits.dtype in HALF else ITEMSIZE.get(loss.logits.dtype, 4)
            added.append(Added(chunk * loss.vocab * accumulate, begin, end))
    for a in removed:
        free_at.pop(a.id, None)
    return removed, Edits(remove=frozenset(a.id for a in removed), free_at=free_at, add=tuple(added))


@DIAGNOSES.register("logits-cross-entropy")
def logits_cross_entropy(analysis: Analysis) -> list[Diagnosis]:
    """``[tokens, vocab]`` logits from a matmul (the lm_head), read only by a log-softmax that a
    ``nll_loss`` reads (``F.cross_entropy``), with copies (an upcast) and an elementwise chain the
    chunked loss reproduces between (a softcap, a temperature, a scale, a bias: :mod:`.logit_chain`)
    -> a chunked linear + cross-entropy that never holds the logits: ``memtrim.fixes.chunked_loss(model)``
    for a transformers model's own loss, ``memtrim.fixes.chunked_linear_cross_entropy`` otherwise."""
    results = []
    for losses in _losses(analysis).values():
        first = losses[0]
        tokens, vocab, width = first.tokens, first.vocab, first.width
        chain = first.steps
        chunk = chunk_size(tokens, vocab, width, first.logits.dtype)
        removed, edits = _chunked_edits(losses, chunk)
        # every name the printed call reads is a name, said after the call (runnable as printed)
        weight = module_expression(first.logits.module, "weight") or "weight"
        named = f", weight the {dims(first.weight.shape)} weight" if weight == "weight" else ""
        bias = ""
        if base_name(first.matmul.op) in ("addmm", "baddbmm", "linear"):
            bias = f", bias={module_expression(first.logits.module, 'bias') or 'bias'}"
            named += ", bias the layer's bias" if bias == ", bias=bias" else ""
        elif chain.bias is not None:
            bias = ", bias=bias"
            named += f", bias the {dims(chain.bias.shape)} bias added at {where(first.chain[-2].site)}"
        if weight != "weight" and first.logits.module:
            named += f", model {called_object(analysis, first.logits.module)}"
        upcast = " and its upcast" if any(s.endswith(" copy") for s in chain.steps) else ""
        between = _chain_text(chain)
        counts: dict[int, int] = {}  # buffers of each row count (a slice's rows and the logits')
        for a in (*first.chain, first.log_probs, *first.backward):
            counts[numel(a) // vocab] = counts.get(numel(a) // vocab, 0) + 1
        total = sum(counts.values())
        if len(counts) == 1:
            buffers = f"{total} buffers of {next(iter(counts))}x{vocab}"
        else:
            sizes = " and ".join(f"{n} of {rows}x{vocab}" for rows, n in sorted(counts.items()))
            buffers = f"{total} buffers ({sizes})"
        hidden = f"the [{tokens}, {width}] input of {where(first.logits.site)}"
        if first.scaled:
            scales = ", ".join(chain.hidden_steps)
            hidden = f"the [{tokens}, {width}] input of the {scales} at {where(first.scaled[-1].site)}"
        given, labels = "hidden", f"the [{tokens}] labels"
        if first.cut is not None:
            # the logits were sliced before the loss (logits[:, :-1]): the same rows of the hidden states
            cut = first.cut
            given = f"hidden{cut.index}"
            hidden = hidden.replace(f"[{tokens}, {width}]", dims((*cut.full[:-1], width)), 1)
            hidden += f" (the fix slices it as {where(first.chain[-2].site)} slices the logits)"
            labels = f"the {dims(cut.shape[:-1])} labels the loss reads"
        fix = (
            f"loss = memtrim.fixes.chunked_linear_cross_entropy({given}, {weight}, target{bias}"
            f"{chain.arguments}, chunk_size={chunk}), hidden {hidden}, target {labels}{named}"
        )
        code: str | None = None
        binds: tuple[tuple[str, str], ...] = ()
        note = (
            f"pass the ignore_index and reduction your loss uses; the what-if replaces the {tokens}x{vocab} "
            f"buffers with one [{chunk}, {vocab}] tile in forward and one in backward"
            + (" (two with the softcap)" if chain.softcap is not None else "")
        )
        head = module_expression(first.logits.module, "") if _patchable_head(first) else None
        if head:
            note += (
                f"; or, the training code unchanged: handle = memtrim.fixes.chunked_head_loss("
                f"{head}, chunk_size={chunk}) makes F.cross_entropy of its logits this loss "
                "(what memtrim fit applies)"
            )
        if _in_transformers_loss(first.log_probs.site):
            if chain.logit_scale == 1.0 and chain.bias is None:
                # the model's own loss (ForCausalLMLoss: labels shifted, -100 ignored, fp32): patch the
                # model so that model(..., labels=labels).loss is that loss, chunked
                softcap = (
                    f", the softcap {chain.softcap!r} from config.final_logit_softcapping applied per tile"
                    if chain.softcap is not None
                    else ""
                )
                fix = (
                    f"memtrim.fixes.chunked_loss(model, chunk_size={chunk}): model(..., labels=labels).loss "
                    "is the model's own loss (labels shifted, -100 ignored, fp32 as ForCausalLMLoss"
                    f"{softcap}) without the logits (.logits is None when labels are passed)"
                )
                code = f"import memtrim.fixes\nhandle = memtrim.fixes.chunked_loss(model, chunk_size={chunk})"
                root = first.log_probs.module or first.logits.module or ""
                binds = (("model", called_object(analysis, root) if root else "your transformers causal LM"),)
            else:
                # chunked_loss(model) applies no logit scale nor bias of its own: the function form
                fix = (
                    f"loss = memtrim.fixes.causal_lm_cross_entropy(hidden, {weight}, labels{bias}"
                    f"{chain.arguments}, chunk_size={chunk}), hidden {hidden}, labels the model's labels "
                    f"(shifted inside, as ForCausalLMLoss does){named}"
                )
                note += "; chunked_loss(model) would drop the scale between the lm_head and the loss"
        problem = f"{dims((tokens, vocab))} {first.logits.dtype} logits{upcast}{between} feed cross_entropy"
        diagnosis = finding(
            analysis,
            rule="logits-cross-entropy",
            code=code,
            binds=binds,
            site=first.log_probs.site,
            problem=f"{problem}: {buffers} live for the loss",
            fix=fix,
            allocations=tuple(removed),
            edits=edits,
            safe_because=(
                f"the logits come from {first.matmul.op} of a [{tokens}, {width}] input and a "
                f"{dims(first.weight.shape)} weight at {where(first.logits.site)}",
                "nothing reads them but the loss (a log_softmax read by nll_loss), its copies and views"
                + (", and the elementwise steps between" if chain.arithmetic else ""),
                *_chain_reasons(chain),
                "the chunked loss computes the same log-softmax per chunk (fp32 for fp16/bf16) and "
                "recomputes each chunk's logits in backward: prove it with memtrim.verify.verify(..., "
                "mode='reference')",
            ),
            keeps="reference",
            module=first.log_probs.module,
            sites=(
                first.logits.site,
                *(a.site for a in reversed(first.chain[:-1])),
                *(a.site for a in first.scaled),
            ),
            cost=f"one more [{tokens}, {width}] x [{width}, {vocab}] matmul in backward (the logits, "
            f"recomputed chunk by chunk): {2 * tokens * width * vocab / 1e9:.2g} GFLOP",
            note=note,
        )
        if diagnosis is not None:
            results.append(diagnosis)
    return results


def _chain_text(chain: LogitChain) -> str:
    """``, softcapped (/ 30.0, tanh, * 30.0)``: the elementwise steps as the problem names them."""
    steps = (*chain.hidden_steps, *chain.arithmetic)
    if not steps:
        return ""
    if chain.softcap is not None:
        kind = "softcapped"
    elif any(s[0] in "*/" or s == "-" for s in steps):
        kind = "scaled"
    else:
        kind = "with a bias" if steps == ("+ bias",) else "shifted"
    return f", {kind} ({', '.join(steps)}),"


def _chain_reasons(chain: LogitChain) -> tuple[str, ...]:
    if not (chain.hidden_steps or chain.arithmetic):
        return ()
    parts = []
    if chain.hidden_steps:
        parts.append(f"{', '.join(chain.hidden_steps)} on the hidden states before the matmul")
    if chain.arithmetic:
        parts.append(f"{', '.join(chain.arithmetic)} on the matmul's output z")
    form = "softcap * tanh(logit_scale * z / softcap)" if chain.softcap is not None else "z * logit_scale"
    if chain.bias is not None:
        form = form.replace("z", "(z + bias)")
    shift = " (a number added to every logit leaves the softmax unchanged)" if chain.shifted else ""
    return (f"{' and '.join(parts)}: {form} with{chain.arguments.lstrip(',') or ' logit_scale=1.0'}{shift}",)


def _in_transformers_loss(site: Site | None) -> bool:
    """The loss ran in transformers' own loss functions (``transformers/loss/loss_utils.py``)."""
    return site is not None and "transformers/loss/" in site.file.replace("\\", "/")


@dataclass(frozen=True)
class HeadLoss:
    """A plain-code ``F.cross_entropy`` of a layer's logits with nothing between but views and copies
    (``.float()``): what ``memtrim.fixes.chunked_head_loss(model.<head>)`` takes over with no change to
    the training code (the plan's ``chunked-head-loss`` lever)."""

    head: str
    """The recorded module path of the layer that made the logits (``GPT.lm_head``)."""
    weight_shape: tuple[int, ...]
    chunk: int
    edits: Edits
    """The chunked loss's what-if, with the layer's input kept as long as the logits were (the deferred
    logits hold it)."""
    flops: float
    """The chunked loss's extra work: the logits once more in backward."""
    upcast: bool
    """The loss took fp32 copies of the logits (``.float()``)."""
    tokens: int
    """Tokens per call of the loss (its first)."""


def _bias_in_head(loss: _Loss) -> bool:
    """The chain's bias was added by the head module itself, to its own matmul's output: ``nn.Linear``
    on a non-contiguous input (an LSTM's ``batch_first`` output) runs ``mm`` then ``add``, not
    ``addmm``. The deferred logits of ``chunked_head_loss`` add the layer's bias themselves. Only in
    ``F.linear``'s form (the weight through ``aten.t`` in the same module): a module of one's own that
    adds a bias (``h @ self.weight.T + self.bias``: a ``permute``) is not an ``nn.Linear``, which is
    all ``chunked_head_loss`` patches."""
    bias, chain = loss.steps.bias, loss.chain
    return (
        loss.linear
        and bias is not None
        and len(chain) >= 2
        and chain[-2].module == loss.logits.module
        and bias.shape == (loss.vocab,)
        and Fact.PARAMETER in bias.facts
    )


def _patchable_head(loss: _Loss) -> bool:
    """Plain code, a head module that ran ``F.linear``, nothing between its logits and the loss but
    views, copies, the upcast and the head's own bias: what the deferred logits of
    ``chunked_head_loss`` take over."""
    chain = loss.steps
    own_bias = _bias_in_head(loss)
    plain = (
        all(step == "+ bias" and own_bias for step in chain.arithmetic)
        and not chain.hidden_steps
        and (chain.bias is None or own_bias)
        and not loss.scaled
        and loss.cut is None  # the deferred logits take no slice
    )
    return (
        plain
        and loss.linear  # an nn.Linear's F.linear: all chunked_head_loss patches
        and "." in (loss.logits.module or "")
        and not _in_transformers_loss(loss.log_probs.site)
        # a downcast: the deferred logits take only the upcast the loss makes
        and all(step in ("copy", "float32 copy") or (step == "+ bias" and own_bias) for step in chain.steps)
    )


def head_losses(analysis: Analysis) -> list[HeadLoss]:
    """The losses :class:`HeadLoss` describes, one per line of code and head."""
    results = []
    for losses in _losses(analysis).values():
        first = losses[0]
        chain = first.steps
        head = first.logits.module or ""
        if not _patchable_head(first):
            continue
        chunk = chunk_size(first.tokens, first.vocab, first.width, first.logits.dtype)
        _, edits = _chunked_edits(losses, chunk)
        free_at = dict(edits.free_at)
        for loss in losses:
            _keep_until(free_at, loss.hidden, loss.logits.free_tick)
        edits = Edits(remove=edits.remove, free_at=free_at, add=edits.add)
        flops = sum(2.0 * loss.tokens * loss.width * loss.vocab for loss in losses)
        upcast = "float32 copy" in chain.steps
        results.append(HeadLoss(head, first.weight.shape, chunk, edits, flops, upcast, first.tokens))
    return results


# -- upcast-copy -------------------------------------------------------------------------------------
def _wide_because_of(
    flow: Flow, allocations: list[Allocation], upcast: Allocation
) -> tuple[list[int], list[int]]:
    """The buffers downstream of ``upcast`` that are wide only because it is (every other float input
    of the op that made them is narrow or a scalar), and the copies back to the narrow dtype made from
    them (which a narrow program would not need)."""
    wide, narrow = upcast.dtype, None
    source_row = flow.made_by(upcast)
    if source_row is not None and source_row.inputs:
        narrow = allocations[source_row.inputs[0]].dtype
    downstream: list[int] = []
    downcasts: list[int] = []
    member = {upcast.id}
    frontier = deque([upcast.id])
    while frontier:
        ident = frontier.popleft()
        for seq in flow.readers[ident]:
            row = flow.ops[seq]
            outs = flow.outputs[seq]
            if not outs:
                continue
            others = [
                allocations[i]
                for i in row.inputs
                if i not in member and is_float(allocations[i]) and numel(allocations[i]) > 1
            ]
            if any(ITEMSIZE.get(o.dtype, 0) >= ITEMSIZE[wide] for o in others):
                continue  # another wide operand: the result would be wide anyway
            for out in outs:
                a = allocations[out]
                if out in member:
                    continue
                if a.dtype == wide:
                    member.add(out)
                    downstream.append(out)
                    frontier.append(out)
                elif a.dtype == narrow and flow.names[seq] == "_to_copy":
                    member.add(out)
                    downcasts.append(out)
    return downstream, downcasts


def _keep_until(free_at: dict[int, float | None], a: Allocation, until: int | None) -> None:
    """In the what-if, ``a`` lives at least to ``until`` (None: to the end)."""
    if a.free_tick is None:
        return
    if until is None or free_at.get(a.id, 0) is None:
        free_at[a.id] = None
    else:
        free_at[a.id] = max(a.free_tick, until, free_at.get(a.id) or 0)


@DIAGNOSES.register("upcast-copy")
def upcast_copy(analysis: Analysis) -> list[Diagnosis]:
    """A widening copy (``x.float()`` of bf16, ``.double()``) of a whole buffer whose downstream results
    are all wide because of it -> keep the narrow dtype where it is accurate enough, or upcast per
    chunk. The what-if keeps the source alive instead of the copy, narrows every downstream buffer that
    is wide because of the copy, and drops the copies back."""
    flow, allocations = analysis.flow, analysis.allocations
    groups: dict[Site | None, list[tuple[Allocation, Allocation, list[int], list[int]]]] = {}
    for seq, row in enumerate(flow.ops):
        if flow.names[seq] != "_to_copy" or len(row.inputs) != 1 or len(flow.outputs[seq]) != 1:
            continue
        up, source = allocations[flow.outputs[seq][0]], allocations[row.inputs[0]]
        if not (is_float(up) and is_float(source)) or numel(up) != numel(source):
            continue
        if ITEMSIZE[up.dtype] > ITEMSIZE[source.dtype]:
            downstream, downcasts = _wide_because_of(flow, allocations, up)
            groups.setdefault(up.site, []).append((up, source, downstream, downcasts))

    results = []
    for site, occurrences in groups.items():
        up, source, downstream, _ = occurrences[0]
        narrow, wide = ITEMSIZE[source.dtype], ITEMSIZE[up.dtype]
        remove: set[int] = set()
        resize: dict[int, int] = {}
        free_at: dict[int, float | None] = {}
        blamed: list[Allocation] = []
        for up_i, source_i, downstream_i, downcasts_i in occurrences:
            remove.add(up_i.id)
            blamed.append(up_i)
            _keep_until(free_at, source_i, up_i.free_tick)  # what read the copy reads the source
            for d in downstream_i:
                resize[d] = allocations[d].bytes * narrow // wide
                blamed.append(allocations[d])
            for d in downcasts_i:  # what read the copy back reads the narrowed buffer it came from
                remove.add(d)
                blamed.append(allocations[d])
                producer = flow.made_by(allocations[d])
                if producer is not None and producer.inputs:
                    _keep_until(free_at, allocations[producer.inputs[0]], allocations[d].free_tick)
        for ident in remove:
            free_at.pop(ident, None)
        feeds_loss = any(flow.names[r] in _LOG_SOFTMAX for r in flow.readers[up.id])
        hint = (
            " (it feeds a cross-entropy: memtrim.fixes.chunked_linear_cross_entropy upcasts one chunk at "
            "a time)"
            if feeds_loss
            else ""
        )
        diagnosis = finding(
            analysis,
            rule="upcast-copy",
            site=site,
            problem=(
                f"{source.dtype} -> {up.dtype} copy of a {describe(source)} buffer; "
                f"{len(downstream)} buffers after it are {up.dtype} only because of it"
            ),
            fix=f"stay in {source.dtype} from {where(site)} on if it is accurate enough, or upcast per "
            f"chunk{hint}",
            allocations=tuple(blamed),
            edits=Edits(remove=frozenset(remove), resize=resize, free_at=free_at),
            safe_because=(
                f"{up.op} widens {source.dtype} to {up.dtype}, element for element",
                "every float operand of the ops after it is narrow, a scalar, or itself widened by it",
                f"results change (arithmetic in {source.dtype}, less accurate than the upcast): a choice "
                "of precision, not a rewrite that keeps them",
            ),
            keeps="changes-training",
            module=up.module,
            note=f"the what-if keeps the {source.dtype} source instead of the copy and "
            f"{len(resize)} downstream buffers in {source.dtype}",
        )
        if diagnosis is not None:
            results.append(diagnosis)
    return results
