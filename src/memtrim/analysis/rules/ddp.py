"""DDP gradients kept beside their bucket's copy (``ddp-gradient-as-bucket-view``:
``DistributedDataParallel(model, gradient_as_bucket_view=True)``).

DDP's reducer owns flat buckets (``gradient_bucket``), allocated when the model is wrapped, that hold
a copy of every gradient for the all-reduce. In backward, as each parameter's gradient is ready
(reducer.cpp ``mark_variable_ready_dense``), the reducer copies it into its view of the bucket
(``aten.mul.out`` with ``out=`` the bucket view, scaling by 1 / world size; ``bucket_view.copy_(grad)``
when a communication hook is registered), all-reduces the bucket (``c10d.allreduce_``) and copies
the result back into the gradient (``grad.copy_(bucket_view)``). With the default
``gradient_as_bucket_view=False`` the gradient autograd made lives on beside the bucket: every
gradient's bytes are held twice. With ``True`` the reducer sets ``.grad`` to the bucket view right
after the copy (``grad = bucket_view``), so the tensor autograd made is freed there and the copy back
is not made.

The what-if frees each such gradient just after the op that copied it into its bucket.

Gradients from before the region (``zero_grad(set_to_none=False)`` keeps them from step to step) are
left out: with ``True`` they would be bucket views from the first step on and the second copy would
never exist, but those bytes are memory the region starts with, and the region's peak is counted above
its start, so no replay of the region can show them go (a gradient from before the region that is
never freed has no event on the live curve to move).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memtrim.analysis.diagnoses import DIAGNOSES, Diagnosis, finding
from memtrim.analysis.roles import Role
from memtrim.analysis.rules.common import is_view_like, writes_in_place
from memtrim.analysis.whatif import Edits
from memtrim.trace.model import Allocation, OpRow, Phase, Site
from memtrim.units import format_bytes

if TYPE_CHECKING:
    from memtrim.analysis.analysis import Analysis
    from memtrim.analysis.flow import Flow

RULE = "ddp-gradient-as-bucket-view"
_READS_VALUES = frozenset({"_local_scalar_dense", "equal", "is_nonzero"})
"""Ops that make no storage and write none, yet read values (``.item()``): not views."""


def _writes(row: OpRow, ident: int) -> bool:
    """Whether ``row`` writes allocation ``ident``: an in-place op (``copy_``, ``allreduce_``) on it
    as its first argument, or an ``out=`` overload with it as the out tensor (the last one handed)."""
    inputs = row.inputs
    if not inputs:
        return False
    if row.op.endswith(".out"):
        return inputs[-1] == ident
    return writes_in_place(row.op) and inputs[0] == ident


def _aliases(flow: Flow, seq: int) -> bool:
    """An op that only made a view of what it was handed (``t``, ``view``): the ops that read through
    the view are recorded as reading the storage."""
    return is_view_like(flow.ops[seq], flow.outputs[seq]) and flow.names[seq] not in _READS_VALUES


def _copied_in(analysis: Analysis, buckets: set[int]) -> dict[int, tuple[int, int]]:
    """Gradient id -> (the op that first copied it into a bucket in backward, that bucket's id), for
    the gradients made in the region: the reducer's ``mul.out(grad, 1 / world, out=bucket_view)`` or
    ``bucket_view.copy_(grad)``. Only the buckets' own readers are looked at."""
    flow, ops, allocations = analysis.flow, analysis.flow.ops, analysis.allocations
    found: dict[int, tuple[int, int]] = {}
    for bucket in sorted(buckets):
        for seq in flow.readers[bucket]:
            row = ops[seq]
            if row.phase is not Phase.BACKWARD or not _writes(row, bucket):
                continue
            if flow.names[seq] not in ("mul", "copy_"):
                continue  # the all-reduce itself, a zero_ or div_ of a bucket view
            for ident in row.inputs:
                if ident == bucket or ident in buckets or ident in found:
                    continue
                g = allocations[ident]
                if not g.preexisting and analysis.role(g) is Role.GRADIENT:
                    found[ident] = (seq, bucket)
    return found


def _copy_back(flow: Flow, g: Allocation, copied: int, bucket: int) -> int | None:
    """The op that copied the all-reduced bucket back into ``g`` (``grad.copy_(bucket_view)``), when no
    other op read or wrote ``g`` between its copy into the bucket and that one."""
    ops = flow.ops
    for seq in flow.readers[g.id]:
        if seq <= copied or _aliases(flow, seq):
            continue
        row = ops[seq]
        if flow.names[seq] == "copy_" and row.inputs[:2] == (g.id, bucket):
            return seq
        return None  # read before the copy back: it would read the bucket's values with the fix
    return None


def _same_after(flow: Flow, g: Allocation, back: int, bucket: int) -> bool:
    """After the copy back, ``g`` holds the bucket's values and keeps them as long as it is read: no op
    writes ``g`` (an accumulation into it: with the fix it would accumulate into the bucket, which
    the reducer then divides in place rather than scaling as it copies) and none writes the bucket
    before ``g``'s last read (with the fix ``g`` would see that write)."""
    ops = flow.ops
    later = [seq for seq in flow.readers[g.id] if seq > back]
    if any(_writes(ops[seq], g.id) for seq in later):
        return False
    last = later[-1] if later else back
    return not any(back < seq <= last and _writes(ops[seq], bucket) for seq in flow.readers[bucket])


@DIAGNOSES.register(RULE)
def ddp_gradient_as_bucket_view(analysis: Analysis) -> list[Diagnosis]:
    """Gradients made in backward, copied into a DDP gradient bucket and kept alive beside it ->
    ``DistributedDataParallel(model, gradient_as_bucket_view=True)``."""
    flow, ops, allocations = analysis.flow, analysis.flow.ops, analysis.allocations
    buckets = {a.id for a in allocations if analysis.role(a) is Role.GRADIENT_BUCKET}
    if not buckets:
        return []
    free_at: dict[int, float | None] = {}
    blamed: list[Allocation] = []
    copy_sites: list[Site | None] = []
    into: set[int] = set()
    for ident, (copied, bucket) in sorted(_copied_in(analysis, buckets).items(), key=lambda kv: kv[1]):
        g = allocations[ident]
        if copied + 1 >= len(ops):
            continue
        if g.free_tick is not None and g.free_tick < ops[copied + 1].tick:
            continue  # freed right after its copy: .grad is the bucket view already
        back = _copy_back(flow, g, copied, bucket)
        if back is None or not _same_after(flow, g, back, bucket):
            continue
        free_at[g.id] = ops[copied].tick + 0.5
        blamed.append(g)
        copy_sites.append(ops[copied].site)
        into.add(bucket)
    if not blamed:
        return []
    total = sum(g.bytes for g in blamed)
    held = sum(g.bytes for g in blamed if g.id in analysis.alive_ids_at_peak)
    module = next((g.module for g in blamed if g.module), None)
    diagnosis = finding(
        analysis,
        rule=RULE,
        site=copy_sites[0],
        problem=(
            f"{len(blamed)} gradients ({format_bytes(total)}) live on beside DDP's gradient "
            + ("buckets" if len(into) > 1 else "bucket")
            + f" ({format_bytes(sum(allocations[b].bytes for b in into))}), which "
            + ("hold" if len(into) > 1 else "holds")
            + f" a second copy of them: {format_bytes(held)} of them alive at the peak"
        ),
        fix="DistributedDataParallel(model, gradient_as_bucket_view=True): each .grad becomes its view "
        "of the bucket, and the gradient autograd made is freed once copied in",
        allocations=tuple(blamed),
        edits=Edits(free_at=free_at),
        safe_because=(
            "each gradient was made in this backward and copied into a DDP gradient bucket there (the "
            "reducer's copy before the all-reduce), and no op read it until the all-reduced bucket was "
            "copied back into it: with gradient_as_bucket_view=True .grad is that bucket view, "
            "holding the same values, bit for bit",
            "after the copy back no op writes the gradient, and none writes the bucket while the "
            "gradient is still read",
        ),
        verify_mode="exact",
        module=module.split(".")[0] if module else None,
        sites=(*copy_sites, *(g.site for g in blamed)),
        note="with gradient_as_bucket_view=True each .grad is a view into DDP's bucket: "
        ".grad.detach_() is refused (zero_grad() handles it), and .grad must not be replaced by a "
        "tensor of another layout; the what-if frees each gradient just after the op that copied "
        "it into its bucket",
    )
    return [diagnosis] if diagnosis is not None else []
