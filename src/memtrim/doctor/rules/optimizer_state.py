"""Gradients and optimizer state at the peak (``optimizer-state``): the levers torch itself has, each
replayed on the recorded timeline.

- **The step fused into backward** (``memtrim.fixes.optimizer_in_backward``: one optimizer per
  parameter, run from ``register_post_accumulate_grad_hook``): each gradient is applied and freed as soon
  as backward has made it, so the model's gradients are never alive together. The what-if frees every
  parameter's gradient just after it is made, drops the step's temporaries where the step ran and makes,
  per gradient, the same share of temporaries the recorded step made per byte of gradient (one
  parameter's at a time); state the step creates (the first step) is made there too. Bit for bit for an
  optimizer whose update of a parameter reads only its own gradient and state, unless the program reads
  the gradients between backward and the step (global norm clipping) or accumulates them over several
  backwards: then it changes training, and the finding says so.
- **Adafactor** (``torch.optim.Adafactor``) in place of Adam/AdamW: factored second moments, a
  ``[rows, 1]`` and a ``[1, cols]`` per matrix, the full ``[n]`` per vector, no first moment. A different
  optimizer: it changes training. The what-if shrinks each parameter's two Adam moments to that size.

The step's own temporaries (``fused=True``, ``foreach=False``) are ``optimizer-step``'s finding
(:mod:`.optimizer`); this rule is about the gradients and the state.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from memtrim.analysis.categories import Category
from memtrim.analysis.roles import Role
from memtrim.analysis.whatif import Added, Edits
from memtrim.doctor.diagnosis import DIAGNOSES, Diagnosis, finding
from memtrim.doctor.rules.common import ITEMSIZE, numel, where, writes_in_place
from memtrim.trace.model import Allocation, Fact, Phase, Site
from memtrim.units import format_bytes

if TYPE_CHECKING:
    from memtrim.analysis.analysis import Analysis

_ADAM_STEP = frozenset({"lerp_", "_foreach_lerp_"})
"""Ops only Adam and AdamW's update runs among torch.optim's (``exp_avg.lerp_(grad, 1 - beta1)``)."""
_ZERO = frozenset({"zero_", "_foreach_zero_"})

PROOF_IN_BACKWARD = (
    "# with model, optimizer, batch, loss_fn: yours, before apply; loss_fn(model, batch): the loss\n"
    """import copy, torch, memtrim.fixes
a, a_optimizer = copy.deepcopy((model, optimizer))
b, b_optimizer = copy.deepcopy((model, optimizer))
handle = memtrim.fixes.optimizer_in_backward(b_optimizer)
for _ in range(3):
    loss_fn(a, batch).backward()
    a_optimizer.step()
    a_optimizer.zero_grad()
    loss_fn(b, batch).backward()
assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))"""
)
"""Runnable proof that the step in backward trains the same, bit for bit, over three steps."""


def _state_of_gradients(analysis: Analysis, grads: set[int]) -> dict[int, list[Allocation]]:
    """Gradient id -> the optimizer state the step updated with it: the state an optimizer op read
    together with exactly that one gradient (``exp_avg.lerp_(grad, ...)``)."""
    allocations, ops = analysis.allocations, analysis.flow.ops
    found: dict[int, list[Allocation]] = {}
    taken: set[int] = set()
    for row in ops:
        if row.phase is not Phase.OPTIMIZER:
            continue
        read = list(dict.fromkeys(i for i in row.inputs if i in grads))  # addcmul_(g, g) reads g twice
        if len(read) != 1:
            continue
        for i in row.inputs:
            a = allocations[i]
            if i not in taken and i not in grads and analysis.role(a) is Role.OPTIMIZER_STATE and a.shape:
                found.setdefault(read[0], []).append(a)
                taken.add(i)
    return found


def _reads_between(analysis: Analysis, grads: list[Allocation]) -> Site | None:
    """The line that reads gradients outside backward and the optimizer (``clip_grad_norm_``)."""
    flow, ops = analysis.flow, analysis.flow.ops
    for g in grads:
        for r in flow.readers[g.id]:
            row = ops[r]
            if row.phase is Phase.OTHER and flow.names[r] not in _ZERO:
                return row.site
    return None


def _accumulates(analysis: Analysis, grads: list[Allocation]) -> bool:
    """Whether a gradient is added into by a later backward (gradient accumulation); one zeroed in
    place in between (``zero_grad(set_to_none=False)``) is a new gradient, not an accumulated one."""
    flow, ops = analysis.flow, analysis.flow.ops
    for g in grads:
        since, zeroed = flow.producer[g.id], False
        for r in flow.readers[g.id]:
            if flow.names[r] in _ZERO:
                since, zeroed = r, True
                continue
            if r <= since or ops[r].phase is not Phase.BACKWARD or not writes_in_place(ops[r].op):
                continue
            # added into by a backward after another phase ran, and not zeroed since
            if not zeroed and any(ops[x].phase is not Phase.BACKWARD for x in range(since, r)):
                return True
            since, zeroed = r, False
    return False


def _in_backward(
    analysis: Analysis,
    grads: list[Allocation],
    states: dict[int, list[Allocation]],
    temporaries: list[Allocation],
) -> Diagnosis | None:
    flow, ops = analysis.flow, analysis.flow.ops
    phases = [flow.next_in(phase) for phase in (Phase.FORWARD, Phase.OPTIMIZER, Phase.OTHER)]
    after_backward = [min(ends) for ends in zip(*phases, strict=True)]
    """Op number -> the first op after it outside backward: ops with the same value share a backward."""
    hooks: dict[int, list[float]] = {}
    for g in grads:
        # a hook runs when a backward is done with the gradient: its last read in that backward. The
        # first frees it; a later backward adding into it (zeroed in place in between) makes a new one
        # under the hook, stepped and freed there too
        made = flow.producer[g.id]
        last_in: dict[int, int] = {after_backward[made]: made} if made >= 0 else {}
        for r in flow.readers[g.id]:
            if ops[r].phase is Phase.BACKWARD and r > made:
                last_in[after_backward[r]] = r
        hooks[g.id] = [float(ops[r].tick) for _, r in sorted(last_in.items())] or [float(g.alloc_tick)]
    stepped = sum(g.bytes * len(hooks[g.id]) for g in grads)
    share = sum(t.bytes for t in temporaries) / stepped if stepped else 0.0
    free_at: dict[int, float | None] = {}
    alloc_at: dict[int, float] = {}
    added = []
    linked_states: set[int] = set()
    backward_start = min(g.alloc_tick for g in grads)
    for g in grads:
        hook = hooks[g.id][0]
        for s in states.get(g.id, []):
            linked_states.add(s.id)
            if not s.preexisting and s.phase is Phase.OPTIMIZER:
                alloc_at[s.id] = hook + 0.1  # the first step creates it in the hook
        if share:
            added += [Added(math.ceil(share * g.bytes), h + 0.2, h + 0.3) for h in hooks[g.id]]
        free_at[g.id] = hook + 0.4
    for a in analysis.allocations:
        # state the trace could not tie to one gradient (a foreach step's lists): made at backward's start
        if (
            analysis.role(a) is Role.OPTIMIZER_STATE
            and not a.preexisting
            and a.phase is Phase.OPTIMIZER
            and a.id not in linked_states
        ):
            alloc_at[a.id] = backward_start
    clipping = _reads_between(analysis, grads)
    accumulating = _accumulates(analysis, grads)
    exact = clipping is None and not accumulating
    reasons = [
        "each gradient is read by the step of its own parameter only, and freed by the hook after it",
        "one optimizer per parameter, of the same class with its group's options and its state: the "
        "same update of each parameter",
    ]
    if clipping is not None:
        reasons.append(
            f"the program reads the gradients between backward and the step at {where(clipping)} "
            "(global norm clipping): in backward no parameter's step can wait for the others' gradients, "
            "so this changes training"
        )
    if accumulating:
        reasons.append(
            "gradients are accumulated over several backwards: the hook steps at every backward, so "
            "this changes training"
        )
    site = next((t.site for t in temporaries), None) or next(
        (ops[r].site for g in grads for r in flow.readers[g.id] if ops[r].phase is Phase.OPTIMIZER), None
    )
    return finding(
        analysis,
        rule="optimizer-state",
        site=site,
        problem=(
            f"{len(grads)} gradients ({format_bytes(stepped)}) are alive together until the optimizer "
            "step, with the optimizer state"
        ),
        fix=(
            "step each parameter in backward as soon as its gradient is made: "
            "handle = memtrim.fixes.optimizer_in_backward(optimizer), then drop optimizer.step() and "
            "optimizer.zero_grad() from the loop (one optimizer per parameter, from "
            "register_post_accumulate_grad_hook; a scheduler of the optimizer keeps working)"
        ),
        code=(
            "import memtrim.fixes\n"
            "handle = memtrim.fixes.optimizer_in_backward(optimizer)  # handle.remove() undoes"
        ),
        binds=(("optimizer", "the torch.optim optimizer the loop steps"),),
        allocations=tuple(grads),
        edits=Edits(
            remove=frozenset(t.id for t in temporaries),
            free_at=free_at,
            alloc_at=alloc_at,
            add=tuple(added),
        ),
        safe_because=tuple(reasons),
        keeps="exact" if exact else "changes-training",
        proof=PROOF_IN_BACKWARD if exact else None,
        note=(
            "the what-if makes, right after each gradient, the step's temporaries for it "
            f"({share:.1f}x its bytes, as the recorded step made per byte of gradient)"
        ),
    )


def _adafactor_bytes(a: Allocation) -> int:
    """Adafactor's state for the parameter ``a`` (an Adam moment) has the shape of: rows + cols for a
    matrix (over leading dimensions), the whole vector for a vector."""
    size = ITEMSIZE.get(a.dtype, 4)
    if len(a.shape) < 2:
        return numel(a) * size
    *lead, rows, cols = a.shape
    return math.prod(lead) * (rows + cols) * size


def _adafactor(
    analysis: Analysis, grads: list[Allocation], states: dict[int, list[Allocation]], site: Site | None
) -> Diagnosis | None:
    resize: dict[int, int] = {}
    remove: set[int] = set()
    moments: list[Allocation] = []
    for g in grads:
        pair = states.get(g.id)
        if pair is None:
            continue  # its state was updated with an earlier step's gradient (counted there)
        if len(pair) != 2 or pair[0].shape != pair[1].shape or numel(pair[0]) != numel(g):
            return None  # not Adam's two moments per parameter: no like-for-like what-if
        first, second = sorted(pair, key=lambda s: s.id)
        resize[first.id] = _adafactor_bytes(first)
        remove.add(second.id)
        moments += pair
    if not moments:
        return None
    before = sum(s.bytes for s in moments)
    after = sum(resize.values())
    return finding(
        analysis,
        rule="optimizer-state",
        site=site,
        problem=(
            f"Adam's two moments per parameter are {format_bytes(before)} of optimizer state "
            f"({len(moments) // 2} parameters)"
        ),
        fix=(
            "torch.optim.Adafactor(model.parameters()) in place of Adam/AdamW, model the module it "
            "trains (lr=1e-2 by default): factored second moments "
            f"([rows, 1] and [1, cols] per matrix, {format_bytes(after)} in all), no first moment"
        ),
        allocations=tuple(moments),
        edits=Edits(remove=frozenset(remove), resize=resize),
        safe_because=(
            "each parameter's state is two tensors of its shape (exp_avg, exp_avg_sq), updated with its "
            "gradient by lerp_: Adam or AdamW",
        ),
        keeps="changes-training",
        note="a different optimizer (its own learning-rate schedule, no momentum): tune it before "
        "comparing; the what-if changes the state only, not the step's temporaries",
    )


@DIAGNOSES.register("optimizer-state")
def optimizer_state(analysis: Analysis) -> list[Diagnosis]:
    """Gradients and optimizer state at the peak -> the step fused into backward
    (``memtrim.fixes.optimizer_in_backward``), or Adafactor in place of Adam/AdamW."""
    flow, ops = analysis.flow, analysis.flow.ops
    grads = [
        a
        for a in analysis.allocations
        if Fact.GRADIENT in a.facts
        and not a.preexisting
        and a.phase is Phase.BACKWARD
        and flow.read_in(a, Phase.OPTIMIZER)
    ]
    if not grads:
        return []
    ids = {g.id for g in grads}
    states = _state_of_gradients(analysis, ids)
    temporaries = [
        a
        for a in analysis.allocations
        if a.phase is Phase.OPTIMIZER and analysis.category(a) is Category.TEMPORARY
    ]
    results = []
    in_backward = _in_backward(analysis, grads, states, temporaries)
    if in_backward is not None:
        results.append(in_backward)
    adam = any(flow.names[seq] in _ADAM_STEP and ops[seq].phase is Phase.OPTIMIZER for seq in range(len(ops)))
    if adam:
        site = in_backward.site if in_backward is not None else None
        adafactor = _adafactor(analysis, grads, states, site)
        if adafactor is not None:
            results.append(adafactor)
    return results
