"""``memtrim.verify.verify_fix``: a change to a live model judged by one training step with and without
it — the loss, every parameter's gradient and every buffer the step updates in place."""

from __future__ import annotations

import os

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest
import torch
import transformers
from torch import nn

import memtrim.fixes
from memtrim.verify import verify_fix


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 1))


def _square(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


X = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


def test_checkpointing_blocks_keeps_the_step_bit_for_bit() -> None:
    report = verify_fix(
        _mlp(), lambda m: memtrim.fixes.checkpoint_modules(m, ["[024]"]), X, loss=_square, mode="exact"
    )
    assert report.passed, report
    names = {q.name for c in report.cases for q in c.quantities}
    assert "grad of input[0]['2.weight']" in names  # every parameter's gradient is compared, by name


@pytest.mark.parametrize("mode", ["exact", "reference"])
def test_a_change_of_what_the_step_computes_fails_in_either_mode(mode: str) -> None:
    def relu(model: nn.Module) -> None:
        model[1] = nn.ReLU()  # a close but different function

    report = verify_fix(_mlp(), relu, X, loss=_square, mode=mode)  # type: ignore[arg-type]
    assert not report.passed


def test_a_fix_that_changes_the_weights_is_refused_by_name() -> None:
    def nudge(model: nn.Module) -> None:
        with torch.no_grad():
            model[2].weight.mul_(1.01)

    report = verify_fix(_mlp(), nudge, X, loss=_square, mode="reference")
    assert not report.passed and "changed 2.weight" in report.failures[0].message


def _plain_checkpoint(model: nn.Module) -> None:
    """What a user writes by hand: torch.utils.checkpoint around module 1's forward."""
    inner = model[1].forward
    model[1].forward = lambda x: torch.utils.checkpoint.checkpoint(inner, x, use_reentrant=False)


def test_a_plainly_checkpointed_batchnorm_in_training_updates_its_running_statistics_twice() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    report = verify_fix(model, _plain_checkpoint, X, loss=_square, mode="exact")
    assert not report.passed
    failed = " ".join(f.message for f in report.failures)
    assert "1.running_mean" in failed and "1.num_batches_tracked" in failed
    # the recompute ran a second training-mode batch norm: twice the batches counted, as a real step would
    assert "candidate 2 vs reference 1" in failed
    model.eval()  # no running statistics are updated: the same step
    assert verify_fix(model, _plain_checkpoint, X, loss=_square, mode="exact").passed


def test_checkpoint_modules_keeps_batchnorm_statistics_of_a_training_step_bit_for_bit() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    for patterns in (["[01]"], ["1"]):
        fix = lambda m, p=patterns: memtrim.fixes.checkpoint_modules(m, p)  # noqa: E731
        report = verify_fix(model, fix, X, loss=_square, mode="exact")
        assert report.passed, report


def test_the_model_handed_in_is_not_changed() -> None:
    model = _mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    verify_fix(
        model, lambda m: memtrim.fixes.checkpoint_modules(m, ["[024]"]), X, loss=_square, mode="reference"
    )
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert "forward" not in model[0].__dict__ and all(p.grad is None for p in model.parameters())


def test_a_fix_that_adds_weights_is_refused_by_name() -> None:
    def grow(model: nn.Module) -> None:
        model.extra = nn.Linear(1, 1)

    report = verify_fix(_mlp(), grow, X, loss=_square, mode="exact")
    assert not report.passed and "added extra.bias, extra.weight" in report.failures[0].message


def _gpt2() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=256, n_positions=16, n_embd=32, n_layer=2, n_head=2, use_cache=False
    )
    return transformers.GPT2LMHeadModel(config)


def test_a_transformers_model_with_tied_embeddings_and_dropout() -> None:
    # GPT-2 in training mode (dropout 0.1 everywhere, the same masks on both sides), lm_head tied to wte
    model = _gpt2()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    fix = lambda m: memtrim.fixes.checkpoint_modules(m, ["transformer.h.*"])  # noqa: E731
    assert verify_fix(model, fix, batch, mode="exact").passed
    report = verify_fix(model, fix, batch, mode="reference")
    assert report.passed, report

    def untie(m: nn.Module) -> None:  # the head gets its own copy of the embedding: a different model
        m.lm_head.weight = nn.Parameter(m.lm_head.weight.detach().clone())

    report = verify_fix(model, untie, batch, mode="reference")
    assert not report.passed and "added lm_head.weight" in report.failures[0].message


def test_bad_arguments_name_the_fix() -> None:
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        verify_fix(object(), lambda m: None, X)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="callable"):
        verify_fix(_mlp(), None, X)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mode"):
        verify_fix(_mlp(), lambda m: None, X, mode="close")  # type: ignore[arg-type]
    report = verify_fix(_mlp(), lambda m: None, X)  # the Sequential returns a [4, 1] tensor, no loss
    assert not report.passed and "loss=lambda model, batch" in report.failures[0].message
