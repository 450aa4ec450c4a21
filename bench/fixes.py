"""chunked_linear_cross_entropy vs the unfused loss, side by side: peak memory and median time.

The loss part of a GPT-2 training step at its vocabulary (50257), 1024 tokens, hidden 768, fp32: forward and
backward of ``F.cross_entropy(h @ W.T, t)`` (gradients of ``h`` and ``W``) against
``memtrim.fixes.chunked_linear_cross_entropy(h, W, t)`` (the chunk from its memory budget unless
``--chunk``). Each run starts with no gradients, so both sides allocate ``W.grad``.

- peak: above the start of the run (``h``, ``W``, ``t`` exist before), from memtrim and, independently,
  from torch.profiler's CPU allocator events (every block, also those an op makes and frees inside
  itself, which memtrim cannot see).
- time: ``memtrim.bench.compare``: A/B interleaved runs, medians. This machine may be shared: the load
  average is printed before and after.

Targets (issue 12): loss-part peak at least 3x lower, time at most 1.3x.
Run: python bench/fixes.py [--tokens 1024 --hidden 768 --vocab 50257 --repeats 7 --chunk N]
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from memtrim.bench import compare
from memtrim.fixes import auto_chunk_size, chunked_linear_cross_entropy
from memtrim.fixes.cross_entropy import tiling
from memtrim.units import format_bytes


def allocator_peak(reset: Callable[[], object], step: Callable[[], object]) -> tuple[int, int]:
    """(peak bytes above the start, largest block) of ``step`` from torch.profiler's CPU allocation events.

    ``reset`` (dropping the last run's gradients) runs before the profiler starts: the profiler would see
    those blocks freed, and count them against the step's own."""
    reset()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())  # type: ignore[union-attr]
    while stack:
        node = stack.pop()
        if node.tag == torch._C._profiler._EventType.Allocation:
            if node.extra_fields.device.type == "cpu":
                events.append((node.start_time_ns, node.extra_fields.alloc_size))
            continue
        stack.extend(node.children)
    live = peak = 0
    for _, delta in sorted(events):
        live += delta
        peak = max(peak, live)
    return peak, max((d for _, d in events), default=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--chunk", type=int, default=None, help="tokens per tile (default: the budget rule)")
    args = parser.parse_args()

    gen = torch.Generator().manual_seed(0)
    h = torch.randn(args.tokens, args.hidden, generator=gen).requires_grad_()
    W = (torch.randn(args.vocab, args.hidden, generator=gen) * 0.02).requires_grad_()
    t = torch.randint(0, args.vocab, (args.tokens,), generator=gen)
    chunk = args.chunk or auto_chunk_size(args.tokens, args.vocab, args.hidden, torch.float32)
    rows, cols = tiling(args.tokens, args.vocab, chunk)

    def reset() -> None:
        h.grad = W.grad = None

    def unfused_step() -> None:
        F.cross_entropy(h @ W.T, t).backward()

    def chunked_step() -> None:
        chunked_linear_cross_entropy(h, W, t, chunk_size=args.chunk).backward()

    def unfused() -> None:
        reset()
        unfused_step()

    def chunked() -> None:
        reset()
        chunked_step()

    load = os.getloadavg()[0]
    print(
        f"== loss part: {args.tokens} tokens, hidden {args.hidden}, vocab {args.vocab}, fp32, forward + "
        f"backward (grads of h and W); {torch.get_num_threads()} threads, load average {load:.2f} =="
    )
    tile = format_bytes(rows * cols * 4)
    print(f"chunk {chunk} tokens -> tiles of {rows} tokens x {cols} vocabulary entries ({tile})")
    result = compare(unfused, chunked, repeats=args.repeats, names=("unfused", "chunked"))
    (peak_b, block_b) = allocator_peak(reset, unfused_step)
    (peak_a, block_a) = allocator_peak(reset, chunked_step)
    b, a = result.before, result.after
    ratio_mem = b.peak_bytes / a.peak_bytes
    slower = a.median_seconds / b.median_seconds
    rows_out = [
        ["", "unfused", "chunked", "ratio"],
        ["peak (memtrim)", format_bytes(b.peak_bytes), format_bytes(a.peak_bytes), f"{ratio_mem:.2f}x lower"],
        [
            "peak (torch.profiler)",
            format_bytes(peak_b),
            format_bytes(peak_a),
            f"{peak_b / peak_a:.2f}x lower",
        ],
        [
            "largest block (profiler)",
            format_bytes(block_b),
            format_bytes(block_a),
            f"{block_b / block_a:.2f}x",
        ],
        [
            f"median time ({args.repeats} A/B runs)",
            f"{b.median_seconds * 1e3:.0f} ms",
            f"{a.median_seconds * 1e3:.0f} ms",
            f"{slower:.3f}x the time",
        ],
    ]
    widths = [max(len(r[i]) for r in rows_out) for i in range(4)]
    for r in rows_out:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    print(
        f"  runs (s): unfused {[round(s, 2) for s in b.seconds]}, chunked {[round(s, 2) for s in a.seconds]}"
    )
    print(f"  peak bytes (memtrim / profiler): unfused {b.peak_bytes:,} / {peak_b:,}, ", end="")
    print(f"chunked {a.peak_bytes:,} / {peak_a:,}")
    print(
        f"targets: peak >= 3x lower: {'met' if ratio_mem >= 3 else 'MISSED'} ({ratio_mem:.2f}x); "
        f"time <= 1.3x: {'met' if slower <= 1.3 else 'MISSED'} ({slower:.3f}x); "
        f"load average now {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
