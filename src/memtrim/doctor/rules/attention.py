"""Eager attention (``eager-attention``): the ``[batch, heads, seq, seq]`` scores and probabilities of a
matmul -> (scale, mask) -> softmax -> (dropout) -> matmul attention, saved for backward and alive at the
peak, where ``scaled_dot_product_attention``'s fused kernel never makes them.

The what-if removes every ``[seq, seq]`` buffer of the chain, in forward (the scores, each scaled or
masked copy, the probabilities, a dtype cast of them) and in backward (the gradients of each), and adds
what the fused kernel keeps instead, as measured on torch 2.13's CPU kernel
(``_scaled_dot_product_flash_attention_for_cpu``): its output, which the eager program makes too, and a
float32 ``logsumexp`` of ``[batch, heads, seq]`` held from the forward to the attention's backward, where
the query, key and value gradients are made at once. The kernel's own work tiles live inside the op and
are not charged (as torch.profiler's cross-op accounting does not).

Dropout on the probabilities is not fused on CPU (SDPA falls back to its math path, which materialises
the same ``[seq, seq]`` tensors): such an attention is left alone on a CPU trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from memtrim.analysis.whatif import Added, Edits
from memtrim.doctor.diagnosis import DIAGNOSES, Diagnosis, finding
from memtrim.doctor.rules.common import called_object, dims, is_view_like, lines_text, numel, where
from memtrim.trace.model import Allocation, Phase, Site
from memtrim.units import format_bytes

if TYPE_CHECKING:
    from memtrim.analysis.analysis import Analysis

_SOFTMAX = frozenset({"_softmax", "softmax"})
"""The eager softmax (``_safe_softmax`` is SDPA's own math path: the program already calls SDPA)."""
_PRODUCTS = frozenset({"bmm", "baddbmm", "mm", "matmul"})
_CHAIN_STEPS = 8
"""Most elementwise ops between the scores' matmul and the softmax (scale, softcap, mask, cast)."""
_COPIES = frozenset({"clone", "contiguous", "_unsafe_view"})
_DROPOUT = frozenset({"native_dropout", "bernoulli_", "bernoulli", "dropout"})
_TRANSFORMERS_EAGER = "eager_attention_forward"


@dataclass
class _Attention:
    """One eager attention call: its ``[s, t]`` buffers, forward and backward."""

    softmax: int
    """The softmax's op number."""
    probabilities: Allocation
    forward: list[Allocation] = field(default_factory=list)
    backward: list[Allocation] = field(default_factory=list)
    scores_op: int = -1
    steps: list[int] = field(default_factory=list)
    """Op numbers between the scores and the softmax (scale, mask...)."""
    value_op: int = -1
    dropout: bool = False
    grads_made_late: list[Allocation] = field(default_factory=list)
    """The query and key gradients (made by the scores' backward), which the fused backward makes with
    the value gradient."""
    operand_copies: list[Allocation] = field(default_factory=list)
    """Contiguous copies the eager matmuls made of q, k or v (``key.transpose(2, 3)`` for ``matmul``),
    which SDPA reads as they are."""
    backward_start: float | None = None
    backward_end: float | None = None


def _square(a: Allocation, s: int, t: int, count: int) -> bool:
    return len(a.shape) >= 2 and tuple(a.shape[-2:]) == (s, t) and numel(a) == count


def _attention(analysis: Analysis, seq: int) -> _Attention | None:
    """The attention around the softmax at op ``seq``, or None where it is not a matmul-softmax-matmul."""
    flow, allocations, ops = analysis.flow, analysis.allocations, analysis.flow.ops
    if len(flow.outputs[seq]) != 1:
        return None
    p = allocations[flow.outputs[seq][0]]
    if len(p.shape) < 3 or p.shape[-1] < 2 or p.shape[-2] < 2:
        return None
    s, t, count = p.shape[-2], p.shape[-1], numel(p)
    found = _Attention(seq, p, forward=[p])
    # back from the softmax to the product that made the scores, through elementwise steps
    current = seq
    for _ in range(_CHAIN_STEPS + 1):
        square = [allocations[i] for i in ops[current].inputs if _square(allocations[i], s, t, count)]
        if len(square) != 1 or square[0].preexisting:
            return None
        source = square[0]
        producer = flow.producer[source.id]
        if producer < 0 or ops[producer].phase is not Phase.FORWARD:
            return None
        found.forward.append(source)
        if flow.names[producer] in _PRODUCTS:
            found.scores_op = producer
            break
        found.steps.append(producer)
        current = producer
    else:
        return None
    # on from the probabilities to the product with the values, through a cast or dropout
    frontier = [p]
    while frontier:
        a = frontier.pop()
        for reader in flow.readers[a.id]:
            row = ops[reader]
            if row.phase is not Phase.FORWARD:
                continue
            name = flow.names[reader]
            if name in _PRODUCTS:
                found.value_op = reader if found.value_op < 0 else min(found.value_op, reader)
                continue
            made = [allocations[i] for i in flow.outputs[reader] if _square(allocations[i], s, t, count)]
            if name in _DROPOUT:
                found.dropout = True
            found.forward += made
            frontier += made
    if found.value_op < 0 or not any(a.saved for a in found.forward):
        return None
    found.operand_copies = _operand_copies(analysis, found.scores_op) + _operand_copies(
        analysis, found.value_op
    )
    _backward(analysis, found, s, t, count)
    return found


def _operand_copies(analysis: Analysis, product: int) -> list[Allocation]:
    """The operands of ``product`` that the same line copied just for it (``matmul`` making a strided
    operand contiguous) and nothing else in forward reads."""
    flow, allocations, ops = analysis.flow, analysis.allocations, analysis.flow.ops
    copies = []
    for i in ops[product].inputs:
        made = flow.producer[i]
        if made < 0 or flow.names[made] not in _COPIES or ops[made].site != ops[product].site:
            continue
        forward_readers = [
            r
            for r in flow.readers[i]
            if ops[r].phase is Phase.FORWARD and not is_view_like(ops[r], flow.outputs[r])
        ]
        if forward_readers == [product]:
            copies.append(allocations[i])
    return copies


def _backward(analysis: Analysis, found: _Attention, s: int, t: int, count: int) -> None:
    """The backward's ``[s, t]`` gradients: from the ops that read a saved forward buffer, along the
    gradient's readers, until the scores' backward turns it into the query and key gradients."""
    flow, allocations, ops = analysis.flow, analysis.allocations, analysis.flow.ops
    collected: dict[int, Allocation] = {}
    late: dict[int, Allocation] = {}
    seen: set[int] = set()
    todo = [r for a in found.forward if a.saved for r in flow.readers[a.id] if ops[r].phase is Phase.BACKWARD]
    while todo:
        op = todo.pop()
        if op in seen:
            continue
        seen.add(op)
        for i in (*ops[op].inputs, *flow.outputs[op]):
            a = allocations[i]
            if a.phase is Phase.BACKWARD and i not in collected and _square(a, s, t, count):
                collected[i] = a
                todo += [r for r in flow.readers[i] if ops[r].phase is Phase.BACKWARD]
        if flow.names[op] in _PRODUCTS and any(i in collected for i in ops[op].inputs):
            for i in flow.outputs[op]:
                if i not in collected and not _square(allocations[i], s, t, count):
                    late[i] = allocations[i]
    found.backward = sorted(collected.values(), key=lambda a: a.alloc_tick)
    if found.backward:
        found.backward_start = min(a.alloc_tick for a in found.backward)
        found.backward_end = max(ops[op].tick for op in seen)
    found.grads_made_late = list(late.values())


def _logsumexp_bytes(p: Allocation) -> int:
    """SDPA's saved logsumexp: one accumulator-precision number per query row (float64 for float64)."""
    rows = numel(p) // p.shape[-1]
    return rows * (8 if p.dtype == "float64" else 4)


def _edits(analysis: Analysis, attentions: list[_Attention]) -> Edits:
    flow, allocations = analysis.flow, analysis.allocations
    remove = frozenset(a.id for att in attentions for a in (*att.forward, *att.backward, *att.operand_copies))
    alloc_at: dict[int, float] = {}
    free_at: dict[int, float | None] = {}
    added = []
    for att in attentions:
        start = flow.op_ticks[att.value_op]
        end = att.backward_end
        added.append(Added(_logsumexp_bytes(att.probabilities), start + 0.5, end))
        for i in flow.outputs[att.value_op]:
            out = allocations[i]
            # SDPA saves its output for backward: it lives at least until the attention's backward
            if out.free_tick is not None and end is not None and out.free_tick < end:
                free_at[i] = end
        if att.backward_start is not None:
            for g in att.grads_made_late:
                alloc_at[g.id] = att.backward_start
    return Edits(remove=remove, alloc_at=alloc_at, free_at=free_at, add=tuple(added))


def _is_transformers(site: Site | None) -> bool:
    return site is not None and site.function == _TRANSFORMERS_EAGER and "transformers" in site.file


@DIAGNOSES.register("eager-attention")
def eager_attention(analysis: Analysis) -> list[Diagnosis]:
    """Saved ``[b, h, s, s]`` scores/probabilities of a matmul-softmax-matmul attention ->
    ``attn_implementation="sdpa"`` (transformers) or ``F.scaled_dot_product_attention`` (plain code)."""
    flow, ops = analysis.flow, analysis.flow.ops
    groups: dict[Site | None, list[_Attention]] = {}
    for seq, name in enumerate(flow.names):
        if name not in _SOFTMAX or ops[seq].phase is not Phase.FORWARD:
            continue
        att = _attention(analysis, seq)
        if att is None:
            continue
        if att.dropout and att.probabilities.device.startswith("cpu"):
            continue  # SDPA on CPU runs dropout on its math path: the same [s, s] tensors
        groups.setdefault(ops[seq].site, []).append(att)
    results = []
    for site, attentions in groups.items():
        first = attentions[0]
        p = first.probabilities
        chain_sites = [ops[first.scores_op].site, *(ops[i].site for i in reversed(first.steps)), site]
        chain_sites.append(ops[first.value_op].site)
        blamed = [a for att in attentions for a in (*att.forward, *att.backward, *att.operand_copies)]
        saved = sum(a.bytes for att in attentions for a in att.forward if a.saved)
        squares = sum(len(att.forward) + len(att.backward) for att in attentions)
        problem = (
            f"{len(attentions)} eager attention{'s' if len(attentions) > 1 else ''} save "
            f"{dims(p.shape)} {p.dtype} probabilities for backward ({format_bytes(saved)} saved; "
            f"{squares} [seq, seq] buffers in forward and backward, lines "
            f"{lines_text(chain_sites)})"
        )
        code: str | None = None
        binds: tuple[tuple[str, str], ...] = ()
        if _is_transformers(site):
            fix = (
                'use attn_implementation="sdpa": from_pretrained(..., attn_implementation="sdpa") or '
                'from_config(config, attn_implementation="sdpa"), or on the built model '
                'model.set_attn_implementation("sdpa")'
            )
            code = 'model.set_attn_implementation("sdpa")'
            if p.module:
                binds = (("model", called_object(analysis, p.module)),)
        else:
            steps = [flow.names[i] for i in reversed(first.steps)]
            options, names = [], ["q, k, v [batch, heads, seq, head_dim]"]
            if any(n in ("add", "masked_fill", "where", "add_", "masked_fill_") for n in steps):
                options.append("attn_mask=mask")
                names.append("mask True where a score is kept (or is_causal=True in its place)")
            if any(n in ("mul", "div", "mul_", "div_") for n in steps):
                options.append("scale=scale")
                names.append("scale the scores' factor")
            fix = (
                "out = torch.nn.functional.scaled_dot_product_attention(q, k, v"
                + "".join(", " + o for o in options)
                + f") in place of the matmul, softmax and matmul at {where(ops[first.scores_op].site)} "
                f"to {where(ops[first.value_op].site)}, with {'; '.join(names)}"
            )
        diagnosis = finding(
            analysis,
            rule="eager-attention",
            site=site,
            problem=problem,
            fix=fix,
            code=code,
            binds=binds,
            allocations=tuple(blamed),
            edits=_edits(analysis, attentions),
            safe_because=(
                "the probabilities come from a softmax of a matmul's scores (through scale and mask "
                "steps only) and feed a matmul with the values",
                "scaled_dot_product_attention computes the same attention in tiles, keeping its output "
                "and a per-row logsumexp for backward",
                "it sums in another order: the result is no less accurate, not bit for bit",
            ),
            keeps="reference",
            module=p.module,
            sites=chain_sites,
            note=(
                "the what-if adds SDPA's saved logsumexp "
                f"({format_bytes(sum(_logsumexp_bytes(a.probabilities) for a in attentions))}) and makes "
                "the query, key and value gradients at once and keeps the attention's output until its "
                "backward, as torch's fused CPU kernel does, and drops the copies the eager matmuls made of "
                "q, k, v; other copies (repeat_kv's of grouped-query heads) are kept"
            ),
        )
        if diagnosis is not None:
            results.append(diagnosis)
    return results
