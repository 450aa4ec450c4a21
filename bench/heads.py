"""Seed 001's table, measured side by side in one run: per-head results, broadcast (before) vs einsum (after).

GPT-2 small's attention output at 512 tokens, float32 on this CPU: z [512, 12, 64], W_O [12, 64, 768],
result [512, 12, 768] (18,874,368 bytes). Two modes, as in the seed PR:

- no weight gradients: the forward alone (inputs do not require grad, as when caching head results);
- weight gradients enabled: W_O requires grad; forward + backward of a fixed upstream gradient.

Per mode: the largest temporary of each side (one run under ``memtrim.track``, outside the timed runs)
and the median wall time over A/B-interleaved runs (``memtrim.bench.compare``).

Targets (issue 4): largest temporary 1,207,959,552 bytes before and at most 2x the result after; the
einsum at least 3x faster than the broadcast without weight gradients.

    python bench/heads.py [--tokens 512] [--repeats 15] [--strict]

``--strict`` exits 1 when a target is missed (timings on a shared machine are noisy: see the load line).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from memtrim.bench.measure import Comparison, compare
from memtrim.cases.heads import head_results, head_results_broadcast

HEADS, D_HEAD, D_MODEL = 12, 64, 768  # GPT-2 small
BEFORE_TEMPORARY = 1_207_959_552  # 512 x 12 x 64 x 768 x 4 bytes: the broadcast product at 512 tokens
SPEEDUP_TARGET = 3.0

HeadsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Row:
    mode: str
    work: str
    result_bytes: int
    comparison: Comparison


def workload(fn: HeadsFn, tokens: int, weight_grads: bool) -> Callable[[], None]:
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(tokens, HEADS, D_HEAD, generator=gen)
    W_O = (torch.randn(HEADS, D_HEAD, D_MODEL, generator=gen) / D_HEAD**0.5).requires_grad_(weight_grads)
    upstream = torch.randn(tokens, HEADS, D_MODEL, generator=gen)
    kept: list[torch.Tensor] = []  # the result outlives the run, as a cached result would (not a temporary)

    def forward() -> None:
        kept[:] = [fn(z, W_O)]

    def forward_backward() -> None:
        W_O.grad = None
        kept[:] = [fn(z, W_O)]
        kept[0].backward(upstream)

    return forward_backward if weight_grads else forward


def measure(tokens: int, repeats: int) -> list[Row]:
    result_bytes = tokens * HEADS * D_MODEL * 4
    rows = []
    for mode, work, grads in (
        ("No weight gradients", "forward", False),
        ("Weight gradients enabled", "forward + backward", True),
    ):
        print(f"measuring: {mode.lower()} ({work}), {repeats} runs per side ...", file=sys.stderr, flush=True)
        comparison = compare(
            workload(head_results_broadcast, tokens, grads),
            workload(head_results, tokens, grads),
            repeats=repeats,
            warmup=1,
            names=("broadcast", "einsum"),
        )
        rows.append(Row(mode, work, result_bytes, comparison))
    return rows


def _mb(n: int) -> str:
    return f"{n:,} B ({n / 1e6:,.0f} MB)" if n else "0 B (none)"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f} ms" if seconds >= 0.1 else f"{seconds * 1e3:,.1f} ms"


def markdown(rows: list[Row]) -> str:
    head = [
        "Mode",
        "Largest temporary before",
        "Largest temporary after",
        "Median time before",
        "Median time after",
        "Speed-up",
    ]
    lines = ["| " + " | ".join(head) + " |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        b, a = r.comparison.before, r.comparison.after
        lines.append(
            f"| {r.mode} ({r.work}) | {_mb(b.largest_temporary_bytes)} | {_mb(a.largest_temporary_bytes)} "
            f"| {_ms(b.median_seconds)} | {_ms(a.median_seconds)} | {r.comparison.speedup:.1f}x |"
        )
    return "\n".join(lines)


def where(row: Row, side: str) -> str:
    s = getattr(row.comparison, side)
    t = s.largest_temporary
    if t is None:
        return f"{s.name}: no temporary"
    at = f"{os.path.basename(t.file)}:{t.line}" if t.file else "?"
    return f"{s.name}: {t.op} {list(t.shape)} in {t.phase} at {at}"


def targets(rows: list[Row], tokens: int) -> list[tuple[str, bool]]:
    out = []
    no_grads = rows[0]
    for r in rows:
        b, a = r.comparison.before, r.comparison.after
        if tokens == 512:
            out.append(
                (
                    f"{r.mode}: largest temporary before = {BEFORE_TEMPORARY:,} B "
                    f"(measured {b.largest_temporary_bytes:,} B)",
                    b.largest_temporary_bytes == BEFORE_TEMPORARY,
                )
            )
        out.append(
            (
                f"{r.mode}: largest temporary after <= 2x the result = {2 * r.result_bytes:,} B "
                f"(measured {a.largest_temporary_bytes:,} B)",
                a.largest_temporary_bytes <= 2 * r.result_bytes,
            )
        )
    out.append(
        (
            f"{no_grads.mode}: einsum >= {SPEEDUP_TARGET:g}x faster than the broadcast "
            f"(measured {no_grads.comparison.speedup:.1f}x)",
            no_grads.comparison.speedup >= SPEEDUP_TARGET,
        )
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=512, help="positions (default 512, as in the seed)")
    parser.add_argument("--repeats", type=int, default=15, help="timed runs per side and mode (default 15)")
    parser.add_argument("--strict", action="store_true", help="exit 1 if a target is missed")
    args = parser.parse_args(argv)

    rows = measure(args.tokens, args.repeats)
    load = "/".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    print(
        f"Head results, GPT-2 small shape: z [{args.tokens}, {HEADS}, {D_HEAD}], W_O [{HEADS}, {D_HEAD}, "
        f"{D_MODEL}], float32 on CPU; result {_mb(rows[0].result_bytes)}.\n"
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, load average "
        f"{load} at the end. Medians of {args.repeats} A/B-interleaved runs per side (after 1 warm-up); "
        "largest temporary from one memtrim.track() run per side.\n"
    )
    print(markdown(rows))
    print()
    for r in rows:
        b, a = r.comparison.before, r.comparison.after
        print(
            f"- {r.mode}: peak above start {_mb(b.peak_bytes)} before, {_mb(a.peak_bytes)} after. "
            f"Largest temporary: {where(r, 'before')}; {where(r, 'after')}"
        )
    print("\nTargets:")
    checks = targets(rows, args.tokens)
    for text, ok in checks:
        print(f"- [{'x' if ok else ' '}] {'MET' if ok else 'MISSED'}: {text}")
    return 1 if args.strict and not all(ok for _, ok in checks) else 0


if __name__ == "__main__":
    raise SystemExit(main())
