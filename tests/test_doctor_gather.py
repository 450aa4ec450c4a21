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
from memtrim.analysis.rules.gather import RNG_STATE_BYTES
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
    uneven shard."""
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
        b.op(GATHER, phase=Phase.FORWARD, line=10, inputs=(shard_id,))
        gathered = b.alloc(GATHERED, saved=saved, facts=facts)
        if padded_at is not None:
            b.free(shard_id)
        b.op("_c10d_functional.wait_tensor.default", line=11, inputs=(gathered,))
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
    return [d for d in analyze(b.build()).diagnoses if d.rule == RULE]


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
    rules = [d.rule for d in trace.diagnoses]
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
