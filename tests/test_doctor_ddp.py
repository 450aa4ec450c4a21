"""``ddp-gradient-as-bucket-view`` on hand-built traces: when it fires, when it stays silent, and its
what-if peak worked out by hand (the 2-rank gloo runs are in tests/test_distributed_ranks.py)."""

from __future__ import annotations

from builder import TraceBuilder

from memtrim.analysis import analyze
from memtrim.doctor import diagnoses
from memtrim.trace.model import Fact, Phase
from memtrim.units import format_bytes

GRAD, TMP = 1000, 1500
LAYERS = 3
RULE = "ddp-gradient-as-bucket-view"


def _ddp_step(
    *,
    view: bool = False,
    bucket: bool = True,
    preexisting_grads: bool = False,
    read_before_copy_back: bool = False,
    copy_back: bool = True,
    accumulate_after: bool = False,
    step_tmp: int = TMP,
    later_tmp: int = 0,
    rounds: int = 1,
    hook: bool = False,
    between: str | None = None,
    cloned: bool = False,
) -> TraceBuilder:
    """DDP's backward as the reducer runs it: LAYERS gradients of GRAD bytes each made in backward
    (``.grad``), each copied into the flat bucket (``mul.out``, from before the region), the bucket
    all-reduced and copied back into each gradient; then an optimizer step's ``step_tmp``-byte temporary
    reading them, and the gradients freed (``zero_grad()``).

    ``view``: gradient_as_bucket_view=True (each gradient freed right after its copy, no copy back);
    ``bucket``: the flat tensor is a DDP gradient bucket (False: no all-reduce told the recorder so);
    ``preexisting_grads``: the gradients are from before the region (``zero_grad(set_to_none=False)``)
    and accumulated into in place; ``read_before_copy_back``: an op reads a gradient between its copy
    in and the copy back; ``copy_back``: the reducer copies the bucket back into the gradients;
    ``accumulate_after``: a gradient is written in place after the copy back; ``later_tmp``: a
    temporary of that size made after the step (a peak elsewhere); ``rounds``: backwards before the
    step (gradient accumulation without ``no_sync()``: autograd accumulates each later gradient into
    ``.grad`` with ``add_`` and the reducer copies it in and back again); ``hook``: a communication
    hook is registered (the reducer copies in with ``copy_``, unscaled); ``between``: an op of that
    name writes the bucket between two backwards; ``cloned``: one more gradient, of a parameter this
    rank did not use, that the reducer makes after the all-reduce as a copy of its bucket view
    (``new_empty_strided`` + ``copy_``)."""
    b = TraceBuilder()
    b.op("aten.empty.memory_format", phase=Phase.OTHER)
    flat = b.alloc(LAYERS * GRAD, preexisting=True, facts=[Fact.GRADIENT_BUCKET] if bucket else [])
    old = [b.alloc(GRAD, preexisting=True, facts=[Fact.GRADIENT]) for _ in range(LAYERS)]
    b.op("aten.relu.default", phase=Phase.FORWARD, line=10, module="DistributedDataParallel.module")
    act = b.alloc(100, saved=True)
    grads = []
    for i in range(LAYERS):
        module = f"DistributedDataParallel.module.layers.{i}"
        b.op("aten.mm.default", phase=Phase.BACKWARD, line=10, module=module, inputs=(act,))
        if preexisting_grads:
            fresh = b.alloc(GRAD)
            b.op("aten.add_.Tensor", line=20, inputs=(old[i], fresh))
            b.free(fresh)
            g = old[i]
        else:
            g = b.alloc(GRAD, facts=[Fact.GRADIENT])
        grads.append(g)
        _copy_in(b, g, flat, hook)
        if view:
            b.free(g)
        elif read_before_copy_back and i == 0:
            b.op("aten.abs.default", line=20, inputs=(g,))
            b.free(b.alloc(GRAD))
    b.op("c10d.allreduce_.default", line=20, inputs=(flat,))
    b.free(act)
    if copy_back and not view:
        for g in grads:
            b.op("aten.copy_.default", line=20, inputs=(g, flat))
    if cloned:
        b.op("aten.new_empty_strided.default", line=20, inputs=(flat,))
        extra = b.alloc(GRAD, facts=[Fact.GRADIENT])
        b.op("aten.copy_.default", line=20, inputs=(extra, flat))
        grads.append(extra)
    for _ in range(rounds - 1):  # the next micro-batch's backward
        if between is not None:
            b.op(between, phase=Phase.BACKWARD, line=20, inputs=(flat,))
        for g in grads:
            b.op("aten.mm.default", phase=Phase.BACKWARD, line=10)
            fresh = b.alloc(GRAD)
            b.op("aten.add_.Tensor", line=20, inputs=(g, fresh))
            b.free(fresh)
            if view:
                b.op("aten.div_.Scalar", line=20, inputs=(flat,))
            else:
                _copy_in(b, g, flat, hook)
        b.op("c10d.allreduce_.default", line=20, inputs=(flat,))
        if not view:
            for g in grads:
                b.op("aten.copy_.default", line=20, inputs=(g, flat))
    if accumulate_after and not view:
        b.op("aten.mul_.Tensor", line=21, inputs=(grads[0],))
    b.op("aten.sqrt.default", phase=Phase.OPTIMIZER, line=30, inputs=(flat,) if view else tuple(grads))
    b.free(b.alloc(step_tmp))
    if not view and not preexisting_grads:
        b.op("aten.zero_.default", line=31)
        b.free(*grads)
    if later_tmp:
        b.op("aten.empty.memory_format", phase=Phase.OTHER, line=40)
        b.free(b.alloc(later_tmp))
    return b


