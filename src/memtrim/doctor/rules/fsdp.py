"""FSDP2 modules that keep their unsharded parameters from forward through backward
(``fsdp-reshard-after-forward``: ``fully_shard(module, reshard_after_forward=False)``).

An FSDP2 module all-gathers its parameters before its forward (the flat ``all_gather_buffer``, copied
out into the ``unsharded_parameter`` storages) and, with ``reshard_after_forward=True`` (the default
for every module but the root), frees them again at the end of its forward and all-gathers them once
more when backward reaches the module. With ``False`` they stay alive until the module's backward is
done: the trace shows an unsharded parameter made before backward and freed only after the module's
backward started.

The what-if replays FSDP2's own schedule (``FSDPParamGroup.post_forward``, ``pre_backward`` and
``_backward_prefetch``): the unsharded parameters are freed where the module's forward ends; in
backward, the module whose forward ended next (the one whose backward runs just before) prefetches
this module's all-gather into a buffer the size of the forward's, which lives until this module's own
pre-backward copies it out into the unsharded parameters again; a module no other prefetches (the
last in forward order) all-gathers for itself at its pre-backward. The re-gathered parameters are
freed where the recorded ones were.

Only the modules the what-if needs are named: a call whose edits leave the what-if peak where it is
without them is left out. That leaves out FSDP2's root when the loss is computed inside the model (its
backward starts as its forward ends: resharding it costs an all-gather and saves nothing), and names it
where a loss outside the model runs between the two.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from memtrim.analysis.roles import Role
from memtrim.analysis.whatif import Added, Edits
from memtrim.doctor.diagnosis import DIAGNOSES, Diagnosis, finding
from memtrim.doctor.rules.common import module_expression
from memtrim.trace.model import Allocation, Phase
from memtrim.units import format_bytes

if TYPE_CHECKING:
    from memtrim.analysis.analysis import Analysis
    from memtrim.analysis.flow import Flow


@dataclass
class _Unit:
    """One forward call of an FSDP2 module: the unsharded parameters it gathered, where its forward
    ended, where its backward starts."""

    module: str
    unsharded: list[Allocation] = field(default_factory=list)
    gather_bytes: int = 0
    """The forward all-gather buffer's bytes (what a re-gather allocates again)."""
    forward_end: int = 0
    """The first op after the module's forward run (its post-forward runs just before it)."""
    backward_start: int | None = None
    """The module's first backward op after that forward (its pre-backward runs just before it)."""


def _inside(module: str | None, path: str) -> bool:
    return module is not None and (module == path or module.startswith(path + "."))


def _run_end(flow: Flow, path: str, seq: int) -> int:
    """The first op from ``seq`` on that does not run inside module ``path``."""
    ops = flow.ops
    while seq < len(ops) and _inside(ops[seq].module, path):
        seq += 1
    return seq


def _units(analysis: Analysis) -> list[_Unit]:
    """The forward calls of FSDP2 modules, in the order their forwards ended (FSDP2's
    ``post_forward_order``), from the unsharded parameters made outside backward."""
    flow, ops = analysis.flow, analysis.flow.ops
    backward_ops: dict[str, list[int]] = {}
    found: dict[tuple[str, int], _Unit] = {}
    gathers: dict[str, list[Allocation]] = {}
    for a in analysis.allocations:
        if a.preexisting or a.module is None or analysis.role(a) is not Role.ALL_GATHER_BUFFER:
            continue
        gathers.setdefault(a.module, []).append(a)
    for a in analysis.allocations:
        if a.preexisting or a.module is None or analysis.role(a) is not Role.UNSHARDED_PARAMETER:
            continue
        seq = flow.producer[a.id]
        if seq < 0 or ops[seq].phase is Phase.BACKWARD:
            continue  # a re-gather in backward: the module reshards after forward already
        end = _run_end(flow, a.module, seq)
        unit = found.get((a.module, end))
        if unit is None:
            unit = found[(a.module, end)] = _Unit(a.module, forward_end=end)
            earlier = [g for g in gathers.get(a.module, ()) if g.alloc_tick < a.alloc_tick]
            unit.gather_bytes = earlier[-1].bytes if earlier else 0
        unit.unsharded.append(a)
    if not found:
        return []
    for seq, row in enumerate(ops):
        if row.phase is Phase.BACKWARD and row.module is not None:
            parts = row.module.split(".")
            for n in range(1, len(parts) + 1):
                backward_ops.setdefault(".".join(parts[:n]), []).append(seq)
    units = sorted(found.values(), key=lambda u: u.forward_end)
    for unit in units:
        seqs = backward_ops.get(unit.module, [])
        i = bisect.bisect_left(seqs, unit.forward_end)
        unit.backward_start = seqs[i] if i < len(seqs) else None
        if unit.gather_bytes == 0:
            unit.gather_bytes = sum(a.bytes for a in unit.unsharded)
    return units


