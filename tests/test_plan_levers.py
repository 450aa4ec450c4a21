"""The transformers levers of memtrim.plan on tiny GPT-2s: ``use-cache-off`` (the doctor's
cache-in-training finding) and ``chunked-loss`` (its logits-cross-entropy finding on the model's own
loss), each predicted on the recording, applied by ``memtrim.applied`` to the live model, and measured
with torch.profiler's allocation events; the numeric check bit for bit (exact) or by
``memtrim.verify.verify_fix``'s rounding budget (reference)."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from groundtruth import profiler_memory  # noqa: E402

import memtrim  # noqa: E402
from memtrim.plan.search import options_of  # noqa: E402


def _gpt2(vocab: int, width: int) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=vocab, n_positions=64, n_embd=width, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(0))


def _profiled_peak(step: object) -> int:
    with profiler_memory() as truth:
        step()  # type: ignore[operator]
    return truth.peak_in_window


def test_use_cache_off_predicts_what_the_profiler_measures_bit_for_bit() -> None:
    # a narrow vocabulary: AdamW's step temporaries set the peak while the KV cache still holds the
    # keys and values it copied (as in the doctor's test of the finding)
    model, ids = _gpt2(256, 128), _ids(256)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        outputs = model(input_ids=ids, labels=ids)  # held through the step, as training loops do
        outputs.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    with memtrim.track() as trace:
        step()
    (option,) = [o for o in options_of(trace.analysis) if o.lever == "use-cache-off"]
    assert option.keeps == "exact" and option.cost == 0
    predicted = trace.analysis.peak_with(option.edits)
    assert predicted < trace.peak_bytes
    plan = memtrim.fit(step, budget=predicted)
    assert [lever.lever for lever in plan.levers] == ["use-cache-off"], plan.levers
    assert (
        plan.code() == "model.config.use_cache = False  # or model(..., use_cache=False) in the training step"
    )
    before = _profiled_peak(step)
    with memtrim.applied(plan):
        after = _profiled_peak(step)
    print(f"unplanned {trace.peak_bytes} profiled {before}; predicted {predicted} profiled {after}")
    assert abs(before - trace.peak_bytes) <= 0.01 * before
    assert abs(after - predicted) <= 0.05 * after
    assert model.config.use_cache is True  # undone on exit
    assert plan.numerics.verdict == "pass", plan.numerics


def test_fit_uses_the_chunked_loss_and_proves_it_with_verify_fix() -> None:
    model, ids = _gpt2(4096, 64), _ids(4096)

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    step()
    with memtrim.track() as trace:
        step()
    chunked = [o for o in options_of(trace.analysis) if o.lever == "chunked-loss"]
    assert [o.target for o in chunked] == ["GPT2LMHeadModel"] and chunked[0].keeps == "reference"
    # a budget only the chunked loss reaches (checkpointing both blocks is not enough)
    budget = trace.analysis.peak_with(chunked[0].edits)
    plan = memtrim.fit(step, budget=budget)
    assert "chunked-loss" in [lever.lever for lever in plan.levers]
    assert "memtrim.fixes.chunked_loss(model, chunk_size=" in plan.code()
    with memtrim.applied(plan):
        measured = _profiled_peak(step)
    print(f"unplanned {trace.peak_bytes}; predicted {plan.predicted_peak} profiled {measured}")
    assert abs(measured - plan.predicted_peak) <= 0.05 * measured
    assert measured <= budget * 1.01
    assert "forward" not in model.__dict__  # the patched forward is undone
    assert plan.numerics.verdict == "pass" and "verify_fix" in plan.numerics.note, plan.numerics
    assert 0 < plan.numerics.max_differences["budget_used"] <= 1


def test_fit_switches_a_transformers_model_to_sdpa_and_proves_it_with_verify_fix() -> None:
    seq = 256
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=seq, attn_implementation="eager",
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(1))

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    step()
    with memtrim.track() as trace:
        step()
    (sdpa,) = [o for o in options_of(trace.analysis) if o.lever == "sdpa-attention"]
    assert sdpa.target == "LlamaForCausalLM" and sdpa.keeps == "reference"
    # SDPA's backward computes the scores again: 2 * b * h * s * s * head_dim per layer
    assert sdpa.cost == 2 * (2 * 2 * 4 * seq * seq * 16)
    budget = trace.analysis.peak_with(sdpa.edits)
    plan = memtrim.fit(step, budget=budget)
    assert [lever.lever for lever in plan.levers] == ["sdpa-attention"], plan.levers
    assert plan.code().startswith('model.set_attn_implementation("sdpa")')
    with memtrim.applied(plan):
        measured = _profiled_peak(step)
        assert model.config._attn_implementation == "sdpa"
    assert model.config._attn_implementation == "eager"  # undone on exit
    print(f"unplanned {trace.peak_bytes}; predicted {plan.predicted_peak} profiled {measured}")
    assert abs(measured - plan.predicted_peak) <= 0.05 * measured
    assert plan.numerics.verdict == "pass" and "verify_fix" in plan.numerics.note, plan.numerics