def _copy_in(b: TraceBuilder, g: int, flat: int, hook: bool) -> None:
    """The reducer's copy of gradient ``g`` into its bucket view: ``bucket_view.copy_(grad)`` under a
    communication hook, else ``mul.out(grad, 1 / world, out=bucket_view)``."""
    if hook:
        b.op("aten.copy_.default", line=20, inputs=(flat, g))
    else:
        b.op("aten.mul.out", line=20, inputs=(g, flat))


def _findings(b: TraceBuilder, world: int | None = None) -> list:
    metadata = {} if world is None else {"distributed": {"rank": 0, "world_size": world, "backend": "gloo"}}
    return [d for d in diagnoses(analyze(b.build(metadata=metadata))) if d.rule == RULE]


def test_gradients_kept_beside_their_bucket_copy_are_diagnosed() -> None:
    (finding,) = _findings(_ddp_step())
    # recorded peak: the step's temporary with every gradient alive
    assert finding.peak_before == LAYERS * GRAD + TMP
    # as bucket views each gradient is freed after its copy: the step's temporary alone is left
    assert finding.peak_after == TMP
    assert finding.bytes_at_stake == LAYERS * GRAD
    assert finding.site is not None and finding.site.line == 20  # the reducer's copy: backward()'s line
    assert finding.module == "DistributedDataParallel"
    assert finding.fix.startswith("DistributedDataParallel(model, gradient_as_bucket_view=True)")
    assert finding.verify_mode == "exact"
    assert "3 gradients" in finding.problem and "bucket" in finding.problem
    assert finding.note is not None and "detach_()" in finding.note and "layout" in finding.note
    assert len(finding.safe_because) == 2


def test_the_what_if_frees_each_gradient_right_after_its_copy() -> None:
    # a small step: backward peaks, at the last copy (every gradient and the 100-byte activation);
    # as bucket views each gradient lives from its making to its copy, one at a time
    b = _ddp_step(step_tmp=10)
    (finding,) = _findings(b)
    analysis = analyze(b.build())
    freed = {analysis.flow.op_at(tick) for tick in finding.edits.free_at.values() if tick is not None}
    assert {analysis.flow.names[seq] for seq in freed} == {"mul"}
    assert finding.peak_before == LAYERS * GRAD + 100
    assert finding.peak_after == GRAD + 100


def test_silent_when_gradients_are_bucket_views() -> None:
    # gradient_as_bucket_view=True: each gradient is freed right after its copy into the bucket
    assert _findings(_ddp_step(view=True)) == []


def test_silent_without_a_gradient_bucket() -> None:
    # the same copies into a flat tensor that no all-reduce in backward marked as DDP's bucket
    assert _findings(_ddp_step(bucket=False)) == []


def test_silent_when_the_gradients_are_from_before_the_region() -> None:
    # zero_grad(set_to_none=False): the gradients are memory the region starts with
    assert _findings(_ddp_step(preexisting_grads=True)) == []


def test_silent_when_a_gradient_is_read_before_the_copy_back() -> None:
    # as a bucket view it would hold the scaled, then all-reduced, values there: gradient 0 is left out
    (finding,) = _findings(_ddp_step(read_before_copy_back=True, step_tmp=10 * GRAD))
    assert finding.bytes_at_stake == (LAYERS - 1) * GRAD


def test_silent_without_the_copy_back() -> None:
    # without the reducer's copy back the gradient's values are not the bucket's
    assert _findings(_ddp_step(copy_back=False)) == []


def test_a_gradient_written_after_the_copy_back_is_left_out() -> None:
    (finding,) = _findings(_ddp_step(accumulate_after=True, step_tmp=10 * GRAD))
    assert finding.bytes_at_stake == (LAYERS - 1) * GRAD


