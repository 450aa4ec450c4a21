"""memtrim.plan on a small block stack: the search picks the cheapest blocks to checkpoint for a budget,
the plan applied by ``memtrim.plan.apply.applied`` (global module hook, undone on exit) measures what it
predicted (torch.profiler's allocation events as the ground truth), keeps gradients bit for bit, and a
budget below what any lever reaches says the floor instead of a plan."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from groundtruth import profiler_memory
from torch import nn

import memtrim
from memtrim.plan.apply import applied
from memtrim.plan.fit import fit_analysis
from memtrim.plan.search import options_of


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 512)
        self.down = nn.Linear(512, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def _setup() -> tuple[Stack, torch.Tensor]:
    torch.manual_seed(0)
    return Stack(), torch.randn(256, 64)


def _step(model: Stack, x: torch.Tensor) -> None:
    model(x).backward()


def _recorded(model: Stack, x: torch.Tensor) -> memtrim.Trace:
    _step(model, x)  # warm up: the recorded step is a steady one
    model.zero_grad(set_to_none=True)
    with memtrim.track() as trace:
        _step(model, x)
    model.zero_grad(set_to_none=True)
    return trace


def test_each_block_is_an_option_and_the_plan_measures_what_it_predicted() -> None:
    model, x = _setup()
    analysis = _recorded(model, x).analysis
    options = options_of(analysis)
    assert [o.target for o in options] == [f"blocks.{i}" for i in range(4)]
    assert all(o.keeps == "exact" and o.cost > 0 for o in options)
    # a budget just under the peak with block 0 checkpointed: the search must find a plan that fits
    only_first = analysis.peak_with(options[0].edits)
    assert only_first < analysis.peak.bytes
    fitted = fit_analysis(analysis, only_first)
    plan = fitted.plan
    assert plan is not None and plan.predicted_peak <= only_first
    assert plan.levers and all(lever.lever == "checkpoint" for lever in plan.levers)

    _step(model, x)
    expected = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    with applied(plan), profiler_memory() as truth:
        _step(model, x)
    measured = truth.peak_in_window
    print(f"baseline {analysis.peak.bytes} predicted {plan.predicted_peak} measured {measured}")
    assert abs(measured - plan.predicted_peak) <= 0.05 * measured, (measured, plan.predicted_peak)
    got = [p.grad for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    # undone on exit: the blocks' forward is their class's again
    assert all("forward" not in block.__dict__ for block in model.blocks)


def test_a_budget_below_the_reachable_floor_names_it() -> None:
    model, x = _setup()
    analysis = _recorded(model, x).analysis
    fitted = fit_analysis(analysis, analysis.peak.bytes // 10)
    assert fitted.plan is None
    lowest = fitted.search.lowest.peak
    assert lowest < analysis.peak.bytes
    assert "no plan fits" in fitted.floor_text and memtrim.units.format_bytes(lowest) in fitted.floor_text
    assert "activation" in fitted.floor_text


def test_memtrim_fit_records_plans_and_re_measures_a_step() -> None:
    model, x = _setup()
    baseline = _recorded(model, x).peak_bytes
    plan = memtrim.fit(lambda: _step(model, x), budget=int(baseline * 0.95))
    model.zero_grad(set_to_none=True)
    assert plan.measured_peak is not None and plan.measured_peak <= plan.budget
    assert plan.baseline_peak == baseline
    # the numeric check ran from one saved state: the loss and 16 gradients, bit for bit
    assert plan.numerics.verdict == "pass", plan.numerics
    assert "1 loss(es), 16 gradients" in plan.numerics.note
    with pytest.raises(memtrim.NoPlanFits, match="no plan fits"):
        memtrim.fit(lambda: _step(model, x), budget=baseline // 10)


def test_the_numeric_check_starts_both_steps_from_one_state_and_puts_it_back() -> None:
    """A step with an optimizer and dropout changes the weights and draws random numbers: the checked
    runs must both start from the same state (else nothing would compare equal), and the check must leave
    the model and optimizer as the measured run left them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.Dropout(0.1), nn.ReLU(), nn.Linear(512, 64))
    stack = Stack()
    optimizer = torch.optim.AdamW([*model.parameters(), *stack.parameters()], lr=0.1)
    x = torch.randn(256, 64)

    def step() -> None:
        stack(model(x)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    with memtrim.track() as trace:
        step()
    budget = int(trace.peak_bytes * 0.97)
    seen: list[torch.Tensor] = []
    original_step = optimizer.step

    def counted_step(*args: object, **kwargs: object) -> object:
        seen.append(next(model.parameters()).detach().clone())
        return original_step(*args, **kwargs)

    optimizer.step = counted_step  # type: ignore[method-assign]
    plan = memtrim.fit(step, budget=budget)
    assert plan.levers and plan.numerics.verdict == "pass", plan.numerics
    # record, measure, then two checked steps from the state the measure left
    assert len(seen) == 4 and torch.equal(seen[2], seen[3]) and not torch.equal(seen[1], seen[2])
    assert torch.equal(next(model.parameters()), seen[2])


def test_a_checkpoint_costs_what_flop_counter_counts_for_one_more_forward_of_the_block() -> None:
    """The cost the search weighs, against torch.utils.flop_counter run on the block itself: matmuls
    (the MLP block) and convolutions (a conv block with BatchNorm)."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    conv = nn.Sequential(
        *[nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()) for _ in range(3)]
    )
    images = torch.randn(4, 8, 16, 16)
    mlp, x = _setup()
    for model, given, loss in ((mlp, x, lambda out: out), (conv, images, lambda out: out.square().mean())):
        model(given)  # warm up
        with memtrim.track() as trace:
            loss(model(given)).backward()
        model.zero_grad(set_to_none=True)
        options = options_of(trace.analysis)
        assert options
        for option in options:
            block = model.get_submodule(option.params["module"])
            block_input = given if option.target.endswith("0") else None
            if block_input is None:
                continue  # the first block's input is the program's own tensor; the rest are alike
            with torch.no_grad(), FlopCounterMode(display=False) as counter:
                block(block_input)
            assert option.cost == counter.get_total_flops() > 0, (option.target, option.cost)


def test_fit_on_fake_tensors_predicts_and_measures_what_real_tensors_measure() -> None:
    # the step's model is real; under fake=True its tensors become fake when used and nothing is
    # allocated, yet the plan's fake re-measure is the peak torch.profiler sees for the real step
    import torch
    from groundtruth import profiler_memory
    from torch import nn

    import memtrim

    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 64)) for _ in range(4)]
    )
    x = torch.randn(256, 64)

    def step() -> None:
        model(x).square().mean().backward()
        for p in model.parameters():
            p.grad = None

    with memtrim.track() as real:
        step()
    plan = memtrim.fit(step, budget=int(real.peak_bytes * 0.8), fake=True)
    assert plan.numerics.verdict == "not-run" and "fake tensors" in plan.numerics.note
    assert plan.levers and all(lever.lever == "checkpoint" for lever in plan.levers)
    with memtrim.applied(plan), profiler_memory() as truth:
        step()
    assert plan.measured_peak is not None
    assert abs(plan.measured_peak - truth.peak_in_window) <= 0.01 * truth.peak_in_window
    assert all(p.grad is None for p in model.parameters())


def test_a_fake_fit_checks_its_numbers_on_the_small_config_check_builds() -> None:
    """``fit(step, fake=True, check=small)``: the plan is fitted on the full-size step's fake tensors and
    its numbers checked by running ``small()`` (a 2-block model, built afresh each call) on real tensors
    without and with the plan: bit for bit for checkpointing; a small step whose numbers change when its
    first block is checkpointed fails the check."""
    import torch
    from torch import nn

    import memtrim

    def stack(blocks: int, rows: int, sensitive: bool = False) -> Callable[[], None]:
        def step() -> None:
            torch.manual_seed(0)
            model = nn.Sequential(
                *[nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 64)) for _ in range(blocks)]
            )
            loss = model(torch.randn(rows, 64)).square().mean()
            scale = 1.5 if sensitive and "forward" in model[0].__dict__ else 1.0  # checkpointed: patched
            (loss * scale).backward()

        return step

    full = stack(4, 256)
    with memtrim.track() as real:
        full()
    budget = int(real.peak_bytes * 0.8)
    plan = memtrim.fit(full, budget=budget, fake=True, check=stack(2, 32))
    assert plan.levers and all(lever.lever == "checkpoint" for lever in plan.levers)
    assert plan.numerics.verdict == "pass", plan.numerics
    assert "on real tensors of the small config (step())" in plan.numerics.note
    assert "that run: bit for bit (1 loss(es), 8 gradients" in plan.numerics.note
    failed = memtrim.fit(full, budget=budget, fake=True, check=stack(2, 32, sensitive=True))
    assert failed.numerics.verdict == "fail" and failed.numerics.max_differences["loss"] > 0


def test_the_floor_names_what_no_lever_removes_when_parameters_and_state_exceed_the_budget() -> None:
    import pytest
    import torch
    from torch import nn

    import memtrim

    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    x = torch.randn(4, 256)

    def step() -> None:
        optimizer = torch.optim.AdamW(model.parameters())  # made in the step: its state counts
        model(x).square().mean().backward()
        optimizer.step()

    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    with pytest.raises(memtrim.NoPlanFits) as raised:
        memtrim.fit(step, budget=parameters)  # parameters are alive before: state alone is 2x them
    text = str(raised.value)
    assert "Parameters and optimizer state alone are" in text and "FSDP2" in text


class _NoFloat64(nn.Module):
    """A layer whose kernel has no float64 version (as torch._grouped_mm on CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float64:
            raise RuntimeError("Expected mat_a to be Float32, BFloat16 or Float16 matrix, got Double")
        return self.linear(x)


def test_a_reference_check_whose_float64_oracle_cannot_run_proves_nothing_and_blames_nothing() -> None:
    from memtrim.plan.numerics import _unproven
    from memtrim.verify import verify_fix

    model = _NoFloat64()

    def loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x).square().mean()

    report = verify_fix(model, lambda m: None, torch.randn(4, 8), loss=loss, mode="reference")
    assert not report.passed
    verdict = _unproven(report, "_NoFloat64")
    assert verdict is not None and verdict.verdict == "not-run"
    assert "could not prove" in verdict.note and "got Double" in verdict.note
    # a candidate that really differs is still a failure
    differs = verify_fix(
        nn.Linear(8, 8), lambda m: m.weight.data.mul_(1.5), torch.randn(4, 8), mode="reference"
    )
    assert not differs.passed and _unproven(differs, "Linear") is None


def test_fit_on_a_mixture_of_experts_model_says_what_its_numeric_check_could_not_run() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.MixtralForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 4096, (2, 64), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    with memtrim.track() as trace:
        step()
    plan = memtrim.fit(step, budget=int(trace.peak_bytes * 0.7))
    assert "chunked-loss" in [lever.lever for lever in plan.levers]
    with profiler_memory() as truth, applied(plan):
        step()
    assert truth.peak_in_window <= plan.budget
    # the loss is not changed beyond rounding: whatever the check could do, it must not say "fail"
    assert plan.numerics.verdict != "fail", plan.numerics
    if plan.numerics.verdict == "not-run":  # transformers' grouped-mm experts have no float64 kernel
        assert "could not prove" in plan.numerics.note and "float64" in plan.numerics.note


def test_the_blocks_of_an_encoder_inside_a_sequential_are_its_layers_not_the_encoder() -> None:
    # nn.Sequential(encoder, head) runs the encoder's layers as 0.layers.0, 0.layers.1, ...: the
    # sequential's two children are not repeated blocks (the head is a Linear), the layers are
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 256, batch_first=True, dropout=0.0)
    model = nn.Sequential(nn.TransformerEncoder(layer, 3, enable_nested_tensor=False), nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 32, 64), torch.randint(0, 10, (4 * 32,))

    def step() -> None:
        nn.functional.cross_entropy(model(x).view(-1, 10), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    with memtrim.track() as trace:
        step()
    checkpoints = [o for o in options_of(trace.analysis) if o.lever == "checkpoint"]
    assert sorted(o.target for o in checkpoints) == ["0.layers.0", "0.layers.1", "0.layers.2"]
    first = next(o for o in checkpoints if o.target == "0.layers.0")
    plan = memtrim.fit(step, budget=trace.analysis.peak_with(first.edits))
    assert [(lever.lever, lever.target) for lever in plan.levers] == [("checkpoint", "0.layers.0")]
    with profiler_memory() as truth, applied(plan):
        step()
    assert truth.peak_in_window < trace.peak_bytes
    assert abs(truth.peak_in_window - plan.predicted_peak) <= 0.01 * truth.peak_in_window
    assert plan.numerics.verdict == "pass", plan.numerics
