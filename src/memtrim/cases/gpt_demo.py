"""``memtrim demo gpt``: a GPT-style model's training step doctored end to end.

The original step is tracked and reported (what sets its peak, by role and by line), the prescription of
:mod:`memtrim.fixes` is applied (the chunked loss, and with ``--checkpoint`` activation checkpointing on
the blocks), the fixed loss and every parameter's gradient are verified against the original's with
``memtrim.verify`` (reference mode, on a small model), and both steps are measured side by side.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from memtrim.api import track
from memtrim.bench.measure import compare
from memtrim.cases import gpt
from memtrim.fixes import checkpoint_modules
from memtrim.units import format_bytes, format_delta
from memtrim.verify.api import verify

ORIGINAL = """\
     out = model(x)                                  # the output object keeps the logits
     loss = F.cross_entropy(out.logits.view(-1, V), y.view(-1))
     loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)"""
FIXED_IMPORT = "     from memtrim.fixes import chunked_linear_cross_entropy"
FIXED = """\
     loss = chunked_linear_cross_entropy(model.hidden_states(x), model.lm_head.weight, y)
     loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)"""


def gpt_demo(argv: Sequence[str] | None = None) -> int:
    """Track, fix, verify and measure one AdamW step of a small GPT-style language model."""
    parser = argparse.ArgumentParser(prog="memtrim demo gpt", description=gpt_demo.__doc__)
    parser.add_argument(
        "--vocab", type=int, default=gpt.DEMO.vocab, help="vocabulary (default GPT-2's 50257)"
    )
    parser.add_argument("--context", type=int, default=gpt.DEMO.context, help="tokens per sequence (64)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per batch (4)")
    parser.add_argument("--width", type=int, default=gpt.DEMO.width, help="model width (128)")
    parser.add_argument("--layers", type=int, default=gpt.DEMO.layers, help="blocks (2)")
    parser.add_argument("--checkpoint", action="store_true", help="also checkpoint the blocks")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per side (5)")
    args = parser.parse_args(argv)

    cfg = gpt.GPTConfig(vocab=args.vocab, context=args.context, width=args.width, layers=args.layers)
    x, y = gpt.batch(cfg, args.batch)
    tokens = x.numel()
    before_model, after_model = gpt.GPT(cfg), gpt.GPT(cfg)
    before_opt, after_opt = gpt.optimizer(before_model), gpt.optimizer(after_model)
    handle = checkpoint_modules(after_model, "blocks.*") if args.checkpoint else None

    def before() -> float:
        return gpt.original_step(before_model, before_opt, x, y)

    def after() -> float:
        return gpt.fixed_step(after_model, after_opt, x, y)

    print(
        f"== GPT-style LM in plain PyTorch: vocab {cfg.vocab}, {cfg.layers} blocks x {cfg.width} wide, "
        f"batch {args.batch} x {cfg.context} = {tokens} tokens, float32, one AdamW step ==\n"
    )
    print("1. Track the original step (after one untracked step: AdamW's state exists, as in later steps):\n")
    print(ORIGINAL + "\n")
    first_before = before()
    with track() as tracked_before:
        loss_before = before()
    print(tracked_before.report(top=5))
    logits = tokens * cfg.vocab * 4
    print(f"\n   (one [{tokens}, {cfg.vocab}] fp32 logits buffer is {format_bytes(logits)})\n")

    print("2. The prescription, from memtrim.fixes:\n")
    if handle is None:
        print(FIXED_IMPORT)
    else:
        print(FIXED_IMPORT + ", checkpoint_modules")
        wrapped = ", ".join(handle.wrapped)
        print(f'     checkpoint_modules(model, "blocks.*")   # once, before training: {wrapped}')
    print(FIXED)
    first_after = after()
    with track() as tracked_after:
        loss_after = after()
    b, a = tracked_before.peak_bytes, tracked_after.peak_bytes
    print(
        f"\n   peak {format_bytes(a)} (was {format_bytes(b)}, {format_delta(b, a)}, {b / a:.1f}x lower); "
        f"reached in {tracked_after.peak.phase}; losses of the two steps: "
        f"{first_before:.6f} / {first_after:.6f}, then {loss_before:.6f} / {loss_after:.6f}\n"
    )

    small = gpt.GPT(gpt.TINY)
    print(
        f"3. Verify the fixed loss and every parameter's gradient against the original's (reference mode, "
        f"a small model: vocab {gpt.TINY.vocab}, {gpt.TINY.layers} blocks x {gpt.TINY.width}, "
        "ignored positions included):\n"
    )
    report = verify(
        gpt.functional_loss(small, gpt.original_loss),
        gpt.functional_loss(small, lambda m, xs, ys: gpt.fixed_loss(m, xs, ys, chunk_size=3)),
        gpt.verify_inputs(small),
        mode="reference",
        dtypes=("fp32", "bf16"),
        layouts=("contiguous", "noncontiguous"),
        seeds=(0,),
    )
    print(report)
    if not report.passed:
        return 1

    print("\n4. Side by side (A/B interleaved, medians):\n")
    result = compare(before, after, repeats=args.repeats, names=("original", "fixed"))
    print(result)
    if handle is not None:
        handle.undo()
    return 0


if __name__ == "__main__":
    raise SystemExit(gpt_demo())