def test_silent_when_the_fix_would_not_lower_the_peak() -> None:
    # a temporary after the step peaks higher than anything alive with the gradients
    assert _findings(_ddp_step(later_tmp=100 * GRAD)) == []


def test_gradient_accumulation_without_no_sync_is_diagnosed_at_a_power_of_2_world() -> None:
    # two backwards: each gradient copied in and back in each, accumulated into in between; as bucket
    # views the gradients are gone from the first copy on (the optimizer step's temporary alone)
    (finding,) = _findings(_ddp_step(rounds=2), world=2)
    assert finding.peak_before == LAYERS * GRAD + TMP
    assert finding.peak_after == TMP
    assert finding.bytes_at_stake == LAYERS * GRAD
    assert any("power of 2" in reason for reason in finding.safe_because)


def test_gradient_accumulation_is_silent_where_dividing_in_place_may_round_otherwise() -> None:
    # world size 3 (div_ by 3 vs * (1 / 3)), or no world size recorded
    assert _findings(_ddp_step(rounds=2), world=3) == []
    assert _findings(_ddp_step(rounds=2)) == []


def test_gradient_accumulation_under_a_comm_hook_needs_no_power_of_2() -> None:
    # the hook's copy does not scale, and as a bucket view the gradient is not copied at all
    (finding,) = _findings(_ddp_step(rounds=2, hook=True), world=3)
    assert finding.peak_after == TMP


def test_gradient_accumulation_is_silent_when_the_bucket_is_written_between_backwards() -> None:
    # a write of the whole bucket between the copy back and the next copy in: a bucket view would see it
    assert _findings(_ddp_step(rounds=2, between="aten.zero_.default"), world=2) == []


def test_accumulation_is_silent_with_gradient_as_bucket_view() -> None:
    assert _findings(_ddp_step(rounds=2, view=True), world=2) == []


def test_a_gradient_the_reducer_copies_out_of_the_bucket_is_removed() -> None:
    # find_unused_parameters=True, a parameter only another rank used: its .grad is made after the
    # all-reduce as a copy of the bucket view; with gradient_as_bucket_view=True it is the view
    (finding,) = _findings(_ddp_step(cloned=True))
    analysis = analyze(_ddp_step(cloned=True).build())
    (extra,) = finding.edits.remove
    assert analysis.allocations[extra].op == "aten.new_empty_strided.default"
    assert finding.bytes_at_stake == (LAYERS + 1) * GRAD
    assert finding.peak_before == (LAYERS + 1) * GRAD + TMP
    assert finding.peak_after == TMP
    assert any("find_unused_parameters" in reason for reason in finding.safe_because)


def test_a_region_of_several_steps_names_the_gradients_alive_at_the_peak() -> None:
    # two steps recorded, each backward making its own gradients (set to None by zero_grad()): the
    # problem counts those alive at the peak (the first step's optimizer) and the rest as a total
    b = TraceBuilder()
    b.op("aten.empty.memory_format", phase=Phase.OTHER)
    flat = b.alloc(LAYERS * GRAD, preexisting=True, facts=[Fact.GRADIENT_BUCKET])
    for step in range(2):
        b.op("aten.relu.default", phase=Phase.FORWARD, line=10)
        act = b.alloc(100, saved=True)
        grads = []
        for _ in range(LAYERS):
            b.op("aten.mm.default", phase=Phase.BACKWARD, line=10, inputs=(act,))
            grads.append(b.alloc(GRAD, facts=[Fact.GRADIENT]))
            _copy_in(b, grads[-1], flat, hook=False)
        b.op("c10d.allreduce_.default", line=20, inputs=(flat,))
        b.free(act)
        for g in grads:
            b.op("aten.copy_.default", line=20, inputs=(g, flat))
        b.op("aten.sqrt.default", phase=Phase.OPTIMIZER, line=30, inputs=tuple(grads))
        b.free(b.alloc(2 * TMP if step == 0 else TMP))
        b.op("aten.zero_.default", line=31)
        b.free(*grads)
    (finding,) = _findings(b)
    assert finding.peak_before == LAYERS * GRAD + 2 * TMP
    assert finding.peak_after == 2 * TMP
    held, total = format_bytes(LAYERS * GRAD), format_bytes(2 * LAYERS * GRAD)
    assert finding.problem.startswith(f"{LAYERS} gradients ({held}) alive at the peak")
    assert f"({2 * LAYERS} in all, {total}, over the region's 2 backward passes)" in finding.problem
    # one backward pass: nothing to add
    (single,) = _findings(_ddp_step())
    assert "in all" not in single.problem
