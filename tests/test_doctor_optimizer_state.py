"""The optimizer-state rule: gradients and Adam's state at the peak of a training loop. The step fused
into backward (``memtrim.fixes.optimizer_in_backward``) trains bit for bit like the loop and lowers the
torch.profiler peak by the prediction; Adafactor's state is the size the finding predicts (from the
optimizer's own state tensors); clipping the global gradient norm makes the lever change training."""

from __future__ import annotations

import copy

import pytest
import torch
from doctor_support import assert_fix_measures, findings, measure
from torch import nn

from memtrim.fixes import optimizer_in_backward

WIDTH, LAYERS, STEPS = 512, 4, 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


X = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(1))


def _loss(model: nn.Module) -> torch.Tensor:
    return model(X).square().mean()


def _loop(model: nn.Module, optimizer: torch.optim.Optimizer, clip: bool = False):  # type: ignore[no-untyped-def]
    def run() -> None:
        for _ in range(STEPS):
            _loss(model).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()

    return run


def _finding(found, text: str):  # type: ignore[no-untyped-def]
    (d,) = [d for d in found if text in d.fix]
    return d


def test_the_step_in_backward_trains_bit_for_bit_and_measures_its_prediction() -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    reference = copy.deepcopy((model, optimizer))
    before = measure(_loop(model, optimizer))
    found = findings(before.trace, "optimizer-state")
    d = _finding(found, "optimizer_in_backward")
    parameters = sum(p.numel() * 4 for p in model.parameters())
    assert d.bytes_at_stake == STEPS * parameters  # every step's gradients
    assert d.keeps == "exact" and d.proof is not None
    assert [name for name, _ in d.binds] == ["optimizer"]

    fused, fused_optimizer = copy.deepcopy(reference)
    namespace = {"optimizer": fused_optimizer}
    exec(d.code, namespace)  # as printed
    handle = namespace["handle"]

    def in_backward() -> None:
        for _ in range(STEPS):
            _loss(fused).backward()

    after = measure(in_backward)
    assert_fix_measures(d, before, after)
    assert all(p.grad is None for p in fused.parameters())
    # both loops took STEPS steps from the same start: the same parameters, bit for bit
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fused.parameters(), strict=True))
    handle.remove()
    assert fused_optimizer.state[next(fused.parameters())]["step"] == STEPS  # the state came back


def test_the_printed_proof_runs_and_holds() -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trace = measure(_loop(model, optimizer)).trace
    d = _finding(findings(trace, "optimizer-state"), "optimizer_in_backward")
    assert d.proof is not None
    exec(
        d.proof,
        {"model": model, "optimizer": optimizer, "batch": X, "loss_fn": lambda m, x: m(x).square().mean()},
    )


def test_clipping_the_global_norm_makes_the_step_in_backward_change_training() -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trace = measure(_loop(model, optimizer, clip=True)).trace
    d = _finding(findings(trace, "optimizer-state"), "optimizer_in_backward")
    assert d.keeps == "changes-training" and d.proof is None
    assert any("clipping" in reason for reason in d.safe_because)


def test_adafactor_state_is_the_predicted_size_and_it_changes_training() -> None:
    model = _model()
    before = measure(_loop(model, torch.optim.AdamW(model.parameters(), lr=1e-3)))
    d = _finding(findings(before.trace, "optimizer-state"), "Adafactor")
    assert d.keeps == "changes-training" and d.proof is None
    adam_moments = 2 * sum(p.numel() * 4 for p in model.parameters())
    assert sum(a.bytes for a in d.allocations) == adam_moments
    predicted_state = sum(d.edits.resize.values())
    fresh = _model()
    adafactor = torch.optim.Adafactor(fresh.parameters(), lr=1e-3)
    after = measure(_loop(fresh, adafactor))
    state = sum(t.nbytes for s in adafactor.state.values() for k, t in s.items() if k != "step")
    assert predicted_state == state  # [rows, 1] + [1, cols] per matrix, the vector per bias
    # the what-if changes the state only: Adafactor's step makes fewer temporaries than Adam's too
    assert after.peak <= d.peak_after < before.peak


def test_optimizer_in_backward_refuses_what_is_not_an_optimizer() -> None:
    with pytest.raises(TypeError, match="pass the optimizer your loop steps"):
        optimizer_in_backward(_model())  # type: ignore[arg-type]
