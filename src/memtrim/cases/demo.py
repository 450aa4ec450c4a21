"""``memtrim demo``: the head-results case tracked, reported, verified and benchmarked end to end."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from memtrim.api import track
from memtrim.bench.measure import compare
from memtrim.cases.heads import head_results, head_results_broadcast
from memtrim.units import format_bytes
from memtrim.verify.api import verify


def heads_demo(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="memtrim demo heads", description=heads_demo.__doc__)
    parser.add_argument("--tokens", type=int, default=128, help="positions (default 128; the seed used 512)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per side (default 5)")
    args = parser.parse_args(argv)

    n_heads, d_head, d_model = 12, 64, 768  # GPT-2 small
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(args.tokens, n_heads, d_head, generator=gen, requires_grad=True)
    W_O = torch.randn(n_heads, d_head, d_model, generator=gen, requires_grad=True) / d_head**0.5
    W_O = W_O.detach().requires_grad_()

    def step(fn: object) -> None:
        z.grad = W_O.grad = None
        fn(z, W_O).square().sum().backward()  # type: ignore[operator]

    print(f"== Head results, GPT-2 small shape, {args.tokens} tokens, float32, forward + backward ==\n")
    print("1. Track the broadcast-then-sum original:\n")
    with track() as before:
        step(head_results_broadcast)
    print(before.report(top=3))

    with track() as after:
        step(head_results)
    top = after.largest_temporaries(1)
    print(
        f"\n2. Rewritten with einsum: peak {format_bytes(after.peak_bytes)} "
        f"(was {format_bytes(before.peak_bytes)}); largest temporary "
        f"{format_bytes(top[0].bytes) if top else '0 B'}.\n"
    )

    print("3. Verify the rewrite against a float64 oracle:\n")
    # a small slice: 4 dtypes x 4 layouts, outputs and both gradients
    small = (z.detach()[:8].requires_grad_(), W_O.detach()[:, :, :32].requires_grad_())
    report = verify(head_results_broadcast, head_results, small, seeds=(0,))
    print(report)
    if not report.passed:
        return 1

    print("\n4. Side by side (A/B interleaved, medians):\n")
    result = compare(
        lambda: step(head_results_broadcast),
        lambda: step(head_results),
        repeats=args.repeats,
        names=("broadcast", "einsum"),
    )
    print(result)
    return 0
