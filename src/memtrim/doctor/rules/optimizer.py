"""The optimizer step (``optimizer-step``): temporaries a ``torch.optim`` step makes (``foreach``
lists the size of every parameter at once, or one parameter's ``sqrt``/``div`` at a time) where they
set the peak, and gradients kept alive into the next forward (``zero_grad(set_to_none=False)``, or
``zero_grad()`` called only before the next backward)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memtrim.analysis.categories import Category
from memtrim.analysis.roles import Role
from memtrim.analysis.whatif import Added, Edits
from memtrim.doctor.diagnosis import DIAGNOSES, Diagnosis, finding
from memtrim.doctor.rules.common import where, writes_in_place
from memtrim.trace.model import Allocation, Fact, Phase, Site
from memtrim.units import format_bytes

if TYPE_CHECKING:
    from memtrim.analysis.analysis import Analysis

_ADAM_STEP = frozenset({"lerp_", "_foreach_lerp_"})
"""Ops only Adam and AdamW's update runs among torch.optim's (``exp_avg.lerp_(grad, 1 - beta1)``)."""
_ZERO = frozenset({"zero_", "_foreach_zero_"})

_OPTIMIZER = (("optimizer", "the torch.optim optimizer the loop steps"),)


def _options_code(options: str) -> str:
    return (
        "import memtrim.fixes\n"
        f"handle = memtrim.fixes.optimizer_options(optimizer, {options})  # handle.remove() undoes"
    )


def _options_proof(options: str) -> str:
    """Runnable proof that the step with ``options`` is no less accurate than the step as built."""
    return (
        "# with optimizer: yours, before apply\nfrom memtrim.verify import verify_optimizer\n"
        f"verify_optimizer(optimizer, {options}).assert_ok()"
    )


_SAME_LOOP = """import copy, torch
a, a_optimizer = copy.deepcopy((model, optimizer))
b, b_optimizer = copy.deepcopy((model, optimizer))
for _ in range(3):
{before}    loss_fn(b, batch).backward()
    b_optimizer.step()
    b_optimizer.zero_grad(set_to_none=True)
assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))"""
_LOOP_NAMES = "# with model, optimizer, batch, loss_fn: yours; loss_fn(model, batch): the loss"
ZEROED_PROOF = f"{_LOOP_NAMES}\n" + _SAME_LOOP.format(
    before="    loss_fn(a, batch).backward()\n    a_optimizer.step()\n"
    "    a_optimizer.zero_grad(set_to_none=False)\n"
)
"""Runnable proof that gradients set to None train as zeroed ones do, bit for bit, over three steps."""
LATE_PROOF = f"{_LOOP_NAMES}\n" + _SAME_LOOP.format(
    before="    loss = loss_fn(a, batch)\n    a_optimizer.zero_grad()\n"
    "    loss.backward()\n    a_optimizer.step()\n"
)
"""Runnable proof that zeroing right after the step trains as zeroing after the next forward does."""


def _step_temporaries(analysis: Analysis) -> dict[Site | None, list[Allocation]]:
    found: dict[Site | None, list[Allocation]] = {}
    categories = analysis.categories
    for a in analysis.allocations:
        # made and freed inside the step, and not the optimizer's state: a step that creates its state
        # (the first) and a program that drops the optimizer before the next op free the state in the
        # optimizer phase too, and a fused step still makes it
        if (
            a.phase is Phase.OPTIMIZER
            and categories[a.id] is Category.TEMPORARY
            and analysis.role(a) is Role.TEMPORARY
        ):
            found.setdefault(a.site, []).append(a)
    return found


def _temporaries_problem(
    analysis: Analysis, temps: list[Allocation], largest: Allocation, foreach: bool
) -> str:
    # Each figure is the figure of what it names: the temporaries of every step the trace holds are
    # counted "in all"; the peak's share is those alive at the peak, which is what the fix removes from it.
    alive = [t for t in temps if t.id in analysis.alive_ids_at_peak]
    at_peak = (
        f"{len(alive)} of them ({format_bytes(sum(t.bytes for t in alive))}) alive at the peak"
        if alive
        else "none of them alive at the peak"
    )
    return (
        f"the optimizer step makes {len(temps)} temporaries "
        f"({format_bytes(sum(t.bytes for t in temps))} in all, the largest {format_bytes(largest.bytes)}"
        + (", all parameters' at once: foreach" if foreach else "")
        + f"); {at_peak}"
    )


def _optimizer_temporaries(analysis: Analysis) -> list[Diagnosis]:
    flow, ops = analysis.flow, analysis.flow.ops
    adam_sites = {
        ops[seq].site
        for seq, name in enumerate(flow.names)
        if name in _ADAM_STEP and ops[seq].phase is Phase.OPTIMIZER
    }
    results = []
    for site, temps in _step_temporaries(analysis).items():
        producers = [flow.names[flow.producer[t.id]] for t in temps]
        foreach = any(name.startswith("_foreach_") for name in producers)
        adam = site in adam_sites
        largest = max(temps, key=lambda t: t.bytes)
        if adam:
            fix = (
                # the trace does not say which of the two the program built: name both
                "construct the optimizer with fused=True (torch.optim.Adam(params, ..., fused=True), "
                "or AdamW's): the fused step makes no temporaries"
            )
            options = "fused=True, foreach=False"
            if foreach:
                fix += "; or foreach=False, one parameter's temporaries at a time"
            edits = Edits.removing(t.id for t in temps)
            note = None
        elif foreach:
            # one parameter at a time: each foreach op's list becomes its largest member, held as long
            by_op: dict[int, list[Allocation]] = {}
            for t in temps:
                by_op.setdefault(flow.producer[t.id], []).append(t)
            added = []
            for members in by_op.values():
                ends = [m.free_tick for m in members if m.free_tick is not None]
                added.append(
                    Added(
                        max(m.bytes for m in members),
                        min(m.alloc_tick for m in members),
                        max(ends) if ends else None,
                    )
                )
            fix = "construct the optimizer with foreach=False: one parameter's temporaries at a time"
            options = "foreach=False"
            edits = Edits(remove=frozenset(t.id for t in temps), add=tuple(added))
            note = "the what-if keeps, per foreach op, one buffer the size of the largest parameter's"
        else:
            continue  # one parameter at a time already, and no fused form known for this optimizer
        diagnosis = finding(
            analysis,
            rule="optimizer-step",
            site=site,
            problem=_temporaries_problem(analysis, temps, largest, foreach),
            fix=fix,
            allocations=tuple(temps),
            edits=edits,
            safe_because=(
                "the temporaries are made and freed inside torch.optim's step",
                "Adam/AdamW's update (lerp_) has a fused implementation on CPU and CUDA"
                if adam
                else "the single-tensor step computes the same update one parameter at a time",
                "the fused/single-tensor step rounds differently from foreach: "
                "memtrim.verify.verify_optimizer proves it no less accurate",
            ),
            keeps="reference",
            module=None,
            note=note,
            code=_options_code(options),
            binds=_OPTIMIZER,
            proof=_options_proof(options),
        )
        if diagnosis is not None:
            results.append(diagnosis)
    return results


def _is_gradient(analysis: Analysis, a: Allocation) -> bool:
    # what autograd stored as a .grad (Fact.GRADIENT), or by lifetime: made in backward and alive
    # after it (a gradient the program keeps itself)
    return analysis.categories[a.id] is Category.GRADIENT or Fact.GRADIENT in a.facts


def _grads_into_next_forward(analysis: Analysis) -> list[Diagnosis]:
    """Gradients an optimizer step read, still alive when the next forward starts: zeroed in place
    (``set_to_none=False``) or set to None only after that forward began."""
    flow, ops, allocations = analysis.flow, analysis.flow.ops, analysis.allocations
    upcoming = flow.next_in(Phase.FORWARD)
    free_at: dict[int, float | None] = {}
    blamed: list[Allocation] = []
    zeroed_sites: list[Site | None] = []
    late_sites: list[Site | None] = []
    for g in allocations:
        if not _is_gradient(analysis, g):
            continue
        readers = flow.readers[g.id]
        steps = [r for r in readers if ops[r].phase is Phase.OPTIMIZER and flow.names[r] not in _ZERO]
        if not steps:
            continue
        zeros = [r for r in readers if r > steps[0] and flow.names[r] in _ZERO]
        if zeros:
            # set_to_none=True frees the gradient where it was zeroed; the next backward's gradient
            # then becomes .grad instead of being added into the zeroed one, and lives on in its place
            owner, changed = g, False
            for zero in zeros:
                accumulate = next(
                    (
                        r
                        for r in readers
                        if r > zero and ops[r].phase is Phase.BACKWARD and writes_in_place(ops[r].op)
                    ),
                    None,
                )
                forward = upcoming[zero]
                if accumulate is None or forward > accumulate:
                    break  # not used again, or zeroed with no forward before the next backward
                fresh = [allocations[i] for i in ops[accumulate].inputs if i != g.id]
                if len(fresh) != 1 or fresh[0].bytes != g.bytes or fresh[0].preexisting:
                    break
                free_at[owner.id] = ops[zero].tick
                owner, changed = fresh[0], True
                zeroed_sites.append(ops[zero].site)
            if changed:
                free_at[owner.id] = g.free_tick
                blamed.append(g)
            continue
        forward = upcoming[steps[-1]]
        late = [r for r in readers if r > steps[-1]]
        if forward < len(ops) and not late and g.free_tick is not None and g.free_tick > ops[forward].tick:
            # set to None only after the next forward began, and not read again
            free_at[g.id] = ops[steps[-1]].tick + 0.5
            blamed.append(g)
            late_sites.append(ops[steps[-1]].site)
    if not blamed:
        return []
    if zeroed_sites:
        site = zeroed_sites[0]
        fix = (
            "optimizer.zero_grad(set_to_none=True) (the default) instead of set_to_none=False, optimizer "
            "the torch.optim optimizer the loop steps"
        )
        problem = (
            f"{len(blamed)} gradients ({format_bytes(sum(g.bytes for g in blamed))}) are zeroed in place "
            "and kept through the next forward"
        )
    else:
        site = late_sites[0]
        fix = f"call optimizer.zero_grad(set_to_none=True) right after the step at {where(site)}"
        problem = (
            f"{len(blamed)} gradients ({format_bytes(sum(g.bytes for g in blamed))}) stay alive from the "
            "step into the next forward"
        )
    diagnosis = finding(
        analysis,
        rule="optimizer-step",
        site=site,
        problem=problem,
        fix=fix,
        allocations=tuple(blamed),
        edits=Edits(free_at=free_at),
        safe_because=(
            "the step read each gradient, and nothing reads it again before the next backward writes it",
            "a gradient set to None is replaced by the next backward's, which the zeroed one was added "
            "to: the same values (0 + g == g), bit for bit",
        ),
        keeps="exact",
        sites=tuple(zeroed_sites or late_sites),
        proof=ZEROED_PROOF if zeroed_sites else LATE_PROOF,
    )
    return [diagnosis] if diagnosis is not None else []


@DIAGNOSES.register("optimizer-step")
def optimizer_step(analysis: Analysis) -> list[Diagnosis]:
    """Step temporaries at the peak -> ``fused=True`` (Adam, AdamW) or ``foreach=False``; gradients
    alive in the next forward -> ``zero_grad(set_to_none=True)`` right after the step."""
    return [*_optimizer_temporaries(analysis), *_grads_into_next_forward(analysis)]
