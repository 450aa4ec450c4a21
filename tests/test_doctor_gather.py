"""``all-gather-saved-for-backward`` on hand-built traces: when it fires, when it stays silent, and its
what-if peak worked out by hand (the 2-rank gloo runs are in tests/test_distributed_ranks.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from builder import TraceBuilder
from test_doctor_fsdp import _fsdp_step

import memtrim
from memtrim.analysis import analyze
from memtrim.doctor import diagnoses
from memtrim.doctor.rules.gather import RNG_STATE_BYTES
from memtrim.trace.model import Fact, Phase

RULE = "all-gather-saved-for-backward"
SHARD, GATHERED, OUT, ACT, GRAD_W, SOURCE = 50_000, 100_000, 10_000, 150_000, 20_000, 30_000
GATHER = "_c10d_functional.all_gather_into_tensor.default"


def _sequence_parallel(
    *,
    saved: bool = True,
    c10d: bool = False,
    fsdp: bool = False,
    act: int = ACT,
    shard: int = SHARD,
    freed: Phase | None = Phase.BACKWARD,
    padded_at: int | None = None,
    concatenated_at: int | None = None,
    gathered_in: Phase = Phase.FORWARD,
) -> TraceBuilder:
    """One sequence-parallel layer on a CPU rank: an all-gather of a SHARD-byte shard (line 10) into a
    GATHERED-byte tensor, ``saved`` for backward, read by a matmul (line 11, an OUT-byte result), then an
    ACT-byte activation saved by a relu (line 12). Backward: the relu's node, then the matmul's (its
    first op reads the weight only; the second makes the gathered tensor's gradient; the third reads
    the gathered tensor and makes the weight's gradient, kept), after which the gathered tensor is
    freed. ``c10d``: ``dist.all_gather_into_tensor(out, shard)`` into a tensor made by ``empty``;
    ``fsdp``: the gathered tensor is an FSDP2 unsharded parameter; ``freed``: the phase the gathered
    tensor is freed in (None: alive at the end); ``padded_at``: the shard is a pad (made at that line)
    of a SOURCE-byte tensor made in forward at line 8 and freed right after the pad, as DTensor pads an
    uneven shard; ``concatenated_at``: the all-gather writes a buffer whose chunks a ``cat`` at that
    line concatenates into the gathered tensor (a DTensor ``Shard(1)`` made ``Replicate``), the buffer
    freed after it; ``gathered_in``: the phase the all-gather runs in (``other``: under no_grad)."""
    b = TraceBuilder()
    weight = b.alloc(4_000, preexisting=True, facts=[Fact.PARAMETER])
    if padded_at is None:
        shard_id = b.alloc(shard, preexisting=True)
    else:
        b.op("aten.relu.default", phase=Phase.FORWARD, line=8)
        source = b.alloc(SOURCE)
        b.op("aten.constant_pad_nd.default", line=padded_at, inputs=(source,))
        shard_id = b.alloc(shard)
        b.free(source)
    facts = [Fact.UNSHARDED_PARAMETER] if fsdp else [Fact.ALL_GATHER_BUFFER]
    if c10d:
        b.op("aten.empty.memory_format", phase=Phase.FORWARD, line=9)
        gathered = b.alloc(GATHERED, saved=saved, facts=facts)
        b.op("c10d._allgather_base_.default", line=10, inputs=(gathered, shard_id))
    else:
        b.op(GATHER, phase=gathered_in, line=10, inputs=(shard_id,))
        gathered = b.alloc(GATHERED, saved=saved and concatenated_at is None, facts=facts)
        if padded_at is not None:
            b.free(shard_id)
        b.op("_c10d_functional.wait_tensor.default", phase=Phase.FORWARD, line=11, inputs=(gathered,))
        if concatenated_at is not None:
            buffer = gathered
            b.op("aten.cat.default", line=concatenated_at, inputs=(buffer, buffer))
            gathered = b.alloc(GATHERED, saved=saved)
            b.free(buffer)
    b.op("aten.mm.default", line=11, inputs=(weight, gathered))
    out = b.alloc(OUT)
    b.op("aten.relu.default", line=12, inputs=(out,))
    activation = b.alloc(act, saved=True)
    b.free(out)
    b.op(
        "aten.threshold_backward.default",
        phase=Phase.BACKWARD,
        line=12,
        node="ReluBackward0",
        inputs=(activation,),
    )
    grad = b.alloc(OUT)
    b.free(activation)
    b.op("aten.t.default", line=11, node="MmBackward0", inputs=(weight,))
    b.op("aten.mm.default", line=11, node="MmBackward0", inputs=(grad, weight))
    grad_gathered = b.alloc(GATHERED)
    b.op("aten.mm.default", line=11, node="MmBackward0", inputs=(gathered, grad))
    b.alloc(GRAD_W)
    if freed is Phase.BACKWARD:
        b.free(gathered)
    b.free(grad, grad_gathered)
    if freed is not None and freed is not Phase.BACKWARD:
        b.op("aten.zero_.default", phase=freed, line=13)  # (not reading it: dropped there)
        b.free(gathered)
    return b


def _findings(b: TraceBuilder) -> list:
    return [d for d in diagnoses(analyze(b.build())) if d.rule == RULE]


def test_a_saved_gathered_tensor_is_diagnosed_with_checkpoints_schedule() -> None:
    (finding,) = _findings(_sequence_parallel())
    # recorded peak: the end of forward (gathered, matmul result, relu's activation)
    assert finding.peak_before == GATHERED + OUT + ACT
    # checkpointed: the gathered tensor freed after the matmul (forward peak OUT + ACT, plus the RNG
    # state checkpoint keeps); in backward the gather runs again before the matmul's node: gathered,
    # the relu's gradient, both RNG states, then the gathered tensor's gradient (RNG transient gone)
    backward = GATHERED + OUT + RNG_STATE_BYTES + GATHERED
    assert backward > OUT + ACT + RNG_STATE_BYTES
    assert finding.peak_after == backward + GRAD_W
    assert [a.bytes for a in finding.allocations] == [GATHERED]
    assert finding.site is not None and finding.site.line == 10
    assert "checkpoint(fn, shard, use_reentrant=False)" in finding.fix and "prog.py:10" in finding.fix
    assert "prog.py:11" in finding.fix  # the matmul that reads it
    assert finding.cost == "one more all-gather per call in backward (1 in all, 97.7 KiB gathered)"
    assert finding.verify_mode == "exact"
    assert "2x its" in finding.problem


def test_a_c10d_all_gather_into_a_tensor_is_diagnosed_at_the_collectives_line() -> None:
    (finding,) = _findings(_sequence_parallel(c10d=True))
    assert finding.site is not None and finding.site.line == 10
    assert finding.peak_after == 2 * GATHERED + OUT + RNG_STATE_BYTES + GRAD_W


def test_silent_when_the_gathered_tensor_is_not_saved() -> None:
    assert _findings(_sequence_parallel(saved=False)) == []


def test_silent_on_fsdp2s_unsharded_parameters() -> None:
    # saved by the matmul, made by an all-gather, but FSDP2's: fsdp-reshard-after-forward's bytes
    assert _findings(_sequence_parallel(fsdp=True)) == []
    trace = analyze(_fsdp_step().build())
    rules = [d.rule for d in diagnoses(trace)]
    assert "fsdp-reshard-after-forward" in rules and RULE not in rules


@pytest.mark.parametrize("freed", [None, Phase.OPTIMIZER, Phase.OTHER])
def test_silent_when_the_gathered_tensor_outlives_backward(freed: Phase | None) -> None:
    # kept by the caller (returned, logged) past backward: checkpoint cannot free what the caller
    # holds (measured on 2 gloo ranks, bench/doctor_tp.py: checkpointing it raised the peak)
    assert _findings(_sequence_parallel(freed=freed)) == []


def test_a_shard_padded_for_the_gather_keeps_what_it_was_padded_from() -> None:
    # DTensor pads an uneven shard at the gather's line: checkpoint keeps its input (the unpadded
    # SOURCE, freed after the pad as recorded) until backward, and pads again when it recomputes
    (finding,) = _findings(_sequence_parallel(padded_at=10, act=2 * ACT))
    assert finding.peak_before == GATHERED + OUT + 2 * ACT
    # the end of forward, the gathered tensor freed: the source is kept (not the pad) with the RNG state
    assert finding.peak_after == OUT + 2 * ACT + RNG_STATE_BYTES + SOURCE
    assert "[7500] shard" in finding.problem  # the tensor checkpoint is handed (SOURCE bytes)


def test_a_copy_made_at_another_line_is_the_shard() -> None:
    # made by other code (a previous layer's output copied at line 9): that copy is what checkpoint
    # is handed and keeps, not what it was copied from
    (finding,) = _findings(_sequence_parallel(padded_at=9, act=2 * ACT))
    assert finding.peak_after == OUT + 2 * ACT + RNG_STATE_BYTES + SHARD
    assert "[12500] shard" in finding.problem


def test_a_gather_along_another_dim_is_its_buffers_chunks_concatenated() -> None:
    # DTensor's Shard(1) -> Replicate: all-gather into a buffer along dim 0, cat its chunks along dim 1
    # at the same line; autograd saves the cat's result, and the recompute makes the buffer again
    (finding,) = _findings(_sequence_parallel(concatenated_at=10))
    (cat,) = finding.allocations
    assert cat.op == "aten.cat.default" and cat.bytes == GATHERED
    assert finding.site is not None and finding.site.line == 10
    assert finding.peak_after == 2 * GATHERED + OUT + RNG_STATE_BYTES + GRAD_W
    # the buffer, made again for the recompute's cat, alive while the new gathered tensor is made
    transients = [
        a for a in finding.edits.add if a.free_tick is not None and a.free_tick - a.alloc_tick < 0.25
    ]
    assert [a.bytes for a in transients] == [GATHERED, RNG_STATE_BYTES]


def test_silent_on_a_cat_of_a_gather_at_another_line() -> None:
    # the user's own cat of what was gathered: not the all-gather's result
    assert _findings(_sequence_parallel(concatenated_at=12)) == []


def test_a_gather_under_no_grad_whose_result_a_forward_op_saves_is_diagnosed() -> None:
    # with torch.no_grad(): full = all_gather(x); then w @ full saves it: checkpoint around both frees
    # it (measured on 2 gloo ranks, bench/doctor_tp.py no_grad_gather: the predicted peak, to the byte)
    (finding,) = _findings(_sequence_parallel(gathered_in=Phase.OTHER))
    assert finding.peak_after == 2 * GATHERED + OUT + RNG_STATE_BYTES + GRAD_W


def test_silent_when_no_forward_op_reads_it() -> None:
    # made and read under no_grad only (and in backward): not saved by a forward op
    b = TraceBuilder()
    shard = b.alloc(SHARD, preexisting=True)
    b.op(GATHER, phase=Phase.OTHER, line=10, inputs=(shard,))
    gathered = b.alloc(GATHERED, saved=True, facts=[Fact.ALL_GATHER_BUFFER])
    b.op("aten.relu.default", line=11, inputs=(gathered,))
    b.alloc(ACT)
    b.op("aten.mm.default", phase=Phase.BACKWARD, line=11, node="MmBackward0", inputs=(gathered,))
    b.free(gathered)
    assert _findings(b) == []


def test_silent_when_the_input_is_not_a_shard_of_it() -> None:
    # an "all-gather" whose input is as large as its output gathers nothing worth re-gathering
    assert _findings(_sequence_parallel(shard=GATHERED)) == []


def test_silent_when_regathering_would_not_lower_the_peak() -> None:
    # a small activation: the recorded peak is in backward, where the gathered tensor is needed
    assert _findings(_sequence_parallel(act=1_000)) == []


TOKENS, DIM, LAYERS, WORLD = 64, 512, 3, 2


def _dtensor_layer(h: Any, mixing: torch.Tensor, mesh: Any) -> Any:
    """A sequence-parallel token-mixing layer written with DTensor: the ``Shard(0)`` activation
    redistributed to ``Replicate`` (an all-gather), mixed into this rank's rows."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    full = h.redistribute(mesh, [Replicate()]).to_local()  # DTENSOR_GATHER_LINE
    return DTensor.from_local(mixing @ full, mesh, [Shard(0)])


def _dtensor_step(checkpointed: bool) -> memtrim.Trace:
    """LAYERS of :func:`_dtensor_layer` and a loss, forward and backward, on rank 0 of a fake world of
    WORLD ranks with fake tensors (``checkpointed``: each layer in ``torch.utils.checkpoint``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.utils.checkpoint import checkpoint

    with memtrim.fake_world(WORLD):
        mesh = init_device_mesh("cpu", (WORLD,))
        with memtrim.track(fake=True) as trace:
            mixing = [torch.nn.Parameter(torch.randn(TOKENS // WORLD, TOKENS)) for _ in range(LAYERS)]
            h = DTensor.from_local(torch.randn(TOKENS // WORLD, DIM), mesh, [Shard(0)])
            for w in mixing:
                if checkpointed:
                    h = checkpoint(_dtensor_layer, h, w, mesh, use_reentrant=False)
                else:
                    h = _dtensor_layer(h, w, mesh)
            h.to_local().pow(2).sum().backward()
    return trace


@pytest.mark.skipif(not dist.is_available(), reason="this torch has no torch.distributed")
def test_a_dtensor_redistributed_to_replicate_is_diagnosed_and_the_fix_predicted() -> None:
    # Shard(0) -> Replicate issues _c10d_functional.all_gather_into_tensor under the recorder; under
    # fake tensors its wait_tensor returns a new tensor, which the matmul saves
    before = _dtensor_step(checkpointed=False)
    (finding,) = [d for d in before.diagnoses() if d.rule == RULE]
    line = next(
        i
        for i, text in enumerate(Path(__file__).read_text().splitlines(), 1)
        if text.endswith("# DTENSOR_GATHER_LINE")
    )
    assert finding.site is not None and finding.site.line == line
    assert finding.bytes_at_stake == LAYERS * TOKENS * DIM * 4
    after = _dtensor_step(checkpointed=True)
    assert [d for d in after.diagnoses() if d.rule == RULE] == []
    # the same program checkpointed, as fake tensors measure it: the peak the what-if predicted
    assert finding.peak_before == before.peak_bytes > after.peak_bytes == finding.peak_after


class _SpBlock(torch.nn.Module):
    """A sequence-parallel MLP block for ``parallelize_module``: RMSNorm (``SequenceParallel``), up
    (``ColwiseParallel`` from ``Shard(1)``: its input hook all-gathers the tokens), relu, down
    (``RowwiseParallel`` to ``Shard(1)``), residual."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.norm = torch.nn.RMSNorm(SP_DIM)
        self.up = torch.nn.Linear(SP_DIM, SP_HIDDEN, bias=False)
        self.down = torch.nn.Linear(SP_HIDDEN, SP_DIM, bias=False)
        self.checkpointed = checkpointed

    def forward(self, x: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        h = self.norm(x)
        up = checkpoint(self.up, h, use_reentrant=False) if self.checkpointed else self.up(h)  # SP_UP_LINE
        return x + self.down(torch.relu(up))


SP_BATCH, SP_TOKENS, SP_DIM, SP_HIDDEN = 2, 256, 256, 128


def _parallelized_step(checkpointed: bool) -> memtrim.Trace:
    """LAYERS of :class:`_SpBlock` sequence-parallelized with ``parallelize_module``, forward and
    backward, on rank 0 of a fake world of WORLD ranks with fake tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    with memtrim.fake_world(WORLD):
        mesh = init_device_mesh("cpu", (WORLD,))
        blocks = torch.nn.Sequential(*(_SpBlock(checkpointed) for _ in range(LAYERS)))
        plan = {
            "norm": SequenceParallel(),
            "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        }
        for block in blocks:
            parallelize_module(block, mesh, plan)  # type: ignore[arg-type]
        with memtrim.track(fake=True) as trace:
            x = DTensor.from_local(torch.randn(SP_BATCH, SP_TOKENS // WORLD, SP_DIM), mesh, [Shard(1)])
            blocks(x).to_local().pow(2).sum().backward()
    return trace


@pytest.mark.skipif(not dist.is_available(), reason="this torch has no torch.distributed")
def test_parallelize_modules_sequence_parallel_gather_is_diagnosed() -> None:
    # ColwiseParallel(input_layouts=Shard(1)) all-gathers the tokens along dim 1 (a buffer along dim
    # 0, its chunks concatenated); the DTensor matmul saves the DTensor, whose local tensor the
    # recorder marks saved when the next DTensor op is handed it
    before = _parallelized_step(checkpointed=False)
    (finding,) = [d for d in before.diagnoses() if d.rule == RULE]
    line = next(
        i
        for i, text in enumerate(Path(__file__).read_text().splitlines(), 1)
        if text.endswith("# SP_UP_LINE")
    )
    assert finding.site is not None and finding.site.line == line
    gathered = SP_BATCH * SP_TOKENS * SP_DIM * 4
    assert [a.bytes for a in finding.allocations] == [gathered] * LAYERS
    assert {a.op for a in finding.allocations} == {"aten.cat.default"}
    after = _parallelized_step(checkpointed=True)
    assert [d for d in after.diagnoses() if d.rule == RULE] == []
    # fake tensors measure the checkpointed run within 10% of the predicted drop here (8.5%); on 2
    # gloo ranks the profiler measures it to the byte (bench/doctor_tp.py, dtensor_sp_mlp)
    assert finding.peak_before == before.peak_bytes
    measured, predicted = before.peak_bytes - after.peak_bytes, finding.peak_before - finding.peak_after
    assert abs(predicted - measured) <= 0.1 * measured
