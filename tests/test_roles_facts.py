"""Facts the recorder takes (parameter, gradient, optimizer state, buffer), in bytes against the
program's own tensors, and the hooks it takes them with: removed at the end, nested, harmless."""

from __future__ import annotations

import pytest
import torch
import torch.nn.modules.module as module_hooks
import torch.optim.optimizer as optimizer_hooks

import memtrim
from memtrim.analysis.roles import Role
from memtrim.trace.model import Fact, Phase


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def role_bytes(trace: memtrim.Trace, role: str, *, preexisting: bool | None = None) -> int:
    return sum(
        a.bytes
        for a in trace.allocations
        if trace.role(a) == role and (preexisting is None or a.preexisting == preexisting)
    )


def test_parameters_and_leaves_from_before_the_region() -> None:
    layer = torch.nn.Linear(16, 8)
    frozen = torch.nn.Parameter(torch.randn(8), requires_grad=False)
    leaf = torch.randn(4, 16, requires_grad=True)
    data = torch.randn(4, 16)
    with memtrim.track() as trace:
        (layer(leaf + data) + frozen).sum().backward()
    assert role_bytes(trace, "parameter", preexisting=True) == nbytes(layer.weight, layer.bias, frozen, leaf)
    assert role_bytes(trace, "input") == nbytes(data)
    assert role_bytes(trace, "gradient") == nbytes(layer.weight.grad, layer.bias.grad, leaf.grad)


def test_parameters_and_buffers_made_inside_the_region() -> None:
    with memtrim.track() as trace:
        norm = torch.nn.BatchNorm1d(32)
        norm(torch.randn(8, 32)).sum().backward()
    made = trace.analysis.breakdown_at(trace.log.end_tick)
    assert made.made[Role.PARAMETER] == nbytes(norm.weight, norm.bias)
    assert made.made[Role.BUFFER] == nbytes(*norm.buffers())  # running stats and the batch count
    assert made.made[Role.GRADIENT] == nbytes(norm.weight.grad, norm.bias.grad)


def test_buffers_from_before_the_region_are_found_through_the_modules_run() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.BatchNorm1d(32))
    with memtrim.track() as trace:
        model(torch.randn(8, 4)).sum().backward()  # updates the running stats in place
    assert role_bytes(trace, "buffer", preexisting=True) == nbytes(*model[1].buffers())


def test_a_gradient_autograd_cannot_steal_is_copied_under_its_node() -> None:
    w = torch.randn(1000, requires_grad=True)
    with memtrim.track() as trace:
        w.sum().backward()  # the incoming gradient is an expanded view: AccumulateGrad copies it
    grads = [a for a in trace.allocations if Fact.GRADIENT in a.facts]
    assert [a.bytes for a in grads] == [nbytes(w.grad)]
    assert grads[0].node == "torch::autograd::AccumulateGrad"
    assert trace.role(grads[0]) == "gradient"


def test_a_gradient_from_before_the_region_accumulated_in_place() -> None:
    w = torch.randn(1000, requires_grad=True)
    (w * 2).sum().backward()
    with memtrim.track() as trace:
        (w * 3).sum().backward()  # adds into the existing .grad: no new storage
    assert role_bytes(trace, "gradient", preexisting=True) == nbytes(w.grad)
    assert role_bytes(trace, "parameter", preexisting=True) == nbytes(w)


@pytest.mark.filterwarnings("ignore:Using backward.. with create_graph=True")
def test_gradients_of_a_second_order_step_made_out_of_place() -> None:
    w = torch.randn(100, requires_grad=True)
    with memtrim.track() as trace:
        (w**3).sum().backward(create_graph=True)  # grad mode on: .grad is a new tensor each time
        w.grad.sum().backward()  # type: ignore[union-attr]
    alive = trace.analysis.breakdown_at(trace.log.end_tick)
    assert alive.made[Role.GRADIENT] == nbytes(w.grad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("make", "state_names"),
    [
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), {"momentum_buffer"}),
        (lambda ps: torch.optim.Adam(ps, foreach=False), {"exp_avg", "exp_avg_sq", "step"}),
        (lambda ps: torch.optim.AdamW(ps, foreach=True), {"exp_avg", "exp_avg_sq", "step"}),
    ],
    ids=["sgd", "adam", "adamw-foreach"],
)
def test_optimizer_state(make: object, state_names: set[str]) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = make(list(model.parameters()))  # type: ignore[operator]
    with memtrim.track() as trace:
        model(torch.randn(8, 16)).sum().backward()
        optimizer.step()
    state = [t for s in optimizer.state.values() for name, t in s.items() if name in state_names]
    assert state and all(set(s) == state_names for s in optimizer.state.values())
    end = trace.analysis.breakdown_at_phase_end[Phase.OPTIMIZER]
    assert end.made[Role.OPTIMIZER_STATE] == nbytes(*state)
    assert end.made[Role.GRADIENT] == nbytes(*(p.grad for p in model.parameters()))  # type: ignore[misc]
    assert end.preexisting[Role.PARAMETER] == nbytes(*model.parameters())


