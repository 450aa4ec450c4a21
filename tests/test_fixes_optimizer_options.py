"""memtrim.fixes.optimizer_options sets options on a live optimizer (its state kept, remove() undoes it);
memtrim.verify.verify_optimizer proves an option change no less accurate, and fails on one that is not.
Ground truth: torch's own optimizer built with the options and loaded with the same state."""

from __future__ import annotations

import copy

import pytest
import torch

from memtrim.fixes import optimizer_options
from memtrim.fixes.optimizer import fusable
from memtrim.verify import verify_optimizer


def _trained(steps: int, **options: object) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, **options)  # type: ignore[arg-type]
    for n in range(steps):
        _step(model, optimizer, n)
    return model, optimizer


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, n: int) -> None:
    gen = torch.Generator().manual_seed(100 + n)
    x = torch.randn(4, 6, generator=gen)
    optimizer.zero_grad()
    model(x).square().mean().backward()
    optimizer.step()


def test_fused_on_a_for_loop_optimizer_steps_as_torchs_fused_optimizer_with_the_same_state() -> None:
    model, optimizer = _trained(2, foreach=False)
    twin = copy.deepcopy(model)
    reference = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)
    saved = copy.deepcopy(
        optimizer.state_dict()
    )  # its groups say fused=None: torch's fused step is asked for
    saved["param_groups"] = [{**g, "fused": True} for g in saved["param_groups"]]
    reference.load_state_dict(saved)
    assert all(g["fused"] is True for g in reference.param_groups)

    handle = optimizer_options(optimizer, fused=True, foreach=False)
    assert all(g["fused"] is True and g["foreach"] is False for g in optimizer.param_groups)
    _step(model, optimizer, 2)
    _step(twin, reference, 2)
    for mine, theirs in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    steps = [optimizer.state[p]["step"] for p in model.parameters()]
    assert [float(s) for s in steps] == [3.0] * len(steps)

    handle.remove()
    assert all(g["fused"] is None and g["foreach"] is False for g in optimizer.param_groups)
    _step(model, optimizer, 3)  # the for-loop step takes the state back
    assert [float(optimizer.state[p]["step"]) for p in model.parameters()] == [4.0] * len(steps)


def test_foreach_off_updates_within_rounding_of_the_foreach_step() -> None:
    model, optimizer = _trained(2, foreach=True)
    twin, twin_optimizer = _trained(2, foreach=True)
    handle = optimizer_options(optimizer, foreach=False)
    _step(model, optimizer, 2)
    _step(twin, twin_optimizer, 2)
    for mine, theirs in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)
    handle.remove()
    assert all(g["foreach"] is True for g in optimizer.param_groups)


@pytest.mark.parametrize(
    ("build", "options", "error", "words"),
    [
        (lambda ps: torch.optim.SGD(ps, lr=0.1), {"fused": True}, ValueError, "Adam and AdamW, not SGD"),
        (lambda ps: torch.optim.AdamW(ps), {"fuse": True}, ValueError, "no option 'fuse'"),
        (lambda ps: torch.optim.AdamW(ps), {}, ValueError, "e.g. fused=True"),
        (lambda ps: torch.optim.AdamW(ps), {"fused": True, "foreach": True}, ValueError, "foreach=False"),
        (lambda ps: torch.optim.AdamW(ps, capturable=True), {"fused": True}, ValueError, "capturable=True"),
        (lambda ps: ps, {"fused": True}, TypeError, "torch.optim.Optimizer, not list"),
    ],
)
def test_an_option_that_does_not_apply_is_refused_and_nothing_changes(
    build: object, options: dict[str, object], error: type[Exception], words: str
) -> None:
    params = [torch.nn.Parameter(torch.ones(3))]
    optimizer = build(params)  # type: ignore[operator]
    before = copy.deepcopy(getattr(optimizer, "param_groups", None))
    with pytest.raises(error, match=words):
        optimizer_options(optimizer, **options)
    if before is not None:
        assert [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups] == [
            {k: v for k, v in g.items() if k != "params"} for g in before
        ]


def test_fusable_names_an_integer_parameter() -> None:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))])
    assert fusable(optimizer) is None
    optimizer.param_groups[0]["params"].append(torch.zeros(2, dtype=torch.int64))
    assert "torch.int64" in (fusable(optimizer) or "")


def test_verify_optimizer_passes_fused_and_leaves_the_optimizer_alone() -> None:
    _, optimizer = _trained(0, foreach=True)
    groups = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups])
    report = verify_optimizer(optimizer, fused=True, foreach=False)
    assert report.passed, str(report)
    report.assert_ok()
    assert [name for name, _ in report] == ["AdamW"]
    assert not optimizer.state
    assert [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups] == groups


def test_verify_optimizer_fails_an_option_that_changes_the_update() -> None:
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW([{"params": [model.weight]}, {"params": [model.bias], "lr": 1e-4}], lr=1e-3)
    report = verify_optimizer(optimizer, lr=0.5)
    assert not report.passed
    assert [name for name, _ in report] == ["AdamW group 0", "AdamW group 1"]
    with pytest.raises(AssertionError, match="AdamW group 0"):
        report.assert_ok()


def test_verify_optimizer_refuses_bad_input() -> None:
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"):
        verify_optimizer(object())  # type: ignore[arg-type]
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    with pytest.raises(ValueError, match=r"e\.g\. fused=True"):
        verify_optimizer(optimizer)
    with pytest.raises(ValueError, match="SGD takes no option 'betas'"):
        verify_optimizer(optimizer, betas=(0.9, 0.99))
