"""Tracking overhead: untracked vs memtrim.track() vs torch.profiler, A/B interleaved, medians.

    python bench/overhead.py [--repeats N]

Targets (issue 2): at most 1.10x on the head-results workload, at most 3x on the op-heavy
small-tensor workload, where torch.profiler (profile_memory, with_stack, record_shapes) costs ~10x.
Untracked, memtrim and the empty mode run in turn in one loop, the profiler in its own A/B loop
(medians of --repeats rounds), with garbage collected before every run. The "empty mode" column is
a TorchDispatchMode that only calls each op: the part of any dispatch-mode tracker's cost that no
Python code inside it can remove.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

import memtrim
from memtrim.cases.heads import head_results


def heads_workload() -> Callable[[], None]:
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(512, 12, 64, generator=gen, requires_grad=True)
    W_O = torch.randn(12, 64, 768, generator=gen, requires_grad=True)

    def step() -> None:
        z.grad = W_O.grad = None
        head_results(z, W_O).square().sum().backward()

    return step


def op_heavy_workload() -> Callable[[], None]:
    torch.manual_seed(0)
    width = 64
    model = torch.nn.Sequential(
        *[
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.LayerNorm(width))
            for _ in range(24)
        ]
    )
    x = torch.randn(8, width)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()

    return step


class EmptyMode(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def timed(fn: Callable[[], None]) -> float:
    # Start every run with the collector's debts paid, so that garbage one variant left (the
    # profiler makes many objects) is not collected on another variant's clock.
    gc.collect()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved(variants: list[Callable[[], None]], repeats: int) -> list[float]:
    """Median times of ``variants`` run in turn, ``repeats`` rounds, after one warm-up run of each:
    a slow spell of the machine then lands on every variant alike."""
    for fn in variants:
        fn()
    times: list[list[float]] = [[] for _ in variants]
    for _ in range(repeats):
        for fn, sample in zip(variants, times, strict=True):
            sample.append(timed(fn))
    return [statistics.median(sample) for sample in times]


def measure(step: Callable[[], None], repeats: int) -> dict[str, float]:
    """Untracked, memtrim and the empty mode interleaved in one loop; the profiler against untracked
    runs in a loop of its own, because its many allocations change the allocator's state under
    whatever runs next."""

    def tracked() -> None:
        with memtrim.track():
            step()

    def profiled() -> None:
        with profile(
            activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True, record_shapes=True
        ):
            step()

    def empty_mode() -> None:
        with EmptyMode():
            step()

    base, ours, empty = interleaved([step, tracked, empty_mode], repeats)
    base_p, prof = interleaved([step, profiled], repeats)
    return {
        "untracked": base,
        "memtrim": ours,
        "memtrim_ratio": ours / base,
        "empty_ratio": empty / base,
        "profiler": prof,
        "profiler_ratio": prof / base_p,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=151)
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{args.repeats} interleaved runs each\n"
    )
    print(
        "| workload | untracked | memtrim.track | ratio | empty mode, ratio | torch.profiler | ratio "
        "| target |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, make, target in [
        ("head results, GPT-2 small, 512 tokens, fwd+bwd (einsum)", heads_workload, 1.10),
        ("24 x Linear/GELU/LayerNorm, batch 8, width 64, fwd+bwd", op_heavy_workload, 3.0),
    ]:
        m = measure(make(), args.repeats)
        base = m["untracked"]
        ours, prof = m["memtrim_ratio"], m["profiler_ratio"]
        verdict = "met" if ours <= target else "MISSED"
        print(
            f"| {name} | {base * 1e3:.2f} ms | {m['memtrim'] * 1e3:.2f} ms | {ours:.3f}x | "
            f"{m['empty_ratio']:.3f}x | {m['profiler'] * 1e3:.2f} ms | {prof:.3f}x | <= {target}x {verdict} |"
        )


if __name__ == "__main__":
    main()
