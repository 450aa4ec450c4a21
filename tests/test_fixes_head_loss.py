"""``memtrim.fixes.chunked_head_loss``: the plain-code ``F.cross_entropy(model(x).logits.view(-1, V), y)``
without the ``[tokens, vocab]`` logits, the training code unchanged.

Memory is judged by torch.profiler's allocation events (no block of the logits' size is made) and sizes
from the program's own tensors; numerics by ``memtrim.verify.verify_fix`` (no less accurate than the original
against a float64 oracle) and by the results of everything a program may do with the logits instead."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from groundtruth import profiler_memory
from torch import nn

import memtrim
from memtrim.cases import gpt
from memtrim.fixes import DeferredLogits, chunked_head_loss
from memtrim.verify import verify_fix

CFG = gpt.GPTConfig(vocab=4096, context=32, width=48, layers=2, heads=2)
WEIGHT_BYTES = CFG.vocab * CFG.width * 4
"""The largest block the patched step needs: the head's weight gradient (the logits are 2-8x it)."""


def _pair() -> tuple[gpt.GPT, gpt.GPT]:
    return gpt.GPT(CFG, seed=0), gpt.GPT(CFG, seed=0)


def _logits_bytes(x: torch.Tensor) -> int:
    return x.numel() * CFG.vocab * 4


def test_the_loss_and_every_gradient_match_the_unpatched_step_and_no_logits_are_made() -> None:
    plain, patched = _pair()
    x, y = gpt.batch(CFG, 4)
    handle = chunked_head_loss(patched.lm_head, chunk_size=24)

    expected = gpt.original_loss(plain, x, y)
    expected.backward()
    with profiler_memory() as truth:
        out = patched(x)
        assert isinstance(out.logits, DeferredLogits)
        assert out.logits.shape == (4, CFG.context, CFG.vocab) and out.logits.dtype == torch.float32
        loss = F.cross_entropy(out.logits.view(-1, CFG.vocab), y.view(-1))
        loss.backward()
    torch.testing.assert_close(loss, expected)
    for (name, p), q in zip(plain.named_parameters(), patched.parameters(), strict=True):
        assert q.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, msg=name)
    chunk_logits = 24 * CFG.vocab * 4
    assert max(truth.allocated_sizes) <= WEIGHT_BYTES < _logits_bytes(x)
    assert chunk_logits in truth.allocated_sizes  # the loss worked in tiles of 24 tokens
    handle.remove()
    assert type(patched(x).logits) is torch.Tensor


def test_verify_fix_proves_it_no_less_accurate_than_the_original_against_float64() -> None:
    layer = gpt.GPT(CFG, seed=1).lm_head
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(77, CFG.width, generator=generator)
    target = torch.randint(0, CFG.vocab, (77,), generator=generator)
    target[5] = -100

    def loss(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(m(batch[0]).view(-1, CFG.vocab), batch[1])

    report = verify_fix(
        layer, lambda m: chunked_head_loss(m, chunk_size=16), (hidden, target), loss=loss, mode="reference"
    )
    assert report.passed, report


@pytest.mark.parametrize(
    "loss_of",
    [
        # transformers' shift-and-upcast, written by hand
        lambda logits, y: F.cross_entropy(
            logits[:, :-1, :].float().reshape(-1, CFG.vocab), y[:, 1:].reshape(-1), ignore_index=-100
        ),
        lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum"),
        lambda logits, y: F.cross_entropy(
            logits.contiguous().view(-1, CFG.vocab), y.view(-1), label_smoothing=0.1, ignore_index=3
        ),
        lambda logits, y: F.cross_entropy(logits[1].to(torch.float32), y[1], reduction="none").sum(),
    ],
    ids=["shift-float", "flatten-sum", "contiguous-smoothing", "index-to-none"],
)
def test_what_a_loss_does_on_the_way_is_done_to_the_hidden_states(loss_of: object) -> None:
    plain, patched = _pair()
    x, y = gpt.batch(CFG, 3)
    chunked_head_loss(patched.lm_head, chunk_size=20)
    expected = loss_of(plain(x).logits, y)  # type: ignore[operator]
    expected.backward()
    with profiler_memory() as truth:
        loss = loss_of(patched(x).logits, y)  # type: ignore[operator]
        loss.backward()
    torch.testing.assert_close(loss, expected)
    for p, q in zip(plain.parameters(), patched.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad)
    assert max(truth.allocated_sizes) <= WEIGHT_BYTES < _logits_bytes(x)


def test_any_other_use_makes_the_real_logits_once_and_computes_what_it_computed_before() -> None:
    plain, patched = _pair()
    x, y = gpt.batch(CFG, 2)
    chunked_head_loss(patched.lm_head)
    logits, reference = patched(x).logits, plain(x).logits
    assert torch.equal(logits.argmax(-1), reference.argmax(-1))
    assert torch.equal((logits * 2.0)[:, :3], (reference * 2.0)[:, :3])
    assert repr(logits) == repr(reference)
    shifted = logits[:, 1:, :]
    assert torch.equal(shifted.softmax(-1), reference[:, 1:, :].softmax(-1))
    # the loss after another use still equals the original's
    loss = F.cross_entropy(logits.view(-1, CFG.vocab), y.view(-1))
    torch.testing.assert_close(loss, F.cross_entropy(reference.view(-1, CFG.vocab), y.view(-1)))


def test_no_grad_autocast_and_a_changed_input_are_left_to_the_layer_or_refused() -> None:
    _, patched = _pair()
    x, _ = gpt.batch(CFG, 2)
    chunked_head_loss(patched.lm_head)
    with torch.no_grad():
        assert type(patched(x).logits) is torch.Tensor  # evaluation: the layer's own forward
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert type(patched(x).logits) is torch.Tensor
    hidden = torch.randn(2, 5, CFG.width, requires_grad=True)
    logits = patched.lm_head(hidden)
    with torch.no_grad():
        hidden.add_(1.0)
    with pytest.raises(
        RuntimeError, match=r"chunked_head_loss: the loss needs the logits .* changed in place"
    ):
        F.cross_entropy(logits.view(-1, CFG.vocab), torch.zeros(10, dtype=torch.long))


def test_bad_arguments_name_the_fix() -> None:
    class OwnForward(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    with pytest.raises(TypeError, match="chunked_linear_cross_entropy"):
        chunked_head_loss(OwnForward(4, 8))
    with pytest.raises(ValueError, match="at least 1"):
        chunked_head_loss(nn.Linear(4, 8), chunk_size=0)
    with pytest.raises(TypeError, match="an int or None"):
        chunked_head_loss(nn.Linear(4, 8), chunk_size=2.5)  # type: ignore[arg-type]


def test_fake_tensors_measure_the_step_without_the_logits() -> None:
    cfg = gpt.GPTConfig(vocab=32000, context=256, width=256, layers=2, heads=4)
    x, y = gpt.batch(cfg, 8)

    def peak(patch: bool) -> int:
        model = gpt.GPT(cfg, seed=0)
        handle = chunked_head_loss(model.lm_head) if patch else None
        with memtrim.track(fake=True) as trace:
            loss = F.cross_entropy(model(x).logits.view(-1, cfg.vocab), y.view(-1))
            loss.backward()
        if handle is not None:
            handle.remove()
        return trace.peak_bytes

    logits = x.numel() * cfg.vocab * 4
    unpatched, patched = peak(False), peak(True)
    # the unfused loss holds the logits and their log-softmax (and its gradient): at least two of them
    assert unpatched >= 2 * logits
    assert unpatched - patched >= 2 * logits - logits // 8
