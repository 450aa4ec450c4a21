"""What memtrim.verify costs: time of the default matrix on the head-results case, and peak memory per
input byte (a script, not a test).

    python bench/verify.py [--repeats 3] [--pos 8 --heads 4 --d-head 16 --d-model 32]
    python bench/verify.py --rss [--rss-mib 16] [--rss-seeds 3]

Default matrix: fp64/fp32/fp16/bf16 x contiguous/noncontiguous/transposed/expanded x seeds 0,1,2 = 48
cases, each with outputs and both gradients, the float64 oracle traced for its budget and (unless
--no-memory) both callables' peak memory through memtrim's tracker.

``--rss`` runs ``verify(..., mode="reference")`` over the default matrix (``--rss-seeds`` seeds) on an
input of ``--rss-mib`` MiB (float32), each workload in a fresh process, and prints the growth of the
process's peak resident set over its size just before the call, that growth per input byte and the time,
each next to its target (issue 22: at most 10 bytes per input byte; a 16 MiB input over 3 seeds in
under a minute).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from memtrim.verify import verify


def timed(repeats: int, fns: tuple[Any, Any], **kw: Any) -> tuple[list[float], Any]:
    times, report = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        report = verify(*fns, progress=False, **kw)
        times.append(time.perf_counter() - t0)
    return times, report


def _softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, -1)


def _softmax_manual(x: torch.Tensor) -> torch.Tensor:
    # The max detached: differentiating through it adds, at each row's argmax, a gradient term that is
    # zero exactly but not in fp16 over 2048 columns (verify rightly fails that version there).
    m = x.amax(-1, keepdim=True).detach()
    e = (x - m).exp()
    return e / e.sum(-1, keepdim=True)


def _matmul(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    return x @ W


def _einsum(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    return torch.einsum("ij,jk->ik", x, W)


RSS_TARGET = 10.0  # peak RSS growth per input byte
SECONDS_TARGET = 60.0  # a 16 MiB input, 3 seeds, reference mode


def rss_child(workload: str, mib: int, seeds: int) -> None:
    """One measurement, in this (fresh) process: prints a JSON line."""
    torch.set_num_threads(1)
    side = int((mib * 2**20 // 4) ** 0.5)
    x = torch.randn(side, side, requires_grad=True)
    if workload == "softmax":
        fns: tuple[Any, Any] = (_softmax, _softmax_manual)
        inputs: tuple[torch.Tensor, ...] = (x,)
    else:
        fns, inputs = (_matmul, _einsum), (x, torch.randn(side, 16, requires_grad=True))
    nbytes = sum(t.numel() * t.element_size() for t in inputs)
    small = tuple(t[:4, :4].detach().clone().requires_grad_() for t in inputs)
    verify(*fns, small, seeds=(0,), mode="reference", memory=False, progress=False)  # warm-up
    now = _rss_now()
    t0 = time.perf_counter()
    report = verify(*fns, inputs, mode="reference", memory=False, progress=False, seeds=tuple(range(seeds)))
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    print(
        json.dumps(
            {
                "workload": workload,
                "input_bytes": nbytes,
                "growth": peak - now,
                "peak": peak,
                "rss_before": now,
                "cases": len(report.cases),
                "passed": report.passed,
                "seconds": seconds,
            }
        )
    )


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss(mib: int, seeds: int) -> None:
    print(
        f"peak RSS growth of verify(..., mode='reference') over the default matrix ({16 * seeds} cases, "
        f"{seeds} seeds), a {mib} MiB float32 input, one process per workload, torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
    )
    timed = mib == 16 and seeds == 3  # the time target's workload
    print(
        f"| workload | input | peak RSS growth | per input byte (target <= {RSS_TARGET:g}) | cases | "
        f"verdict | time{f' (target < {SECONDS_TARGET:g} s)' if timed else ''} |"
    )
    print("|---|---:|---:|---:|---:|---|---:|")
    for workload in ("matmul", "softmax"):
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--rss-child",
                workload,
                "--rss-mib",
                str(mib),
                "--rss-seeds",
                str(seeds),
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()[-1]
        d = json.loads(out)
        mb = d["input_bytes"] / 2**20
        ratio = d["growth"] / d["input_bytes"]
        ratio_ok = "met" if ratio <= RSS_TARGET else "missed"
        time_ok = (" met" if d["seconds"] < SECONDS_TARGET else " missed") if timed else ""
        print(
            f"| {'x @ W vs einsum' if workload == 'matmul' else 'softmax vs max-shifted'} | {mb:.1f} MiB | "
            f"{d['growth'] / 2**20:,.0f} MiB | {ratio:.1f} ({ratio_ok}) | {d['cases']} | "
            f"{'passed' if d['passed'] else 'FAILED'} | {d['seconds']:.0f} s{time_ok} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pos", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--d-head", type=int, default=16)
    ap.add_argument("--d-model", type=int, default=32)
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave the default)")
    ap.add_argument("--rss", action="store_true", help="measure peak memory per input byte instead")
    ap.add_argument("--rss-mib", type=int, default=16)
    ap.add_argument("--rss-seeds", type=int, default=3)
    ap.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rss_child:
        rss_child(args.rss_child, args.rss_mib, args.rss_seeds)
        return
    if args.rss:
        rss(args.rss_mib, args.rss_seeds)
        return
    from memtrim.cases.heads import head_results, head_results_broadcast

    if args.threads:
        torch.set_num_threads(args.threads)
    z = torch.randn(args.pos, args.heads, args.d_head, requires_grad=True)
    W_O = torch.randn(args.heads, args.d_head, args.d_model, requires_grad=True)
    print(
        f"memtrim.verify on head results: z {list(z.shape)}, W_O {list(W_O.shape)}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    fns = (head_results_broadcast, head_results)
    verify(*fns, (z, W_O), progress=False, seeds=(0,), dtypes=("fp32",))  # warm-up
    rows = [
        ("default matrix (auto, memory on)", {"memory": not args.no_memory}),
        ("default matrix, memory off", {"memory": False}),
        ("mode='reference', memory off", {"mode": "reference", "memory": False}),
        ("mode='exact', memory off", {"mode": "exact", "memory": False}),
    ]
    print("| run | cases | median s | min s | per case ms | verdict |")
    print("|---|---|---|---|---|---|")
    reports = []
    for label, kw in rows:
        times, report = timed(args.repeats, fns, inputs=(z, W_O), **kw)
        reports.append(report)
        n = len(report.cases)
        med = statistics.median(times)
        verdict = "passed" if report.passed else f"failed ({len(report.failures)} failures)"
        print(f"| {label} | {n} | {med:.2f} | {min(times):.2f} | {1000 * med / n:.0f} | {verdict} |")
    print()
    print(reports[0].summary())  # the default matrix: its verdict and the memory side by side


if __name__ == "__main__":
    main()
