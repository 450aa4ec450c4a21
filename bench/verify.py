"""How long memtrim.verify's default matrix takes on the head-results case (a script, not a test).

    python bench/verify.py [--repeats 3] [--pos 8 --heads 4 --d-head 16 --d-model 32]

Default matrix: fp64/fp32/fp16/bf16 x contiguous/noncontiguous/transposed/expanded x seeds 0,1,2 = 48
cases, each with outputs and both gradients, the float64 oracle, the traced budget and (unless
--no-memory) both callables' peak memory through memtrim's tracker.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch

from memtrim.cases.heads import head_results, head_results_broadcast
from memtrim.verify import verify


def timed(repeats: int, **kw: Any) -> tuple[list[float], Any]:
    times, report = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        report = verify(head_results_broadcast, head_results, progress=False, **kw)
        times.append(time.perf_counter() - t0)
    return times, report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pos", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--d-head", type=int, default=16)
    ap.add_argument("--d-model", type=int, default=32)
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave the default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    z = torch.randn(args.pos, args.heads, args.d_head, requires_grad=True)
    W_O = torch.randn(args.heads, args.d_head, args.d_model, requires_grad=True)
    print(
        f"memtrim.verify on head results: z {list(z.shape)}, W_O {list(W_O.shape)}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    verify(
        head_results_broadcast, head_results, (z, W_O), progress=False, seeds=(0,), dtypes=("fp32",)
    )  # warm-up
    rows = [
        ("default matrix (auto, memory on)", {"memory": not args.no_memory}),
        ("default matrix, memory off", {"memory": False}),
        ("mode='reference', memory off", {"mode": "reference", "memory": False}),
        ("mode='exact' (einsum is not bit-exact: fails)", {"mode": "exact", "memory": False}),
    ]
    print("| run | cases | median s | min s | per case ms | verdict |")
    print("|---|---|---|---|---|---|")
    reports = []
    for label, kw in rows:
        times, report = timed(args.repeats, inputs=(z, W_O), **kw)
        reports.append(report)
        n = len(report.cases)
        med = statistics.median(times)
        verdict = "passed" if report.passed else f"failed ({len(report.failures)} failures)"
        print(f"| {label} | {n} | {med:.2f} | {min(times):.2f} | {1000 * med / n:.0f} | {verdict} |")
    print()
    print(reports[0].summary())  # the default matrix: its verdict and the memory side by side


if __name__ == "__main__":
    main()
