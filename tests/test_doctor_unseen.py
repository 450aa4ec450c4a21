"""The doctor on models its rules were not written for (tests/unseen_models.py): every finding's fix,
applied to the program's own objects exactly as printed, keeps the step (``memtrim.verify``) and lands
where it said (torch.profiler); patterns resolve on the object the program holds; blocks that update
buffers in their forward keep them; a compiled program's report says it was measured eagerly."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from groundtruth import profiler_memory
from torch import nn
from unseen_models import UNSEEN, Unseen, t5, train, unet

import memtrim
from memtrim.doctor import Diagnosis, diagnoses

REMOVE_ONLY = 0.01
"""How near the measured peak must be to a prediction whose edits only free or remove bytes."""
WITH_ADDED = 0.10
"""... and to one that also adds bytes (a recompute's transient, a chunk's logits)."""


def _findings(case: Unseen) -> tuple[nn.Module, dict[str, torch.Tensor], list[Diagnosis], int]:
    torch.manual_seed(0)
    model, batch = case.build(), case.batch()
    start = copy.deepcopy(model)
    with profiler_memory() as truth, memtrim.track() as trace:
        train(model, batch, case.step)
    assert trace.peak_bytes == truth.peak  # the baseline is right to the byte
    return start, batch, diagnoses(trace.analysis), truth.peak


def _apply(code: str) -> Callable[[nn.Module], None]:
    def fix(model: nn.Module) -> None:
        exec(code, {"model": model})  # the finding's code, as printed, on the program's own model

    return fix


@pytest.mark.parametrize("case", UNSEEN, ids=[c.name for c in UNSEEN])
def test_every_fix_applied_as_printed_keeps_the_step_and_lands_where_predicted(case: Unseen) -> None:
    start, batch, found, baseline = _findings(case)
    assert found, f"no finding on {case.name}"
    for d in found:
        assert d.code, f"{d.rule} prints no code to apply on {case.name}"
        assert {name for name, _ in d.binds} == {"model"}
        fixed = copy.deepcopy(start)
        _apply(d.code)(fixed)
        with profiler_memory() as truth:
            train(fixed, batch, case.step)
        tolerance = WITH_ADDED if d.edits.add else REMOVE_ONLY
        assert abs(truth.peak - d.peak_after) <= tolerance * d.peak_after, (d.rule, truth.peak, d.peak_after)
        assert truth.peak < baseline, (d.rule, truth.peak, baseline)
        assert d.verify_mode is not None and d.proof is not None
        assert d.proof.startswith("# with model, batch, loss_fn: ")
        exec(d.proof, {"model": start, "batch": batch, "loss_fn": case.step})  # as printed: verify_fix


def test_checkpointing_a_unet_with_batchnorm_keeps_its_running_statistics_over_three_steps() -> None:
    start, batch, found, _ = _findings(next(c for c in UNSEEN if c.name == "unet-bn"))
    (d,) = [d for d in found if d.rule == "checkpoint-candidates"]
    assert d.keeps == "exact" and "BatchNorm" in " ".join(d.safe_because)
    assert "torch.utils.checkpoint.checkpoint(" not in d.fix  # plain checkpoint would count twice
    step = next(c for c in UNSEEN if c.name == "unet-bn").step

    def three_steps(model: nn.Module) -> nn.Module:
        torch.manual_seed(1)
        train(model, batch, step, steps=3)
        return model

    plain, fixed = three_steps(copy.deepcopy(start)), copy.deepcopy(start)
    _apply(d.code or "")(fixed)
    three_steps(fixed)
    for (name, a), (_, b) in zip(plain.named_buffers(), fixed.named_buffers(), strict=True):
        assert torch.equal(a, b), name
    for (name, a), (_, b) in zip(plain.named_parameters(), fixed.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert dict(fixed.named_buffers())["up.0.1.num_batches_tracked"].item() == 3

    # what the finding steers around: torch.utils.checkpoint by hand counts every batch twice
    by_hand = copy.deepcopy(start)
    for block in by_hand.up:
        inner = block.forward
        block.forward = lambda x, inner=inner: torch.utils.checkpoint.checkpoint(
            inner, x, use_reentrant=False
        )
    three_steps(by_hand)
    assert dict(by_hand.named_buffers())["up.0.1.num_batches_tracked"].item() == 6


def test_t5_called_through_its_stacks_gets_patterns_of_the_model_that_owns_them() -> None:
    torch.manual_seed(0)
    model = t5()
    case = next(c for c in UNSEEN if c.name == "t5-stacks")
    batch = case.batch()
    with memtrim.track() as trace:
        train(model, batch, case.step)
    paths = {a.module for a in trace.allocations if a.module}
    names = {name for name, _ in model.named_modules()}
    assert any(p.startswith("T5ForConditionalGeneration.encoder.block.0") for p in paths)
    assert any(p.startswith("T5ForConditionalGeneration.decoder.block.0") for p in paths)
    for path in paths:  # every recorded path resolves on the model the program holds
        assert path.partition(".")[2] in names | {""}, path
    found = diagnoses(trace.analysis)
    assert found
    for d in found:
        if d.rule == "checkpoint-candidates":
            pattern = d.code.split('["', 1)[1].split('"]', 1)[0] if d.code else ""
            assert pattern.split(".", 1)[0] in ("encoder", "decoder"), pattern  # never one merged "block.*"
            assert memtrim.fixes.glob_to_regex(pattern).fullmatch("encoder.block.0") or (
                memtrim.fixes.glob_to_regex(pattern).fullmatch("decoder.block.0")
            )


def test_a_compiled_model_is_named_by_the_module_it_compiled_and_the_report_says_it_ran_eagerly() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        *(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(4))
    )
    compiled = torch.compile(model)
    x = torch.randn(64, 64)
    with memtrim.track() as trace:
        compiled(x).square().mean().backward()
    paths = {a.module for a in trace.allocations if a.module}
    assert paths and not any("_orig_mod" in p for p in paths)
    names = {name for name, _ in model.named_modules()}
    assert all(p.partition(".")[2] in names for p in paths)
    first_lines = trace.report().splitlines()[:4]
    assert any("measured eagerly" in line for line in first_lines), first_lines
    from memtrim.report.html import report_html

    assert "Measured eagerly" in report_html(trace.analysis)
    for d in diagnoses(trace.analysis):
        if d.code and "checkpoint_modules" in d.code:
            exec(d.code, {"model": copy.deepcopy(model)})  # resolves on the module torch.compile wrapped


def test_an_uncompiled_program_with_dynamo_loaded_has_no_eager_note() -> None:
    import torch._dynamo  # loaded, as transformers and many libraries load it

    model = unet()
    with memtrim.track() as trace:
        model(torch.randn(1, 3, 16, 16)).sum().backward()
    assert "measured eagerly" not in trace.report()
