"""The chunked loss with the elementwise chain between the lm_head and the loss (scale, softcap) and with a
transformers causal LM's loss semantics, against the unfused loss computed the way the model computes it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from memtrim.fixes import causal_lm_cross_entropy, chunked_linear_cross_entropy


def _grads(loss_fn, *tensors):
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    loss = loss_fn(*leaves)
    loss.backward()
    return loss.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize(
    ("scale", "cap", "reference"),
    [
        (0.5, None, lambda h, w: (h @ w.T) * 0.5),
        (1.0, 3.0, lambda h, w: torch.tanh((h @ w.T) / 3.0) * 3.0),  # Gemma 2's final-logit softcap
        (2.5 / 0.7, 2.5, lambda h, w: ((h @ w.T) / 0.7).tanh() * 2.5),  # (h @ W.T / T).tanh() * c
    ],
)
@pytest.mark.parametrize("chunk", [3, None])
def test_chain_matches_unfused_loss_and_gradients(scale, cap, reference, chunk):
    torch.manual_seed(0)
    h, w = torch.randn(13, 16, dtype=torch.float64), torch.randn(700, 16, dtype=torch.float64)
    y = torch.randint(0, 700, (13,))
    y[4] = -100
    ref, ref_g = _grads(lambda h, w: F.cross_entropy(reference(h, w), y), h, w)
    got, got_g = _grads(
        lambda h, w: chunked_linear_cross_entropy(h, w, y, chunk_size=chunk, logit_scale=scale, softcap=cap),
        h,
        w,
    )
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=0)
    for a, b in zip(got_g, ref_g, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13)


def _hf_causal_lm_loss(logits, labels, vocab, num_items_in_batch=None):
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(logits, labels, vocab, num_items_in_batch=num_items_in_batch)


@pytest.mark.parametrize("num_items", [None, 7])
@pytest.mark.parametrize("cap", [None, 30.0])
def test_causal_lm_loss_matches_transformers(num_items, cap):
    torch.manual_seed(1)
    h, w = torch.randn(2, 9, 16), torch.randn(300, 16)
    labels = torch.randint(0, 300, (2, 9))
    labels[0, 3] = -100

    def hf(h, w):
        logits = h @ w.T
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return _hf_causal_lm_loss(logits, labels, 300, num_items)

    ref, ref_g = _grads(hf, h, w)
    got, got_g = _grads(
        lambda h, w: causal_lm_cross_entropy(
            h, w, labels, num_items_in_batch=num_items, softcap=cap, chunk_size=4
        ),
        h,
        w,
    )
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_g, ref_g, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_unshifted_labels_are_not_shifted():
    torch.manual_seed(2)
    h, w, y = torch.randn(5, 8), torch.randn(40, 8), torch.randint(0, 40, (5,))
    torch.testing.assert_close(causal_lm_cross_entropy(h, w, y, shift=False), F.cross_entropy(h @ w.T, y))


def test_bf16_softcap_upcasts_as_transformers_does():
    torch.manual_seed(3)
    h, w = torch.randn(2, 6, 16, dtype=torch.bfloat16), torch.randn(90, 16, dtype=torch.bfloat16)
    labels = torch.randint(0, 90, (2, 6))
    ref = _hf_causal_lm_loss(torch.tanh((h @ w.T).float() / 5.0) * 5.0, labels, 90)
    got = causal_lm_cross_entropy(h, w, labels, softcap=5.0)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_bad_softcap_is_a_clear_error():
    h, w, y = torch.randn(3, 4), torch.randn(10, 4), torch.randint(0, 10, (3,))
    with pytest.raises(ValueError, match="softcap must be a positive"):
        chunked_linear_cross_entropy(h, w, y, softcap=0.0)