def _kept_through_backward(analysis: Analysis, unit: _Unit) -> bool:
    """Every unsharded parameter of the call alive when the module's backward starts, and no op reads
    it between the end of the module's forward and that start (a second forward call re-gathers)."""
    flow, ops = analysis.flow, analysis.flow.ops
    start = unit.backward_start
    if start is None or unit.forward_end >= start:
        return False
    for a in unit.unsharded:
        if a.free_tick is not None and a.free_tick <= ops[start].tick:
            return False
        if any(unit.forward_end <= r < start for r in flow.readers[a.id]):
            return False
    return True


_Plan = tuple[dict[int, float | None], list[Added]]
"""One module's edits: its unsharded parameters' new frees, and the re-gather's buffers."""


def _plan(analysis: Analysis, units: list[_Unit], unit: _Unit) -> _Plan:
    """FSDP2's schedule with ``reshard_after_forward=True`` for one forward call of a module."""
    ops = analysis.flow.ops
    assert unit.backward_start is not None
    own = ops[unit.backward_start].tick
    # the prefetcher: the module whose forward ended next and whose backward starts before this one's
    later = units[units.index(unit) + 1 :]
    prefetch = next(
        (
            ops[u.backward_start].tick
            for u in later
            if u.backward_start is not None and u.backward_start < unit.backward_start
        ),
        None,
    )
    gathered_at = (prefetch if prefetch is not None else own) - 0.4
    added = [Added(unit.gather_bytes, gathered_at, own - 0.2)]
    free_at: dict[int, float | None] = {}
    for a in unit.unsharded:
        free_at[a.id] = ops[unit.forward_end].tick - 0.5 if unit.forward_end < len(ops) else None
        added.append(Added(a.bytes, own - 0.3, a.free_tick))
    return free_at, added


def _edits(plans: Iterable[_Plan]) -> Edits:
    free_at: dict[int, float | None] = {}
    added: list[Added] = []
    for frees, adds in plans:
        free_at.update(frees)
        added += adds
    return Edits(free_at=free_at, add=tuple(added))


def _needed(analysis: Analysis, kept: list[_Unit], plans: dict[int, _Plan]) -> list[_Unit]:
    """The forward calls whose resharding the what-if peak needs: each call, the last forward to end
    first (the root's), is left out where the peak without its edits is no higher (the root, whose
    backward starts as its forward ends, saves nothing; nor does a module whose parameters are not
    alive where the peak would be)."""
    needed = list(kept)
    best = analysis.peak_with(_edits(plans[id(u)] for u in needed))
    for unit in reversed(kept):
        rest = [u for u in needed if u is not unit]
        if analysis.peak_with(_edits(plans[id(u)] for u in rest)) <= best:
            needed = rest
    return needed


@DIAGNOSES.register("fsdp-reshard-after-forward")
def fsdp_reshard_after_forward(analysis: Analysis) -> list[Diagnosis]:
    """FSDP2 modules whose unsharded parameters stay alive from forward through backward ->
    ``fully_shard(module, reshard_after_forward=True)``."""
    units = _units(analysis)
    kept = [u for u in units if _kept_through_backward(analysis, u)]
    if not kept:
        return []
    plans = {id(unit): _plan(analysis, units, unit) for unit in kept}
    kept = _needed(analysis, kept, plans)
    if not kept:
        return []
    edits = _edits(plans[id(u)] for u in kept)
    blamed = [a for unit in kept for a in unit.unsharded]
    first = kept[0]
    modules = list(dict.fromkeys(u.module for u in kept))
    names = [module_expression(m) or m for m in modules]
    held = sum(a.bytes for a in blamed if a.id in analysis.alive_ids_at_peak)
    diagnosis = finding(
        analysis,
        rule="fsdp-reshard-after-forward",
        site=first.unsharded[0].site,
        problem=(
            f"{len(modules)} FSDP2 module(s) ({', '.join(names)}) keep their unsharded parameters from "
            f"forward through backward: {format_bytes(held)} of them alive at the peak"
        ),
        fix=f"fully_shard({names[0]}, reshard_after_forward=True)"
        + (f" for each of {', '.join(names)}" if len(names) > 1 else "")
        + " (FSDP2's default for every module but the root, which keeps its parameters unless set)",
        allocations=tuple(blamed),
        edits=edits,
        safe_because=(
            "the parameters are all-gathered again from the same shards before backward reads them: "
            "the same values, so results and gradients are bit for bit equal",
            "each unsharded parameter was made before backward and is alive when its module's backward "
            "starts, and no op reads it between the end of its module's forward and that start",
            "each module named lowers the what-if peak: one whose resharding would not (the root, whose "
            "backward starts as its forward ends; a module whose parameters are not alive where the peak "
            "would be) is left as it is",
        ),
        keeps="exact",
        module=first.module,
        sites=tuple(a.site for u in kept for a in u.unsharded),
        cost=f"one more all-gather per module in backward ({len(kept)} in all, "
        f"{format_bytes(sum(u.gather_bytes for u in kept))} gathered)",
        note="the what-if follows FSDP2's schedule: freed at the end of the module's forward, all-gathered "
        "again when the module's backward is prefetched (the previous module's pre-backward) and "
        "copied out at its own",
    )
    return [diagnosis] if diagnosis is not None else []
