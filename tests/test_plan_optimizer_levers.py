"""The optimizer levers of memtrim.plan (``optimizer-in-backward``, ``optimizer-fused``,
``optimizer-foreach-off``, ``zero-grad-to-none``) on a small AdamW/SGD loop: each is offered from its
doctor finding, applied by ``memtrim.applied`` to the optimizer the program built before the block,
measured with torch.profiler's allocation events (the ground truth) against its prediction, and its
numbers compared with the loop without it — bit for bit for the exact levers, against a float64 step
within verify's rounding budget for the reference ones."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from groundtruth import profiler_memory
from torch import nn

import memtrim
from memtrim.fixes.optimizer import PER_PARAMETER_OPTIMIZERS
from memtrim.plan.apply import applied
from memtrim.plan.file import Plan, PlannedLever
from memtrim.plan.numerics import StepCapture, reference_check
from memtrim.plan.search import Candidate, options_of, search

Loop = Callable[[], None]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])


def _loop(model: nn.Module, optimizer: torch.optim.Optimizer, *, zero: str = "after") -> Loop:
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(1))

    def loop() -> None:
        for _ in range(2):
            if zero == "before":
                optimizer.zero_grad(set_to_none=False)  # kept zeroed through the next forward
            model(x).square().mean().backward()
            optimizer.step()
            if zero == "after":
                optimizer.zero_grad(set_to_none=True)

    return loop


def _plan_of(option_lever: str, loop: Loop, params: dict[str, object] | None = None) -> tuple[Plan, int]:
    with memtrim.track() as trace:
        loop()
    options = [o for o in options_of(trace.analysis, frozenset({"exact", "reference"}))]
    (option,) = [o for o in options if o.lever == option_lever and (params is None or o.params == params)]
    predicted = trace.analysis.peak_with(option.edits)
    assert predicted < trace.peak_bytes, (option_lever, predicted, trace.peak_bytes)
    o = option
    lever = PlannedLever(o.lever, o.target, dict(o.params), o.keeps, predicted, o.cost)
    return Plan(trace.peak_bytes, trace.peak_bytes, predicted, [lever]), predicted


def _recorded_loop() -> Loop:
    """A loop of its own to plan on (the one measured is built apart)."""
    model = _model()
    return _loop(model, torch.optim.AdamW(model.parameters(), lr=1e-2))


def _parameters(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _measured(plan: Plan, loop: Loop) -> int:
    with applied(plan), profiler_memory() as truth:
        loop()
    return truth.peak_in_window


@pytest.mark.parametrize("zero", ["after", "before"])
def test_the_step_in_backward_measures_its_prediction_and_trains_bit_for_bit(zero: str) -> None:
    reference, model = _model(), _model()
    _loop(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), zero=zero)()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # built before the block, as fit(step)'s
    loop = _loop(model, optimizer, zero=zero)
    plan, predicted = _plan_of("optimizer-in-backward", loop, {})
    assert plan.levers[0].keeps == "exact"
    fresh = _model()
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    measured = _measured(plan, _loop(fresh, fresh_optimizer, zero=zero))
    # the recorded loop created AdamW's state, as the measured one does: to the byte
    assert measured == predicted, (measured, predicted)
    assert all(torch.equal(a, b) for a, b in zip(_parameters(reference), _parameters(fresh), strict=True))
    assert not fresh_optimizer.state or all(p in fresh_optimizer.state for p in fresh.parameters())
    # undone: the optimizer has its state back and steps as before
    assert len(fresh_optimizer.state) == 8 and all(p.grad is None for p in fresh.parameters())


def test_the_step_in_backward_follows_a_scheduler_of_the_original_optimizer() -> None:
    a, b = _model(), _model()
    opt_a, opt_b = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (a, b))
    sched_a, sched_b = (torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (opt_a, opt_b))
    x = torch.randn(8, 256)
    handle = memtrim.fixes.optimizer_in_backward(opt_b)
    for _ in range(3):
        a(x).square().mean().backward()
        opt_a.step()
        opt_a.zero_grad()
        sched_a.step()
        b(x).square().mean().backward()  # stepped in backward, with the lr the scheduler set
        opt_b.step()  # kept in the loop: every gradient is None by now, nothing is stepped twice
        opt_b.zero_grad()
        sched_b.step()
    handle.remove()
    assert opt_b.param_groups[0]["lr"] == opt_a.param_groups[0]["lr"] == 0.1 * 0.5**3
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_fused_in_backward_measures_its_prediction_and_passes_the_reference_check() -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loop = _loop(model, optimizer)
    plan, predicted = _plan_of("optimizer-in-backward", loop, {"fused": True})
    other = _model()
    other_loop = _loop(other, torch.optim.AdamW(other.parameters(), lr=1e-2))
    plain, _ = _plan_of("optimizer-in-backward", other_loop, {})
    assert predicted < plain.predicted_peak  # the fused step in each hook makes no temporaries
    assert plan.levers[0].keeps == "reference"
    fresh = _model()
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    with StepCapture(values=False) as capture:  # finds the optimizers, copies nothing
        measured = _measured(plan, _loop(fresh, fresh_optimizer))
    # the fused kernel's own few-byte allocations aside
    assert abs(measured - predicted) <= 0.01 * predicted, (measured, predicted)
    assert all(group["fused"] is None for group in fresh_optimizer.param_groups)  # undone
    numerics = reference_check(plan, capture)
    assert numerics.verdict == "pass", numerics
    assert "AdamW: passed" in numerics.note and numerics.max_differences["budget_used"] <= 1.0


def test_fused_measures_its_prediction_and_a_wrong_update_fails_its_check() -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    plan, predicted = _plan_of("optimizer-fused", _loop(model, optimizer))
    fresh = _model()
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    with StepCapture(values=False) as capture:
        measured = _measured(plan, _loop(fresh, fresh_optimizer))
    assert abs(measured - predicted) <= 0.01 * predicted, (measured, predicted)
    assert reference_check(plan, capture).verdict == "pass"
    # the check can fail: the same lever on an optimizer whose fused step would be another update
    from memtrim.plan.optimizer_check import optimizer_check

    wrong = optimizer_check(capture.optimizers, [("optimizer-fused", lambda o: {"fused": True, "lr": 2e-2})])
    assert wrong is not None and wrong.verdict == "fail", wrong


def test_foreach_off_measures_its_prediction_and_passes_the_reference_check() -> None:
    model = _model()
    optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-3, foreach=True)
    plan, predicted = _plan_of("optimizer-foreach-off", _loop(model, optimizer))
    assert plan.levers[0].keeps == "reference"
    fresh = _model()
    fresh_optimizer = torch.optim.RMSprop(fresh.parameters(), lr=1e-3, foreach=True)
    with StepCapture(values=False) as capture:
        measured = _measured(plan, _loop(fresh, fresh_optimizer))
    assert abs(measured - predicted) <= 0.01 * measured, (measured, predicted)
    assert fresh_optimizer.param_groups[0]["foreach"] is True  # undone
    assert reference_check(plan, capture).verdict == "pass"


def test_gradients_zeroed_in_place_set_to_none_measure_their_prediction_bit_for_bit() -> None:
    reference, model = _model(), _model()
    _loop(reference, torch.optim.SGD(reference.parameters(), lr=0.1), zero="before")()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plan, predicted = _plan_of("zero-grad-to-none", _loop(model, optimizer, zero="before"))
    assert plan.levers[0].keeps == "exact" and plan.levers[0].params == {"when": "zero_grad"}
    fresh = _model()
    measured = _measured(plan, _loop(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), zero="before"))
    assert measured <= predicted and abs(measured - predicted) <= 0.01 * predicted, (measured, predicted)
    assert all(torch.equal(a, b) for a, b in zip(_parameters(reference), _parameters(fresh), strict=True))
    # undone: zero_grad zeroes in place again
    fresh(torch.randn(2, 256)).sum().backward()
    torch.optim.SGD(fresh.parameters(), lr=0.1).zero_grad(set_to_none=False)
    assert all(p.grad is not None for p in fresh.parameters())


def test_the_search_never_combines_two_ways_of_running_the_step() -> None:
    model = _model()
    with memtrim.track() as trace:
        _loop(model, torch.optim.AdamW(model.parameters(), lr=1e-2))()
    options = options_of(trace.analysis)
    step_levers = [o for o in options if o.exclusive == "optimizer-step"]
    assert {o.lever for o in step_levers} == {"optimizer-in-backward", "optimizer-fused"}
    found = search(trace.analysis, 1, options)
    seen: list[Candidate] = [*found.front, found.lowest]
    assert all(sum(o.exclusive == "optimizer-step" for o in c.options) <= 1 for c in seen)


def test_a_plan_applied_again_leaves_the_last_blocks_per_parameter_optimizers_alone() -> None:
    # memtrim.fit applies its plan twice (measured, then the numeric check) and the user a third time:
    # the one-parameter optimizers a block built must not be moved into backward by the next block,
    # where each would step its parameter again from empty state
    reference, model = _model(), _model()
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_loop, loop = _loop(reference, reference_optimizer), _loop(model, optimizer)
    plan, _ = _plan_of("optimizer-in-backward", _recorded_loop(), {})
    control = _model()
    control_loop = _loop(control, torch.optim.AdamW(control.parameters(), lr=1e-2))
    control_loop()  # its state exists, as the second block's will; no block before it left anything
    with applied(plan), profiler_memory() as truth:
        control_loop()
    alone = truth.peak_in_window
    reference_loop()
    with applied(plan):
        loop()
        mine = {id(p) for p in model.parameters()}  # other tests' may still be alive in the set
        held = [
            o for o in PER_PARAMETER_OPTIMIZERS if id(o.param_groups[0]["params"][0]) in mine
        ]  # kept alive
    assert len(held) == len(list(model.parameters()))
    reference_loop()
    with applied(plan), profiler_memory() as truth:
        loop()
    assert truth.peak_in_window == alone  # no second state made from nothing
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters(), strict=True))
    assert len(optimizer.state) == len(held)  # every parameter's state is back with the optimizer


def test_of_two_optimizers_over_one_parameter_the_one_with_state_is_changed() -> None:
    model, reference = _model(), _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    loop = _loop(model, optimizer)
    plan, _ = _plan_of("optimizer-in-backward", loop, {})  # steps it: it has state
    _loop(reference, reference_optimizer)()
    stale = torch.optim.AdamW(model.parameters(), lr=1e-2)  # a second one the program never steps
    _loop(reference, reference_optimizer)()
    with applied(plan), pytest.warns(UserWarning, match="which one the loop steps is not known"):
        loop()
    assert not stale.state  # left as built: never stepped in backward
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters(), strict=True))


def test_two_optimizers_over_one_parameter_without_state_are_both_left_as_built() -> None:
    model = _model()
    plan, _ = _plan_of("optimizer-in-backward", _recorded_loop(), {})
    first = torch.optim.AdamW(model.parameters(), lr=1e-2)
    second = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(8, 256)
    with applied(plan), pytest.warns(UserWarning, match="left as built"):
        model(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())  # no step freed them in backward
    assert not first.state and not second.state


class _InPlaceZeroingSGD(torch.optim.SGD):
    """An optimizer library's zero_grad of its own, which zeroes in place without reaching the base
    class's."""

    def zero_grad(self, set_to_none: bool = False, *, zeroed: list[int] | None = None) -> None:
        if zeroed is not None:  # an argument the base class's zero_grad does not take
            zeroed.append(len(self.param_groups))
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()


