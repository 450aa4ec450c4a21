"""``fsdp-reshard-after-forward`` on hand-built traces: when it fires, when it stays silent, and its
what-if peak worked out by hand (the 2-rank gloo runs are in tests/test_distributed_ranks.py)."""

from __future__ import annotations

from builder import TraceBuilder

from memtrim.analysis import analyze
from memtrim.trace.model import Fact, Phase

UNSHARDED, GATHER, ACT, TMP = 1000, 1000, 100, 1500


def _fsdp_step(*, kept: bool = True, read_again: bool = False) -> TraceBuilder:
    """Three FSDP2 modules M.a, M.b, M.c run in turn. Each all-gathers (a GATHER-byte flat buffer,
    copied out into UNSHARDED bytes of parameters, then freed), runs an addmm, and, ``kept``, keeps
    the unsharded parameters until its backward (a TMP-byte temporary each) is done."""
    b = TraceBuilder()
    unsharded, acts = {}, []
    for name in "abc":
        module = f"M.{name}"
        b.op("c10d._allgather_base_.default", phase=Phase.OTHER, module=module)
        gather = b.alloc(GATHER, facts=[Fact.ALL_GATHER_BUFFER])
        b.op("UntypedStorage.resize_", phase=Phase.OTHER, module=module)
        unsharded[name] = b.alloc(UNSHARDED, facts=[Fact.UNSHARDED_PARAMETER])
        b.free(gather)
        b.op("aten.addmm.default", phase=Phase.FORWARD, module=module, inputs=(unsharded[name],))
        acts.append(b.alloc(ACT, saved=True))
        if not kept:
            b.free(unsharded[name])
    if read_again:  # M.a called a second time after the others
        b.op("aten.addmm.default", phase=Phase.FORWARD, module="M", inputs=(unsharded["a"],))
    b.op("aten.sum.default", phase=Phase.FORWARD, module="M")
    b.alloc(4)
    for name in "cba":
        b.op("aten.mm.default", phase=Phase.BACKWARD, module=f"M.{name}", inputs=(unsharded[name],))
        b.free(b.alloc(TMP))
        if kept:
            b.free(unsharded[name])
    return b


def _findings(b: TraceBuilder) -> list:
    return [d for d in analyze(b.build()).diagnoses if d.rule == "fsdp-reshard-after-forward"]


def test_kept_unsharded_parameters_are_diagnosed_with_fsdp2s_schedule() -> None:
    (finding,) = _findings(_fsdp_step())
    # recorded peak: M.c's backward temporary with all three modules' parameters alive
    acts = 3 * ACT + 4
    assert finding.peak_before == 3 * UNSHARDED + acts + TMP
    # resharded: M.a's and M.b's parameters freed after their forwards; at M.c's backward, M.c's
    # own re-gathered parameters and the prefetched all-gather buffer of M.b
    assert finding.peak_after == UNSHARDED + GATHER + acts + TMP
    assert finding.bytes_at_stake == 3 * UNSHARDED
    assert finding.module == "M.a"
    assert (
        "fully_shard(model.a, reshard_after_forward=True) for each of model.a, model.b, model.c"
        in finding.fix
    )
    assert finding.cost is not None and "3 in all" in finding.cost


def test_silent_when_modules_reshard_after_forward() -> None:
    assert _findings(_fsdp_step(kept=False)) == []


def test_silent_when_a_module_is_called_again_in_forward() -> None:
    # M.a's parameters are read after its forward (FSDP2 would all-gather them again there): M.a is
    # left out, and M.b and M.c alone save nothing at M.c's backward (M.b's prefetch buffer replaces
    # M.b's parameters, M.a's stay)
    assert _findings(_fsdp_step(read_again=True)) == []


def test_silent_when_resharding_would_not_lower_the_peak() -> None:
    # the forward's all-gathers peak highest: nothing kept into backward is alive then
    b = _fsdp_step()
    b.op("aten.empty.memory_format", phase=Phase.OTHER)
    b.free(b.alloc(10 * TMP))
    assert _findings(b) == []
