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

Two more shapes of the same waste:

- Gradient accumulation without ``no_sync()``: every backward copies the gradient in and back again,
  and between backwards autograd accumulates into it (``grad += new``, ``add_``). With ``True`` the
  gradient is the bucket view from the first copy on: autograd accumulates into the view and the
  reducer divides the view in place by the world size (``div_``) instead of scaling as it copies.
  That rounds alike only when the world size (the trace's ``distributed`` metadata) is a power of
  2, and only then (or under a communication hook, which copies without scaling) is it blamed; the
  bucket must be written between backwards only by the reducer's copies of other gradients.
- ``find_unused_parameters=True``, a parameter this rank did not use and another rank did: its
  ``.grad`` is ``None`` when the all-reduced bucket comes back, and the reducer makes it as a copy of
  the bucket view (``new_empty_strided`` + ``copy_``); with ``True`` ``.grad`` is the view itself.
  The what-if removes those copies.

Gradients from before the region (``zero_grad(set_to_none=False)`` keeps them from step to step) are
left out: with ``True`` they would be bucket views from the first step on and the second copy would
never exist, but those bytes are memory the region starts with, and the region's peak is counted above
its start, so no replay of the region can show them go (a gradient from before the region that is
never freed has no event on the live curve to move).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memtrim.analysis.roles import Role
from memtrim.analysis.whatif import Edits
from memtrim.doctor.diagnosis import DIAGNOSES, Diagnosis, finding
from memtrim.doctor.rules.common import is_view_like, writes_in_place, writes_out
from memtrim.trace.model import Allocation, OpRow, Phase, Site
from memtrim.trace.ranks import recorded_rank
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
    if writes_out(row.op):
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


_ACCUMULATES = frozenset({"add_"})
"""What autograd's ``AccumulateGrad`` runs on a ``.grad`` that exists (``grad += new``, in place)."""
_CLONES = frozenset({"new_empty_strided", "empty_like", "clone"})
"""Ops the reducer makes a gradient with from its bucket view (``clone_obey_contract``)."""


def _accumulates(row: OpRow, name: str, ident: int) -> bool:
    """Whether ``row`` is autograd accumulating a new gradient into ``.grad`` ``ident`` in backward."""
    return row.phase is Phase.BACKWARD and name in _ACCUMULATES and row.inputs[0] == ident


def _copies_in(flow: Flow, seq: int, ident: int, bucket: int) -> bool:
    """Whether op ``seq`` is the reducer copying gradient ``ident`` into ``bucket`` in backward:
    ``mul.out(grad, 1 / world, out=bucket_view)`` or, under a communication hook, ``copy_``."""
    row = flow.ops[seq]
    if row.phase is not Phase.BACKWARD or not _writes(row, bucket) or ident == bucket:
        return False
    return flow.names[seq] in ("mul", "copy_") and ident in row.inputs


def _copies_back(flow: Flow, seq: int, ident: int, bucket: int) -> bool:
    """Whether op ``seq`` is ``grad.copy_(bucket_view)`` for gradient ``ident``."""
    return flow.names[seq] == "copy_" and flow.ops[seq].inputs[:2] == (ident, bucket)


def _only_copies_in(analysis: Analysis, bucket: int, after: int, before: int) -> bool:
    """Between ops ``after`` and ``before`` only the reducer's copies of gradients write ``bucket``
    (each into its own view, in the next backward): no all-reduce, no scaling of the whole bucket."""
    flow, allocations = analysis.flow, analysis.allocations
    for seq in flow.readers[bucket]:
        if not (after < seq < before and _writes(flow.ops[seq], bucket)):
            continue
        if not any(
            _copies_in(flow, seq, i, bucket) and analysis.role(allocations[i]) is Role.GRADIENT
            for i in flow.ops[seq].inputs
        ):
            return False
    return True


def _rounds(analysis: Analysis, g: Allocation, copied: int, bucket: int) -> tuple[int, bool] | None:
    """The copy back after which ``g`` holds the bucket's values for good, and whether ``g`` went
    through the bucket more than once with the reducer scaling as it copied (``mul.out``), when
    every round is the reducer's: copied in, not read until copied back, then (gradient accumulation
    without ``no_sync()``) only read, or accumulated into by autograd in backward and copied in
    again, with the bucket written in between only by the reducer's copies of other gradients.
    With ``gradient_as_bucket_view=True`` ``g`` is its bucket view from the first copy on: autograd
    accumulates into the view, and the reducer divides the view in place rather than copying."""
    flow = analysis.flow
    ops = flow.ops
    back: int | None = None  # the latest copy back; None while g's values are not yet the bucket's
    scaled = flow.names[copied] == "mul"
    again = False
    for seq in flow.readers[g.id]:
        if seq <= copied:
            continue
        row = ops[seq]
        if back is not None and _copies_in(flow, seq, g.id, bucket):  # (an out= op: no output made)
            if not _only_copies_in(analysis, bucket, back, seq):
                return None
            back, again = None, True
            scaled = scaled or flow.names[seq] == "mul"
        elif _aliases(flow, seq):
            continue
        elif back is None:  # copied in: only the copy back may touch g (with the fix g is the bucket view)
            if not _copies_back(flow, seq, g.id, bucket):
                return None
            back = seq
        elif _writes(row, g.id) and not _accumulates(row, flow.names[seq], g.id):
            return None  # a write the bucket view would not see the same way
    if back is None or not _same_after(flow, g, back, bucket):
        return None
    return back, again and scaled


def _same_after(flow: Flow, g: Allocation, back: int, bucket: int) -> bool:
    """After the last copy back, ``g`` holds the bucket's values and keeps them as long as it is read:
    no op writes ``g`` (an accumulation into it that no copy into the bucket follows: with the fix it
    would accumulate into the bucket) and none writes the bucket before ``g``'s last read (with the fix
    ``g`` would see that write)."""
    ops = flow.ops
    later = [seq for seq in flow.readers[g.id] if seq > back]
    if any(_writes(ops[seq], g.id) for seq in later):
        return False
    last = later[-1] if later else back
    return not any(back < seq <= last and _writes(ops[seq], bucket) for seq in flow.readers[bucket])


def _cloned_back(analysis: Analysis, buckets: set[int]) -> dict[int, int]:
    """Gradient id -> its bucket's id, for the gradients the reducer made after the bucket's
    all-reduce as a copy of their bucket view (``copy_bucket_to_grad`` for a ``.grad`` that was
    ``None``: with ``find_unused_parameters=True``, a parameter this rank did not use and another
    rank did), holding the bucket's values as long as they are read. With
    ``gradient_as_bucket_view=True`` the reducer sets ``.grad`` to the bucket view instead."""
    flow, allocations = analysis.flow, analysis.allocations
    found: dict[int, int] = {}
    for bucket in sorted(buckets):
        reduced = False
        for seq in flow.readers[bucket]:
            row = flow.ops[seq]
            if row.phase is not Phase.BACKWARD:
                continue
            if flow.names[seq] == "allreduce_":
                reduced = True
            if not reduced or flow.names[seq] not in _CLONES or len(flow.outputs[seq]) != 1:
                continue
            g = allocations[flow.outputs[seq][0]]
            if g.preexisting or analysis.role(g) is not Role.GRADIENT:
                continue
            back = seq
            if flow.names[seq] != "clone":  # made empty, then filled: the next op on it is the copy
                filled = next((r for r in flow.readers[g.id] if r > seq and not _aliases(flow, r)), None)
                if filled is None or not _copies_back(flow, filled, g.id, bucket):
                    continue
                back = filled
            if _same_after(flow, g, back, bucket):
                found[g.id] = bucket
    return found


def _world_size(analysis: Analysis) -> int | None:
    recorded = recorded_rank(analysis.log.metadata)
    return recorded.world_size if recorded is not None else None


@DIAGNOSES.register(RULE)
def ddp_gradient_as_bucket_view(analysis: Analysis) -> list[Diagnosis]:
    """Gradients made in backward, copied into a DDP gradient bucket and kept alive beside it ->
    ``DistributedDataParallel(model, gradient_as_bucket_view=True)``."""
    ops, allocations = analysis.flow.ops, analysis.allocations
    buckets = {a.id for a in allocations if analysis.role(a) is Role.GRADIENT_BUCKET}
    if not buckets:
        return []
    world = _world_size(analysis)
    exact_division = world is not None and world > 0 and world & (world - 1) == 0
    free_at: dict[int, float | None] = {}
    blamed: list[Allocation] = []
    copy_sites: list[Site | None] = []
    into: set[int] = set()
    accumulated = 0
    for ident, (copied, bucket) in sorted(_copied_in(analysis, buckets).items(), key=lambda kv: kv[1]):
        g = allocations[ident]
        if copied + 1 >= len(ops):
            continue
        if g.free_tick is not None and g.free_tick < ops[copied + 1].tick:
            continue  # freed right after its copy: .grad is the bucket view already
        rounds = _rounds(analysis, g, copied, bucket)
        if rounds is None:
            continue
        if rounds[1]:
            if not exact_division:
                continue  # dividing the view in place by the world size may round unlike * (1 / world)
            accumulated += 1
        free_at[g.id] = ops[copied].tick + 0.5
        blamed.append(g)
        copy_sites.append(ops[copied].site)
        into.add(bucket)
    cloned = _cloned_back(analysis, buckets)
    if not blamed and not cloned:
        return []
    clones = [allocations[ident] for ident in sorted(cloned)]
    into.update(cloned.values())
    copied_count = len(blamed)
    blamed.extend(clones)
    if not copy_sites:
        copy_sites = [g.site for g in clones]
    safe: list[str] = []
    if copied_count:
        safe += [
            "each gradient was made in this backward and copied into a DDP gradient bucket there (the "
            "reducer's copy before the all-reduce), and no op read it until the all-reduced bucket was "
            "copied back into it: with gradient_as_bucket_view=True .grad is that bucket view, "
            "holding the same values, bit for bit",
            "after the copy back no op writes the gradient, and none writes the bucket while the "
            "gradient is still read",
        ]
    if accumulated:
        safe.append(
            f"{accumulated} gradients went through their bucket once per backward (gradient "
            "accumulation without no_sync()): between backwards only autograd's accumulation wrote "
            "them and only the reducer's copies of gradients wrote the bucket, and each was copied in "
            "and back again; as bucket views autograd accumulates into the view and the reducer "
            f"divides it in place by the world size ({world}), a power of 2: the same rounding as its "
            "copy scaled by 1 / world size"
        )
    if clones:
        safe.append(
            f"{len(clones)} gradients were made by the reducer after the all-reduce as copies of "
            "their bucket views (a .grad that was None: find_unused_parameters=True, a parameter this "
            "rank did not use and another did), and afterwards no op writes them and none writes the "
            "bucket while they are read: with gradient_as_bucket_view=True .grad is that view, and "
            "the copy is never made"
        )
    total = sum(g.bytes for g in blamed)
    at_peak = [g for g in blamed if g.id in analysis.alive_ids_at_peak]
    held = sum(g.bytes for g in at_peak)
    # a region of several steps: the gradients of each backward pass, and (after DDP's first step) a
    # rebuilt bucket; the problem names what is alive at the peak, and the rest as a count
    passes = sum(
        1
        for seq, row in enumerate(ops)
        if row.phase is Phase.BACKWARD and (seq == 0 or ops[seq - 1].phase is not Phase.BACKWARD)
    )
    module = next((g.module for g in blamed if g.module), None)
    diagnosis = finding(
        analysis,
        rule=RULE,
        site=copy_sites[0],
        problem=(
            f"{len(at_peak)} gradients ({format_bytes(held)}) alive at the peak live on beside DDP's "
            + ("gradient buckets, which hold" if len(into) > 1 else "gradient bucket, which holds")
            + " a second copy of them"
            + (
                f" ({len(blamed)} in all, {format_bytes(total)}, over the region's {passes} backward passes)"
                if passes > 1 and len(blamed) > len(at_peak)
                else ""
            )
        ),
        fix="DistributedDataParallel(model, gradient_as_bucket_view=True): each .grad becomes its view "
        "of the bucket, and the gradient autograd made is freed once copied in",
        allocations=tuple(blamed),
        edits=Edits(remove=frozenset(cloned), free_at=free_at),
        safe_because=tuple(safe),
        keeps="exact",
        module=module.split(".")[0] if module else None,
        sites=(*copy_sites, *(g.site for g in blamed)),
        note="with gradient_as_bucket_view=True each .grad is a view into DDP's bucket: "
        ".grad.detach_() is refused (zero_grad() handles it), and .grad must not be replaced by a "
        "tensor of another layout; the what-if frees each gradient just after the op that copied "
        "it into its bucket" + (", and removes the gradients the reducer copied out of it" if clones else ""),
    )
    return [diagnosis] if diagnosis is not None else []
