"""The eager-attention rule: a plain matmul-softmax-matmul attention and transformers' eager attention
fire at the softmax; ``F.scaled_dot_product_attention`` (the printed fix) and ``attn_implementation="sdpa"``
(the printed code, run as printed) are silent, keep the results (memtrim.verify, reference mode), and
lower the torch.profiler peak by the predicted bytes."""

from __future__ import annotations

import math
import os

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # tiny vocabularies make it warn about token ids

import pytest
import torch
import torch.nn.functional as F
import transformers
from doctor_support import assert_fix_measures, findings, measure

from memtrim.verify import verify

BATCH, HEADS, SEQ, HEAD_DIM = 2, 4, 256, 32
CAUSAL = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # planted: scores
    scores = scores.masked_fill(~CAUSAL[: q.shape[-2], : q.shape[-2]], float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # planted: softmax
    return probs @ v  # planted: values


def attend_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # the printed fix: the causal mask as is_causal=True, the scale as written
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1 / math.sqrt(q.shape[-1]))


def _qkv() -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    return tuple(
        torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, generator=gen, requires_grad=True) for _ in range(3)
    )


def _step(attention, q, k, v):  # type: ignore[no-untyped-def]
    def run() -> None:
        attention(q * 1.0, k * 1.0, v * 1.0).square().sum().backward()

    return run


def test_plain_attention_fires_at_the_softmax_and_sdpa_measures_its_prediction() -> None:
    q, k, v = _qkv()
    before = measure(_step(attend, q, k, v))
    (finding,) = findings(before.trace, "eager-attention")
    assert finding.site is not None and finding.site.line == line_of_here("planted: softmax")
    assert [s.line for s in finding.sites] == [
        line_of_here("planted: softmax"),
        line_of_here("planted: scores"),
        line_of_here("planted: scores") + 1,
        line_of_here("planted: values"),
    ]
    square = BATCH * HEADS * SEQ * SEQ * 4
    # forward: scores, scaled, masked, probabilities; backward: the gradient of each
    assert sorted(a.bytes for a in finding.allocations) == [square] * 8
    assert finding.keeps == "reference"
    assert "torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=" in finding.fix
    assert "is_causal=True" in finding.fix and "scale=" in finding.fix
    # what SDPA keeps instead: one float32 logsumexp per query row
    assert [a.bytes for a in finding.edits.add] == [BATCH * HEADS * SEQ * 4]
    grads = [t.grad for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    after = measure(_step(attend_sdpa, q, k, v))
    assert_fix_measures(finding, before, after)
    torch.testing.assert_close([t.grad for t in (q, k, v)], grads)
    assert findings(after.trace, "eager-attention") == []


def line_of_here(marker: str) -> int:
    import inspect
    from pathlib import Path

    lines = Path(inspect.getfile(attend)).read_text().splitlines()
    hits = [n for n, text in enumerate(lines, start=1) if text.rstrip().endswith(f"# {marker}")]
    assert len(hits) == 1, marker
    return hits[0]


def test_the_printed_sdpa_rewrite_verifies_no_less_accurate_on_outputs_and_gradients() -> None:
    shape = (1, 2, 32, 8)
    inputs = tuple(torch.randn(shape, requires_grad=True) for _ in range(3))
    verify(attend, attend_sdpa, inputs, mode="reference", seeds=(0,), memory=False).assert_ok()


def test_attention_with_dropout_on_cpu_is_left_alone() -> None:
    # SDPA runs dropout on CPU on its math path, which makes the same [seq, seq] tensors
    q, k, v = _qkv()

    def dropped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        return F.dropout(torch.softmax(scores, dim=-1), p=0.1) @ v

    trace = measure(_step(dropped, q, k, v)).trace
    assert findings(trace, "eager-attention") == []
    for t in (q, k, v):
        t.grad = None
    trace = measure(
        _step(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.1), q, k, v)
    ).trace
    assert "aten._safe_softmax.default" in {op.op for op in trace.log.ops}  # SDPA's own math path
    assert findings(trace, "eager-attention") == []


def test_a_softmax_that_feeds_no_matmul_is_not_attention() -> None:
    x = torch.randn(BATCH, HEADS, SEQ, SEQ, requires_grad=True)
    y = torch.randn(BATCH, HEADS, SEQ, SEQ)
    trace = measure(lambda: (torch.softmax((x * 1.0) @ y, dim=-1) * y).sum().backward()).trace
    assert findings(trace, "eager-attention") == []


def _tiny(kind: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    common = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=SEQ, attn_implementation="eager", bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    if kind == "mistral":  # grouped-query heads: eager repeats k and v (repeat_kv)
        config = transformers.MistralConfig(num_key_value_heads=2, sliding_window=None, **common)
        return transformers.MistralForCausalLM(config)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(num_key_value_heads=4, **common))


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_transformers_eager_attention_fires_and_the_printed_code_measures_its_prediction(kind: str) -> None:
    model = _tiny(kind)
    ids = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(1))
    losses = []

    def step() -> None:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())

    before = measure(step)
    (finding,) = findings(before.trace, "eager-attention")
    assert finding.site is not None and finding.site.function == "eager_attention_forward"
    assert 'attn_implementation="sdpa"' in finding.fix
    assert finding.code == 'model.set_attn_implementation("sdpa")'
    assert [name for name, _ in finding.binds] == ["model"]
    square = 2 * 4 * SEQ * SEQ * 4
    assert sum(a.bytes == square for a in finding.allocations) >= 2 * 6  # per layer: 3 forward, 3 backward
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    exec(finding.code, {"model": model})  # as printed
    assert model.config._attn_implementation == "sdpa"
    after = measure(step)
    assert_fix_measures(finding, before, after)
    torch.testing.assert_close(losses[1], losses[0])
    torch.testing.assert_close([p.grad for p in model.parameters()], grads, rtol=1e-4, atol=1e-6)
    assert findings(after.trace, "eager-attention") == []