class _FailsAfterItsState(torch.optim.Adam):
    def step(self, closure: object = None) -> None:  # type: ignore[override]
        super().step()
        raise RuntimeError("step failed")


def test_state_of_an_optimizer_whose_step_raised() -> None:
    w = torch.nn.Parameter(torch.randn(256))
    optimizer = _FailsAfterItsState([w], foreach=False)
    with pytest.raises(RuntimeError, match="step failed"), memtrim.track() as trace:
        (w * 2).sum().backward()
        optimizer.step()
    state = optimizer.state[w]
    expected = nbytes(state["exp_avg"], state["exp_avg_sq"], state["step"])
    assert role_bytes(trace, "optimizer_state") == expected


def test_an_optimizer_stepping_in_backward_makes_state_not_gradients() -> None:
    model = torch.nn.Linear(64, 64)
    optimizers = {p: torch.optim.Adam([p], foreach=False) for p in model.parameters()}

    kept: list[torch.Tensor] = []

    def step(p: torch.Tensor) -> None:
        kept.append(p.grad.abs().detach())  # type: ignore[union-attr]  # a detach in a hook: not a steal
        optimizers[p].step()  # type: ignore[index]
        optimizers[p].zero_grad()  # type: ignore[index]

    handles = [p.register_post_accumulate_grad_hook(step) for p in model.parameters()]
    try:
        with memtrim.track() as trace:
            model(torch.randn(4, 64)).sum().backward()
    finally:
        for handle in handles:
            handle.remove()
    state = [t for opt in optimizers.values() for s in opt.state.values() for t in s.values()]
    assert role_bytes(trace, "optimizer_state") == nbytes(*state)
    abs_made = [a for a in trace.allocations if a.op == "aten.abs.default"]
    assert len(abs_made) == len(kept) == 2 and not any(Fact.GRADIENT in a.facts for a in abs_made)
    assert not any(Fact.GRADIENT in a.facts and Fact.OPTIMIZER_STATE in a.facts for a in trace.allocations)


def _hook_counts() -> tuple[int, ...]:
    return (
        len(module_hooks._global_parameter_registration_hooks),
        len(module_hooks._global_buffer_registration_hooks),
        len(optimizer_hooks._global_optimizer_pre_hooks),
        len(optimizer_hooks._global_optimizer_post_hooks),
    )


def test_hooks_are_removed_at_the_end_also_after_an_exception_and_nest() -> None:
    before = _hook_counts()
    with memtrim.track() as outer:
        assert _hook_counts() == tuple(n + 1 for n in before)
        with pytest.raises(RuntimeError, match="inner"), memtrim.track() as inner:
            assert _hook_counts() == tuple(n + 2 for n in before)
            layer = torch.nn.Linear(8, 8)
            raise RuntimeError("inner")
        assert _hook_counts() == tuple(n + 1 for n in before)
        layer(torch.randn(2, 8)).sum().backward()
    assert _hook_counts() == before
    weight = nbytes(layer.weight, layer.bias)
    # made inside both regions: both say parameter; the inner one ended before any gradient
    assert role_bytes(inner, "parameter") == role_bytes(outer, "parameter") == weight
    assert role_bytes(outer, "gradient") == weight and role_bytes(inner, "gradient") == 0


def test_tracking_leaves_the_training_step_unchanged() -> None:
    def run(tracked: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
        optimizer = torch.optim.AdamW(model.parameters())
        x = torch.randn(16, 8)
        for _ in range(2):
            if tracked:
                with memtrim.track():
                    model(x).square().mean().backward()
                    optimizer.step()
            else:
                model(x).square().mean().backward()
                optimizer.step()
            optimizer.zero_grad()
        return [t.detach().clone() for t in (*model.parameters(), *model.buffers())]

    assert all(torch.equal(a, b) for a, b in zip(run(True), run(False), strict=True))


def test_a_parameter_registered_inside_the_region_is_the_users_object() -> None:
    weight = torch.nn.Parameter(torch.randn(4, 4))
    with memtrim.track():
        module = torch.nn.Module()
        module.weight = weight
        module.register_buffer("mask", torch.ones(4))
    assert module.weight is weight and module.mask.shape == (4,)
