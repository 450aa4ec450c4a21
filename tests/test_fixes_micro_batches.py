"""memtrim.fixes.micro_batches on tiny transformers models (random weights, float64): the loss and every
gradient equal the whole batch's to rounding — a causal LM (label shift), a masked LM and an
encoder-decoder, ragged parts, ignored labels, an upstream gradient other than 1, ``num_items_in_batch``
given, ``torch.autograd.grad`` — the parts see the same random numbers in both passes (dropout), the
model is left alone outside training, and the patch refuses what it cannot do."""

from __future__ import annotations

import copy
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from memtrim.fixes import micro_batches  # noqa: E402


def _llama(**extra: Any) -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, **extra,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).double()


def _bert() -> Any:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertForMaskedLM(config).double()


def _t5() -> Any:
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
        decoder_start_token_id=0,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config).double()


def _batch(rows: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 128, (rows, 16), generator=generator)
    labels = ids.clone()
    labels[0, :11] = -100  # parts count different numbers of tokens
    labels[-1, 3] = -100
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _grads(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("make", [_llama, _bert, _t5], ids=["causal-lm", "masked-lm", "encoder-decoder"])
@pytest.mark.parametrize(("rows", "count"), [(4, 2), (3, 2), (4, 4)], ids=["even", "ragged", "one-row-parts"])
def test_loss_and_gradients_are_the_whole_batch_s(make: Any, rows: int, count: int) -> None:
    model = make()
    patched = copy.deepcopy(model)
    batch = _batch(rows)
    expected = model(**batch)
    (expected.loss * 3.0).backward()  # an upstream gradient other than 1 (a scaled loss)
    handle = micro_batches(patched, count)
    got = patched(**batch)
    assert got.logits is None and got.loss.requires_grad
    (got.loss * 3.0).backward()
    # the loss is computed in fp32 by transformers' loss functions (logits.float()), the rest in fp64
    assert torch.allclose(got.loss.double(), expected.loss.double(), rtol=1e-6, atol=0)
    want, have = _grads(model), _grads(patched)
    assert want.keys() == have.keys() and want
    for name in want:
        assert torch.allclose(have[name], want[name], rtol=1e-5, atol=1e-7), name
    handle.remove()
    assert "forward" not in patched.__dict__


def test_num_items_in_batch_given_makes_the_parts_sums() -> None:
    model = _llama()
    patched = copy.deepcopy(model)
    batch = _batch(4)
    items = (batch["labels"][:, 1:] != -100).sum()
    model(**batch, num_items_in_batch=items).loss.backward()
    micro_batches(patched, 2)
    patched(**batch, num_items_in_batch=items).loss.backward()
    for name, grad in _grads(model).items():
        assert torch.allclose(_grads(patched)[name], grad, rtol=1e-5, atol=1e-7), name


def test_autograd_grad_gets_the_gradients_and_dot_grad_is_untouched() -> None:
    model = _llama()
    patched = copy.deepcopy(model)
    batch = _batch(4)
    params = [p for p in model.parameters()]
    want = torch.autograd.grad(model(**batch).loss, params)
    micro_batches(patched, 2)
    got = torch.autograd.grad(patched(**batch).loss, list(patched.parameters()))
    assert all(p.grad is None for p in patched.parameters())
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def test_a_part_runs_again_with_the_random_numbers_it_first_drew() -> None:
    # dropout: the loss's pass and the gradient's pass of each part must draw the same masks, or the
    # gradient is not the gradient of the loss returned; a part-by-part loop with the same draws is
    # the reference (the whole batch draws other masks: training changes, as the lever says)
    model = _llama(attention_dropout=0.5)
    patched = copy.deepcopy(model)
    batch = _batch(4)
    torch.manual_seed(7)
    parts = [{k: v[i : i + 2] for k, v in batch.items()} for i in (0, 2)]
    counted = [(p["labels"][:, 1:] != -100).sum() for p in parts]
    total = sum(counted)
    losses = [model(**p).loss * (n / total) for p, n in zip(parts, counted, strict=True)]
    sum(losses).backward()
    torch.manual_seed(7)
    micro_batches(patched, 2)
    loss = patched(**batch).loss
    loss.backward()
    assert torch.allclose(loss.double(), sum(losses).double(), rtol=1e-6, atol=0)
    for name, grad in _grads(model).items():
        assert torch.allclose(_grads(patched)[name], grad, rtol=1e-5, atol=1e-7), name


def test_outside_training_the_model_runs_as_it_is() -> None:
    model = _llama()
    micro_batches(model, 2)
    batch = _batch(4)
    assert model(input_ids=batch["input_ids"]).logits is not None  # no labels
    with torch.no_grad():
        assert model(**batch).logits is not None
    model.eval()
    assert model(**batch).logits is not None
    model.train()
    assert model(**batch).logits is None


def test_a_second_backward_says_why_it_cannot() -> None:
    model = _llama()
    micro_batches(model, 2)
    loss = model(**_batch(4)).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward through this loss ran already"):
        loss.backward()


def test_refuses_what_it_cannot_cut() -> None:
    with pytest.raises(TypeError, match="accumulate gradients in the training loop"):
        micro_batches(torch.nn.Linear(2, 2), 2)
    torch.manual_seed(0)
    classifier = transformers.BertForSequenceClassification(
        transformers.BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
    )
    with pytest.raises(TypeError, match="not BertForSequenceClassification"):
        micro_batches(classifier, 2)
    with pytest.raises(ValueError, match="at least 2"):
        micro_batches(_llama(), 1)


def test_a_part_with_no_counted_label_adds_nothing() -> None:
    model = _llama()
    patched = copy.deepcopy(model)
    batch = _batch(4)
    batch["labels"][:2] = -100  # the first of two parts counts no token: its mean would be NaN
    model(**batch).loss.backward()
    micro_batches(patched, 2)
    loss = patched(**batch).loss
    loss.backward()
    assert bool(loss.isfinite())
    for name, grad in _grads(model).items():
        assert torch.allclose(_grads(patched)[name], grad, rtol=1e-5, atol=1e-7), name


def test_a_part_runs_again_under_the_autocast_it_first_ran_in() -> None:
    model = _llama().float()
    micro_batches(model, 2)
    dtypes: list[torch.dtype] = []
    model.model.layers[0].mlp.up_proj.register_forward_hook(lambda m, i, out: dtypes.append(out.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**_batch(4)).loss
    assert dtypes == [torch.bfloat16, torch.bfloat16]  # the loss's pass, part by part
    loss.backward()  # outside the autocast, as training loops call it
    assert dtypes == [torch.bfloat16] * 4


def test_post_accumulate_grad_hooks_fire_once_with_the_whole_batch_s_gradient() -> None:
    # the optimizer step in backward steps from these hooks: once, on the whole gradient, not per part
    model = _llama()
    patched = copy.deepcopy(model)
    batch = _batch(4)
    model(**batch).loss.backward()
    micro_batches(patched, 2)
    seen: dict[str, list[torch.Tensor]] = {}
    for name, p in patched.named_parameters():
        p.register_post_accumulate_grad_hook(
            lambda t, name=name: seen.setdefault(name, []).append(t.grad.clone())
        )
    patched(**batch).loss.backward()
    want = _grads(model)
    assert seen.keys() == want.keys()
    for name, grads in seen.items():
        assert len(grads) == 1 and torch.allclose(grads[0], want[name], rtol=1e-5, atol=1e-7), name
