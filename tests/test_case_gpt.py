"""memtrim.cases.gpt: a small GPT-style model whose training step memtrim doctors (``memtrim demo gpt``).

The fixed step (chunked loss from memtrim.fixes) trains like the original, its loss and every parameter's
gradient pass ``memtrim.verify`` in reference mode, and its peak is lower by the bytes predicted from the
shapes, held against torch.profiler's allocation events recorded in the same run as memtrim's.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from groundtruth import memtrim_deltas, profiler_memory

import memtrim
from memtrim.cases import gpt
from memtrim.cases.gpt_demo import gpt_demo
from memtrim.cli import build_parser
from memtrim.fixes.cross_entropy import tiling
from memtrim.verify import verify

SMALL = gpt.GPTConfig(vocab=8000, context=32, width=64, layers=2, heads=2)


def test_both_steps_train_and_follow_the_same_losses() -> None:
    cfg = gpt.GPTConfig(vocab=500, context=16, width=32, layers=2, heads=2)
    x, y = gpt.batch(cfg, 4)
    runs = {}
    for name, step in (("original", gpt.original_step), ("fixed", gpt.fixed_step)):
        model = gpt.GPT(cfg)
        opt = gpt.optimizer(model, lr=3e-3)
        runs[name] = [step(model, opt, x, y) for _ in range(6)]
    for losses in runs.values():
        assert losses[-1] < losses[0] - 0.5  # memorising one batch: the loss falls fast
        assert all(b < a for a, b in itertools.pairwise(losses))
    torch.testing.assert_close(torch.tensor(runs["fixed"]), torch.tensor(runs["original"]), rtol=1e-4, atol=0)


def test_fixed_loss_and_every_parameter_gradient_within_the_reference_budget() -> None:
    model = gpt.GPT(gpt.TINY)
    r = verify(
        gpt.functional_loss(model, gpt.original_loss),
        gpt.functional_loss(model, lambda m, x, y: gpt.fixed_loss(m, x, y, chunk_size=3)),
        gpt.verify_inputs(model),
        mode="reference",
        dtypes=("fp32", "bf16"),
        layouts=("contiguous", "noncontiguous"),  # the original's y.view(-1) rejects transposed targets
        seeds=(0,),
        memory=False,
        progress=False,
    )
    r.assert_ok()
    params = len(list(model.parameters()))
    names = {q.name for c in r.cases for q in c.quantities}
    assert names == {"output"} | {f"grad of input[{i}]" for i in range(params)}  # every parameter
    assert len(r.cases) == 2 * 2 and all(c.held == "reference" for c in r.cases)


def test_the_fixed_step_peak_is_lower_by_the_bytes_the_shapes_predict() -> None:
    """Original (steady state, AdamW's state already there): the peak is in log_softmax's backward, with
    four [tokens, vocab] fp32 buffers alive (the logits the output object keeps, the saved log_softmax,
    nll_loss's and log_softmax's gradients) on top of what the model saved in forward. Fixed: in the tied
    embedding's backward, where its two gradient halves and their sum are alive with every other
    parameter's gradient; the chunked loss's own peak (one tile) stays below that."""
    x, y = gpt.batch(SMALL, 4)
    tokens = x.numel()
    logits = tokens * SMALL.vocab * 4
    embedding = SMALL.vocab * SMALL.width * 4
    chunk = 16
    rows, cols = tiling(tokens, SMALL.vocab, chunk)
    peaks = {}
    for name in ("original", "fixed"):
        model = gpt.GPT(SMALL)
        opt = gpt.optimizer(model)
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        with profiler_memory() as fwd:
            hidden = model.hidden_states(x)
        activations = sum(fwd.deltas)  # what the model saves for backward, and its output
        del hidden
        if name == "original":
            gpt.original_step(model, opt, x, y)
            with profiler_memory() as truth, memtrim.track() as trace:
                gpt.original_step(model, opt, x, y)
            predicted = 4 * logits + activations
        else:
            gpt.fixed_step(model, opt, x, y, chunk_size=chunk)
            with profiler_memory() as truth, memtrim.track() as trace:
                gpt.fixed_step(model, opt, x, y, chunk_size=chunk)
            predicted = 3 * embedding + (params - embedding)
            loss_part = activations + embedding + tokens * SMALL.width * 4 + rows * cols * 4
            assert loss_part < predicted
            assert max(truth.allocated_sizes) < logits  # never a [tokens, vocab] block
        assert memtrim_deltas(trace) == truth.deltas and trace.peak_bytes == truth.peak
        assert predicted <= truth.peak <= predicted + 64, (name, truth.peak, predicted)  # + a few scalars
        peaks[name] = (truth.peak, predicted)
    saved = peaks["original"][0] - peaks["fixed"][0]
    assert abs(saved - (peaks["original"][1] - peaks["fixed"][1])) <= 64
    assert saved > 3 * logits - 3 * embedding


def test_memtrim_demo_gpt_runs_end_to_end(capsys: pytest.CaptureFixture[str]) -> None:
    assert build_parser().parse_args(["demo", "gpt", "--vocab", "9"]).rest == ["--vocab", "9"]
    argv = ["--vocab", "3000", "--context", "16", "--batch", "2", "--width", "32", "--repeats", "1"]
    assert gpt_demo(argv) == 0
    out = capsys.readouterr().out
    for section in ("1. Track the original step", "2. The prescription", "3. Verify", "4. Side by side"):
        assert section in out
    assert "_log_softmax_backward_data" in out and "PASSED" in out and "peak above start" in out
    assert "[32, 3000] fp32 logits buffer is 375 KiB" in out
