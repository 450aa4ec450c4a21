"""An all-gathered activation that autograd saves for backward (``all-gather-saved-for-backward``).

Tensor- and sequence-parallel code all-gathers an activation shard in forward
(``all_gather_single_autograd``, ``dist.all_gather_into_tensor``, a DTensor redistributed from
``Shard`` to ``Replicate``) and a matmul reads the gathered tensor: autograd saves it, world size times
the shard, from forward through backward (so does a gather under ``no_grad`` whose result a forward
op saves). Megatron-LM's sequence parallelism keeps only the shard and all-gathers again in backward;
in plain PyTorch that is ``torch.utils.checkpoint.checkpoint`` around the gather and the ops that read
it (checkpoint keeps its input, the shard, and reruns the gather when backward needs the gathered
tensor). A DTensor ``Shard(1)`` made ``Replicate`` (sequence parallelism's layout, as
``ColwiseParallel(input_layouts=Shard(1))`` does) gathers into a buffer along dim 0 and concatenates
its chunks along dim 1 at the same line: the concatenation is the gathered tensor.

FSDP2's own all-gathers are not this rule's: their flat buffer is never saved, and the unsharded
parameters copied out of it (``unsharded_parameter``) are ``fsdp-reshard-after-forward``'s.

The what-if follows ``torch.utils.checkpoint`` (non-reentrant, with its default early stop): the
gathered tensor is freed after its last forward read; when backward reaches the node that first reads
it, the gather runs again (the recompute stops once the tensors backward needs are saved again, which
for a gather read by a matmul is the gather itself) and the new gathered tensor lives until the
recorded one was freed. The shard stays alive until then (checkpoint holds it): the gather's input,
or, where that is a copy made at the gather's line for the gather alone (DTensor pads an uneven shard
to the largest), what it was copied from, the copy made again for the recompute. On the CPU,
checkpoint also keeps the generator's state per call from forward until backward and takes it once
more around the recompute (``preserve_rng_state=True``, the default): those are added too.

A gathered tensor alive after backward (the caller keeps it: returned, logged) is not this rule's:
checkpoint cannot free what another reference holds, and re-gathering would add a second copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from memtrim.analysis.categories import Category
from memtrim.analysis.roles import Role
from memtrim.analysis.whatif import Added, Edits
from memtrim.doctor.diagnosis import DIAGNOSES, Diagnosis, finding
from memtrim.doctor.rules.common import dims, lines_text, where
from memtrim.trace.model import Allocation, Fact, Phase, Site
from memtrim.units import format_bytes

if TYPE_CHECKING:
    from memtrim.analysis.analysis import Analysis

MADE_BY_GATHER = frozenset(
    {
        "_c10d_functional.all_gather_into_tensor.default",
        "_c10d_functional.all_gather_into_tensor_coalesced.default",
    }
)
"""Functional all-gathers: the gathered tensor is the op's new output."""
WRITTEN_BY_GATHER = frozenset(
    {"c10d._allgather_base_.default", "c10d.allgather_into_tensor_coalesced_.default"}
)
"""c10d all-gathers into a tensor the caller allocated (``dist.all_gather_into_tensor(out, shard)``)."""
RNG_STATE_BYTES = 5056
"""``torch.get_rng_state()``: the CPU generator's state, which checkpoint keeps per call."""
SMALL = 0.5
"""The shard is at most this share of the gathered tensor (a world of 2 ranks or more)."""
PREPARES = frozenset(
    {"aten.constant_pad_nd.default", "aten.clone.default", "aten._to_copy.default", "aten.cat.default"}
)
"""Copies made of a shard for its all-gather (DTensor pads an uneven shard to the largest; ``.contiguous()``
clones a strided one): checkpoint keeps the tensor copied from, and makes the copy again when it
recomputes."""


@dataclass(frozen=True)
class _Call:
    """One all-gather whose output autograd saved: the gathered tensor, the shard, and the ops."""

    gathered: Allocation
    shard: Allocation
    """What checkpoint keeps: the gather's input, or what it was copied from (:data:`PREPARES`)."""
    copies: tuple[Allocation, ...]
    """Copies made of ``shard`` on the way to the gather, and the buffer gathered into where the
    gathered tensor is its chunks concatenated: made again (and freed) when it recomputes."""
    gather: int
    """The collective's op number."""
    last_forward_read: int
    backward_start: int
    """The first op of the backward node that first reads the gathered tensor (where checkpoint
    recomputes)."""


WAIT = "_c10d_functional.wait_tensor.default"


REARRANGES = frozenset({"aten.cat.default"})
"""An all-gather along another dim than 0 (a DTensor ``Shard(1)`` made ``Replicate``: sequence
parallelism's layout) gathers along dim 0 into a buffer, then concatenates its chunks along that dim:
the gathered tensor is the concatenation, and the buffer is freed after it."""