def test_set_to_none_reaches_an_optimizer_subclass_with_its_own_zero_grad() -> None:
    reference, model = _model(), _model()
    _loop(reference, _InPlaceZeroingSGD(reference.parameters(), lr=0.1), zero="before")()
    plan, predicted = _plan_of(
        "zero-grad-to-none", _loop(model, _InPlaceZeroingSGD(model.parameters(), lr=0.1), zero="before")
    )
    fresh = _model()
    optimizer = _InPlaceZeroingSGD(fresh.parameters(), lr=0.1)
    measured = _measured(plan, _loop(fresh, optimizer, zero="before"))
    assert abs(measured - predicted) <= 0.01 * predicted, (measured, predicted)
    assert all(torch.equal(a, b) for a, b in zip(_parameters(reference), _parameters(fresh), strict=True))
    with applied(plan):
        fresh(torch.randn(2, 256)).sum().backward()
        zeroed: list[int] = []
        optimizer.zero_grad(False, zeroed=zeroed)  # its own arguments reach it
        assert all(p.grad is None for p in fresh.parameters()) and zeroed == [1]
    fresh(torch.randn(2, 256)).sum().backward()
    optimizer.zero_grad(set_to_none=False)  # undone: its own zero_grad zeroes in place again
    assert all(p.grad is not None for p in fresh.parameters())
    assert _InPlaceZeroingSGD.__dict__["zero_grad"].__qualname__ == "_InPlaceZeroingSGD.zero_grad"
