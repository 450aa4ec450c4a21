"""The micro-batches lever of memtrim.plan (gradient accumulation, memtrim.fixes.micro_batches): offered
for a transformers LM that computes its own loss, predicted on the recording and measured with
torch.profiler's allocation events with the plan applied; what it keeps (dropout changes training); not
combined with the optimizer step in backward; not offered where the loss is the program's own."""

from __future__ import annotations

from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from groundtruth import profiler_memory  # noqa: E402

import memtrim  # noqa: E402
from memtrim.analysis.whatif import Edits  # noqa: E402
from memtrim.plan.file import Plan, PlannedLever  # noqa: E402
from memtrim.plan.levers import Option  # noqa: E402
from memtrim.plan.search import _compatible, options_of  # noqa: E402


def _step(model: Any, ids: torch.Tensor) -> Any:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the optimizer state exists: a steady step is recorded
    return step


def _qwen3_step() -> Any:
    # activations, not the logits, set the peak: a narrow vocabulary and a batch of 8 rows
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    ids = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(0))
    return _step(transformers.Qwen3ForCausalLM(config), ids)


def _profiled_peak(step: Any) -> int:
    with profiler_memory() as truth:
        step()
    return truth.peak_in_window


def test_each_count_s_prediction_is_what_the_profiler_measures() -> None:
    step = _qwen3_step()
    with memtrim.track() as trace:
        step()
    options = [o for o in options_of(trace.analysis) if o.lever == "micro-batches"]
    assert [o.params["count"] for o in options] == [2, 4, 8]
    assert {o.keeps for o in options} == {"reference"} and {o.target for o in options} == {
        f"Qwen3ForCausalLM, {n} micro-batches" for n in (2, 4, 8)
    }
    assert options[0].cost < options[1].cost < options[2].cost  # of two that fit, the fewer parts
    for option in options:
        predicted = trace.analysis.peak_with(option.edits)
        lever = PlannedLever(
            option.lever, option.target, dict(option.params), option.keeps, predicted, option.cost
        )
        plan = Plan(
            budget=predicted, baseline_peak=trace.peak_bytes, predicted_peak=predicted, levers=[lever]
        )
        with memtrim.applied(plan):
            measured = _profiled_peak(step)
        print(
            f"count {option.params['count']}: predicted {predicted} profiled {measured} of {trace.peak_bytes}"
        )
        assert measured < 0.8 * trace.peak_bytes
        # what does not shrink with the part (a one-row part's masks and position tables, 45 KiB at 8
        # parts here) is 2.5% of the smallest peak
        assert abs(predicted - measured) <= 0.03 * measured


def test_fit_plans_micro_batches_applies_them_and_proves_them_with_verify_fix() -> None:
    step = _qwen3_step()
    with memtrim.track() as trace:
        step()
    budget = int(0.45 * trace.peak_bytes)
    plan = memtrim.fit(step, budget=budget)
    assert "micro-batches" in [lever.lever for lever in plan.levers], plan.levers
    assert "memtrim.fixes.micro_batches(model, " in plan.code()
    with memtrim.applied(plan):
        measured = _profiled_peak(step)
    print(f"unplanned {trace.peak_bytes}; predicted {plan.predicted_peak} profiled {measured}")
    assert measured <= budget
    assert abs(measured - plan.predicted_peak) <= 0.02 * measured
    assert plan.numerics.verdict == "pass" and "verify_fix" in plan.numerics.note, plan.numerics


def test_dropout_makes_it_change_training_and_the_step_in_backward_does_not_combine() -> None:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )  # GPT-2's default dropout (0.1)
    ids = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(0))
    step = _step(transformers.GPT2LMHeadModel(config), ids)
    with memtrim.track() as trace:
        step()
    allowed = options_of(trace.analysis, frozenset({"exact", "reference", "changes-training"}))
    micro = [o for o in allowed if o.lever == "micro-batches"]
    assert micro and {o.keeps for o in micro} == {"changes-training"}
    assert not [o for o in options_of(trace.analysis) if o.lever == "micro-batches"]
    # a budget only the micro-batches reach: no plan by default, and the paragraph says what would fit
    budget = trace.analysis.peak_with(micro[-1].edits)
    with pytest.raises(memtrim.NoPlanFits, match="With --allow changes-training a plan fits: micro-batches"):
        memtrim.fit(step, budget=budget)
    # the step in backward would step on the first part's gradients: never in one plan with it
    in_backward = Option("optimizer-in-backward", "optimizer", {}, "exact", 0.0, Edits(), "optimizer-step")
    assert not _compatible((micro[0], in_backward)) and not _compatible((in_backward, micro[0]))
    assert _compatible((micro[0],)) and not _compatible((micro[0], micro[1]))


def test_not_offered_where_the_program_computes_the_loss() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step() -> None:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    with memtrim.track() as trace:
        step()
    assert not [o for o in options_of(trace.analysis) if o.lever == "micro-batches"]