def _made_by_gather(analysis: Analysis, a: Allocation) -> int | None:
    """The all-gather that made or wrote ``a``, when one did (under fake tensors, ``wait_tensor``
    returns a new tensor: then the all-gather that made what it waited on)."""
    flow, ops = analysis.flow, analysis.flow.ops
    seq = flow.producer[a.id]
    if seq >= 0 and ops[seq].op == WAIT and len(ops[seq].inputs) == 1:
        seq = flow.producer[ops[seq].inputs[0]]
    if seq >= 0 and ops[seq].op in MADE_BY_GATHER:
        return seq
    return next((r for r in flow.readers[a.id] if ops[r].op in WRITTEN_BY_GATHER), None)


def _gather_op(analysis: Analysis, a: Allocation) -> tuple[int, Allocation | None] | None:
    """The all-gather that made ``a``, and the buffer it gathered into where ``a`` is that buffer's
    chunks concatenated along another dim (:data:`REARRANGES`, in the same phase and at the same
    line); None where no all-gather made it."""
    gather = _made_by_gather(analysis, a)
    if gather is not None:
        return gather, None
    flow, ops = analysis.flow, analysis.flow.ops
    seq = flow.producer[a.id]
    if seq < 0 or ops[seq].op not in REARRANGES or len(set(ops[seq].inputs)) != 1:
        return None
    buffer = analysis.allocations[ops[seq].inputs[0]]
    gather = _made_by_gather(analysis, buffer)
    if gather is None or buffer.bytes != a.bytes or ops[gather].site != ops[seq].site:
        return None
    return gather, buffer


def _node_start(analysis: Analysis, seq: int) -> int:
    """The first op of the backward node whose op ``seq`` is (the node's ops run one after another):
    the node unpacks every tensor it saved before its first op runs."""
    ops = analysis.flow.ops
    node = ops[seq].node
    while node is not None and seq > 0 and ops[seq - 1].phase is Phase.BACKWARD and ops[seq - 1].node == node:
        seq -= 1
    return seq


def _source(analysis: Analysis, shard: Allocation, gather: int) -> tuple[Allocation, tuple[Allocation, ...]]:
    """What ``torch.utils.checkpoint`` around the gather would keep of ``shard``: the shard, or, where
    the shard is a copy made in forward, at the gather's line, only for the gather (DTensor's pad, a
    ``.contiguous()``), what it was copied from; and the copies in between."""
    flow, ops = analysis.flow, analysis.flow.ops
    copies: list[Allocation] = []
    reader = gather
    while True:
        seq = flow.producer[shard.id]
        if seq < 0 or ops[seq].op not in PREPARES or ops[seq].phase is not Phase.FORWARD:
            break
        if ops[seq].site != ops[gather].site:
            break  # made by other code (the previous layer's output): what checkpoint is handed
        inputs = [i for i in dict.fromkeys(ops[seq].inputs) if i != shard.id]
        if len(inputs) != 1 or [r for r in flow.readers[shard.id] if r != seq] != [reader]:
            break  # made of several tensors, or read by more than the next step to the gather
        copies.append(shard)
        reader, shard = seq, analysis.allocations[inputs[0]]
    return shard, tuple(copies)


def _call(analysis: Analysis, a: Allocation) -> _Call | None:
    """``a`` as an all-gather's saved output the rule applies to, or None."""
    if a.preexisting or analysis.category(a) is not Category.SAVED or a.id not in analysis.alive_ids_at_peak:
        return None
    if a.free_tick is None or a.free_phase is not Phase.BACKWARD:
        return None  # alive after backward: something besides autograd holds it, which checkpoint cannot free
    if Fact.UNSHARDED_PARAMETER in a.facts or analysis.role(a) is Role.UNSHARDED_PARAMETER:
        return None  # FSDP2's parameters: fsdp-reshard-after-forward's
    found = _gather_op(analysis, a)
    if found is None:
        return None
    gather, buffer = found
    flow, ops = analysis.flow, analysis.flow.ops
    if ops[gather].phase not in (Phase.FORWARD, Phase.OTHER):
        return None  # (OTHER: a gather under no_grad whose result a forward op saves)
    made = set(flow.outputs[gather]) | {a.id} | ({buffer.id} if buffer is not None else set())
    shards = [i for i in dict.fromkeys(ops[gather].inputs) if i not in made]
    if len(shards) != 1:
        return None
    shard = analysis.allocations[shards[0]]
    if shard.device != a.device or shard.bytes > SMALL * a.bytes:
        return None  # not a shard of it (a view into a larger storage keeps that storage alive)
    forward, backward = [], []
    for r in flow.readers[a.id]:
        row = ops[r]
        if row.op.startswith("fsdp."):
            return None  # FSDP2 copies its own all-gathers out
        if r == gather:
            continue
        if row.phase is Phase.BACKWARD:
            backward.append(r)
        elif row.phase is Phase.FORWARD or (row.phase is Phase.OTHER and not backward):
            forward.append(r)  # (no_grad code between forward ops: inside the checkpointed function)
        else:
            return None  # read outside forward and backward: checkpoint would not re-gather for it
    if not backward or all(ops[r].phase is not Phase.FORWARD for r in forward) or backward[0] < forward[-1]:
        return None  # (a forward op reads it: autograd saved it there)
    source, copies = _source(analysis, shard, gather)
    if buffer is not None:
        copies = (*copies, buffer)
    return _Call(a, source, copies, gather, forward[-1], _node_start(analysis, backward[0]))


