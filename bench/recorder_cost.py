"""Where the recorder's time goes on the op-heavy step (issue 22 item 1): one region per step against
one region around ten steps (what each region costs on top of its ops), and the time inside the ops
themselves under the empty mode and under memtrim (what is left is memtrim's own Python per dispatch).

    python bench/recorder_cost.py [--rounds N]

The step is bench/overhead.py's 24 x Linear/GELU/LayerNorm at batch 8, width 64, forward and backward.
Variants run in turn in one loop (``--rounds`` rounds, medians), garbage collected before each. The op
time is summed around each op's call (the recorder's per-overload call, wrapped for this run only; in the
empty mode, the same timing inline): it shows whether tracking slows the ops or only adds Python around
them. The wrapper is one more Python call per op in memtrim's rows, so its ratios read a little above
bench/overhead.py's, which is the figure to quote against the target.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import memtrim
from memtrim.capture import recorder

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import EmptyMode, op_heavy_workload

STEPS = 10
_in_ops = [0]


class _TimedEmpty(EmptyMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        start = time.perf_counter_ns()
        out = func._op(*args, **(kwargs or {}))
        _in_ops[0] += time.perf_counter_ns() - start
        return out


def _time_the_recorders_ops() -> None:
    made = recorder._new_info

    def timed(call: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter_ns()
            out = call(*args, **kwargs)
            _in_ops[0] += time.perf_counter_ns() - start
            return out

        return run

    def new_info(func: Any) -> Any:
        info = made(func)
        info.call = timed(info.call)
        return info

    recorder._infos.clear()
    recorder._new_info = new_info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args()
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    print(f"load average {load:.1f} on {os.cpu_count()} cores; torch {torch.__version__}, 1 thread")
    _time_the_recorders_ops()
    step = op_heavy_workload()

    def untracked() -> None:
        for _ in range(STEPS):
            step()

    def empty() -> None:
        with _TimedEmpty():
            untracked()

    def one_region() -> None:
        with memtrim.track():
            untracked()

    def region_per_step() -> None:
        for _ in range(STEPS):
            with memtrim.track():
                step()

    variants = {"untracked": untracked, "empty": empty, "one_region": one_region, "per_step": region_per_step}
    times: dict[str, list[float]] = {name: [] for name in variants}
    in_ops: dict[str, list[float]] = {name: [] for name in variants}
    with memtrim.track() as probe:
        step()
    dispatches = len(probe.log.ops)
    for fn in variants.values():
        fn()
    for _ in range(args.rounds):
        for name, fn in variants.items():
            gc.collect()
            _in_ops[0] = 0
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) / STEPS)
            in_ops[name].append(_in_ops[0] / 1e9 / STEPS)
    med = {name: statistics.median(v) * 1e3 for name, v in times.items()}  # ms
    ops = {name: statistics.median(v) * 1e3 for name, v in in_ops.items()}
    own = med["one_region"] - ops["one_region"] - (med["empty"] - ops["empty"])
    one, per, empty = med["one_region"], med["per_step"], med["empty"]
    print(f"{dispatches} recorded ops per step; per step (medians of {args.rounds} rounds of {STEPS} steps):")
    print(
        f"  untracked {med['untracked']:.2f} ms; empty mode {empty:.2f} ms (in the ops {ops['empty']:.2f} ms)"
    )
    print(
        f"  memtrim, one region around {STEPS} steps: {one:.2f} ms (in the ops {ops['one_region']:.2f} ms) "
        f"= {one / empty:.3f}x the empty mode"
    )
    print(
        f"  memtrim, one region per step: {per:.2f} ms = {per / empty:.3f}x the empty mode (target 1.3x); "
        f"a region costs {per - one:.2f} ms more"
    )
    print(
        f"  memtrim's own Python around the ops: {own:.2f} ms per step, {own / dispatches * 1e3:.1f} us per "
        f"recorded op; the ops take {ops['one_region'] / ops['empty']:.2f}x their time under the empty mode"
    )


if __name__ == "__main__":
    main()
