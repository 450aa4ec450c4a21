"""``fsdp-reshard-after-forward`` on hand-built traces: when it fires, when it stays silent, and its
what-if peak worked out by hand (the 2-rank gloo runs are in tests/test_distributed_ranks.py)."""

from __future__ import annotations

from builder import TraceBuilder

from memtrim.analysis import analyze
from memtrim.doctor import diagnoses
from memtrim.trace.model import Fact, Phase

UNSHARDED, GATHER, ACT, TMP, ROOT = 1000, 1000, 100, 1500, 1000


def _fsdp_step(
    *, kept: bool = True, read_again: bool = False, root: bool = False, loss: int = 0, floor: int = 0
) -> TraceBuilder:
    """Three FSDP2 modules M.a, M.b, M.c run in turn. Each all-gathers (a GATHER-byte flat buffer,
    copied out into UNSHARDED bytes of parameters, then freed), runs an addmm, and, ``kept``, keeps
    the unsharded parameters until its backward (a TMP-byte temporary each) is done. ``root``: FSDP2's
    root M has parameters of its own (ROOT bytes, gathered before M.a's and kept by default), read
    first in forward and last in backward, and computes the loss inside its forward: its backward
    starts as its forward ends. ``loss``: a temporary of that many bytes at the end of forward;
    ``floor``: one at the end of backward, after every module's backward."""
    b = TraceBuilder()
    unsharded, acts = {}, []
    if root:
        b.op("c10d._allgather_base_.default", phase=Phase.OTHER, module="M")
        gather = b.alloc(ROOT, facts=[Fact.ALL_GATHER_BUFFER])
        b.op("UntypedStorage.resize_", phase=Phase.OTHER, module="M")
        unsharded["root"] = b.alloc(ROOT, facts=[Fact.UNSHARDED_PARAMETER])
        b.free(gather)
        b.op("aten.embedding.default", phase=Phase.FORWARD, module="M", inputs=(unsharded["root"],))
        acts.append(b.alloc(ACT, saved=True))
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
    if loss:
        b.free(b.alloc(loss))
    if root:  # autograd's first op (the loss gradient) runs in no module
        b.op("aten.ones_like.default", phase=Phase.BACKWARD, module=None)
        b.alloc(4)
    for name in "cba":
        b.op("aten.mm.default", phase=Phase.BACKWARD, module=f"M.{name}", inputs=(unsharded[name],))
        b.free(b.alloc(TMP))
        if kept:
            b.free(unsharded[name])
    if root:
        b.op(
            "aten.embedding_dense_backward.default",
            phase=Phase.BACKWARD,
            module="M",
            inputs=(unsharded["root"],),
        )
        b.free(b.alloc(ACT))
        b.free(unsharded["root"])
    if floor:
        b.op("c10d._reduce_scatter_base_.default", phase=Phase.BACKWARD, module=None)
        b.free(b.alloc(floor))
    return b


def _findings(b: TraceBuilder) -> list:
    return [d for d in diagnoses(analyze(b.build())) if d.rule == "fsdp-reshard-after-forward"]


def test_kept_unsharded_parameters_are_diagnosed_with_fsdp2s_schedule() -> None:
    (finding,) = _findings(_fsdp_step())
    # recorded peak: M.c's backward temporary with all three modules' parameters alive
    acts = 3 * ACT + 4
    assert finding.peak_before == 3 * UNSHARDED + acts + TMP
    # resharded: M.a's and M.b's parameters freed after their forwards; at M.c's backward, M.c's
    # own re-gathered parameters and the prefetched all-gather buffer of M.b
    assert finding.peak_after == UNSHARDED + GATHER + acts + TMP
    # and so M.a alone is named: M.b's prefetched buffer is as large as its parameters, and M.c's own
    # backward is the peak, so resharding either would cost an all-gather and lower nothing
    assert finding.bytes_at_stake == UNSHARDED
    assert {a.module for a in finding.allocations} == {"M.a"}
    assert finding.module == "M.a"
    assert "fully_shard(model.a, reshard_after_forward=True) (FSDP2's default" in finding.fix
    assert finding.cost is not None and "1 in all" in finding.cost


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


def test_the_root_is_not_named_where_its_backward_starts_as_its_forward_ends() -> None:
    # FSDP2's root keeps its parameters by default; with the loss inside the model its backward starts
    # at the next op, so resharding it would free them for no op and gather them again at once (its
    # re-gather beside M.c's would even raise the peak): the root is not named, M.a is
    (finding,) = _findings(_fsdp_step(root=True))
    acts = 4 * ACT + 4 + 4
    assert finding.peak_before == 3 * UNSHARDED + ROOT + acts + TMP
    assert finding.peak_after == UNSHARDED + GATHER + ROOT + acts + TMP
    assert {a.module for a in finding.allocations} == {"M.a"}
    assert finding.bytes_at_stake == UNSHARDED


def test_only_the_modules_the_what_if_peak_needs_are_named() -> None:
    # the peak is the loss at the end of forward (every module's parameters alive); resharding M.a and
    # M.b brings it under the floor, the reduce-scatter at the end of backward, where no unsharded
    # parameter is alive: resharding M.c as well would cost an all-gather and lower nothing
    loss, floor = 5 * UNSHARDED, 6 * UNSHARDED + UNSHARDED // 2
    (finding,) = _findings(_fsdp_step(loss=loss, floor=floor))
    acts = 3 * ACT + 4
    assert finding.peak_before == 3 * UNSHARDED + acts + loss
    assert finding.peak_after == acts + floor
    assert {a.module for a in finding.allocations} == {"M.a", "M.b"}
    assert finding.bytes_at_stake == 2 * UNSHARDED
    assert "for each of model.a, model.b (" in finding.fix
    assert finding.cost is not None and "2 in all" in finding.cost
    assert any("lowers the what-if peak" in reason for reason in finding.safe_because)