def _edits(analysis: Analysis, calls: list[_Call]) -> Edits:
    ops = analysis.flow.ops
    free_at: dict[int, float | None] = {}
    added: list[Added] = []
    for call in calls:
        a = call.gathered
        start = ops[call.backward_start].tick
        free_at[a.id] = ops[call.last_forward_read].tick + 0.5
        added.append(Added(a.bytes, start - 0.5, a.free_tick))
        # the recompute copies the shard again for the gather (DTensor's pad) and gathers into the
        # buffer it concatenates: alive until it is done
        added.extend(Added(c.bytes, start - 0.55, start - 0.45) for c in call.copies)
        if a.device == "cpu":
            added.append(Added(RNG_STATE_BYTES, ops[call.gather].tick - 0.5, a.free_tick))
            added.append(Added(RNG_STATE_BYTES, start - 0.6, start - 0.4))
        shard = call.shard
        if shard.free_tick is not None and (a.free_tick is None or shard.free_tick < a.free_tick):
            free_at[shard.id] = a.free_tick  # checkpoint holds its input until its backward is done
    return Edits(free_at=free_at, add=tuple(added))


@DIAGNOSES.register("all-gather-saved-for-backward")
def all_gather_saved_for_backward(analysis: Analysis) -> list[Diagnosis]:
    """All-gathered activations that autograd saves from forward through backward ->
    ``torch.utils.checkpoint.checkpoint`` around the gather and its readers (keep the shard, gather
    again in backward)."""
    by_site: dict[Site | None, list[_Call]] = {}
    for a in analysis.live_at_peak:
        if a.facts and Fact.ALL_GATHER_BUFFER not in a.facts:
            continue  # a parameter, a gradient, ...: what an all-gather writes carries its fact
        call = _call(analysis, a)
        if call is not None:
            by_site.setdefault(analysis.flow.ops[call.gather].site, []).append(call)
    results = []
    ops = analysis.flow.ops
    for site, calls in by_site.items():
        calls.sort(key=lambda c: c.gather)
        first = calls[0]
        gathered, shard = first.gathered, first.shard
        ratio = gathered.bytes // max(1, shard.bytes)
        held = sum(c.gathered.bytes for c in calls)
        readers = [ops[c.last_forward_read].site for c in calls]
        read_lines = lines_text(s for s in readers if s != site)
        diagnosis = finding(
            analysis,
            rule="all-gather-saved-for-backward",
            site=site,
            problem=(
                f"{len(calls)} all-gather call(s) here: autograd saves the gathered {dims(gathered.shape)} "
                f"{gathered.dtype} tensor ({ratio}x its {dims(shard.shape)} shard) from forward through "
                f"backward, {format_bytes(held)} of them alive at the peak"
            ),
            fix=(
                f"torch.utils.checkpoint.checkpoint(fn, shard, use_reentrant=False), fn the all-gather at "
                f"{where(site)}"
                + (f" and the ops that read its result ({read_lines})" if read_lines else "")
                + f": backward keeps the {dims(shard.shape)} shard and all-gathers again (as Megatron-LM's "
                "sequence parallelism does)"
            ),
            allocations=tuple(c.gathered for c in calls),
            edits=_edits(analysis, calls),
            safe_because=(
                f"each tensor is made in forward (or under no_grad there) by an all-gather of a shard "
                f"{ratio}x smaller, read by a forward op that autograd saved it for, and read again only "
                "in backward",
                "each is freed in backward, when autograd lets it go: nothing else (a caller, a log) holds "
                "it, which checkpoint could not free",
                "the shard checkpoint keeps is the gather's input, or what a pad or copy at the gather's "
                "line was made from (that copy is made again when it recomputes)",
                "none is FSDP2's (an unsharded parameter, or a buffer FSDP2 copies out): "
                "fsdp-reshard-after-forward covers those",
                "checkpoint runs the same all-gather on the same shard again: the same values, so results "
                "and gradients are bit for bit equal (every rank must checkpoint the same calls: the "
                "re-gathers in backward are collectives)",
            ),
            keeps="exact",
            module=gathered.module,
            sites=(site, *readers),
            cost=(
                f"one more all-gather per call in backward ({len(calls)} in all, {format_bytes(held)} "
                "gathered)"
            ),
            note=(
                "the what-if frees each gathered tensor after its last forward read and gathers it again "
                "when backward reaches the node that reads it, until it was freed before"
                + (
                    "; so are checkpoint's CPU RNG states (5,056 B per call)"
                    if gathered.device == "cpu"
                    else ""
                )
            ),
        )
        if diagnosis is not None:
            results.append(diagnosis)
    return results
