"""What a long run's recording holds: Python memory per recorded op after a ``--steps`` loop of small
tensor ops under ``memtrim.track()``, and the save of that trace in seconds per million ops.

The loop is a small-op training step (a 2-layer MLP at batch 4, width 16: forward, backward, SGD step,
zero_grad), the kind of program issue 22 names. Python memory is tracemalloc's count of what is
allocated and still held, read inside the region at the end of the loop (the recorder's rows, sites,
frees and facts; tensors of the loop are freed by then) less the same reading before the region.
tracemalloc slows the loop; the figure does not depend on speed. Target (issue 22, item 4): at most
100 B per recorded op, and a save in at most 3 s per million ops.

The recorder packs all but its latest rows every few thousand ops (memtrim.trace.packed). What that
costs in time is printed last: a 1,500-step region of the same loop with packing and with it switched
off (``SEAL_EVERY`` out of reach), alternating, tracemalloc off, medians of ``--rounds``.

    python bench/long_run_memory.py [--steps 20000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
import tracemalloc

import torch

import memtrim
from memtrim.capture import recorder
from memtrim.trace import stream

BYTES_PER_OP_TARGET = 100
SAVE_TARGET_S_PER_MILLION = 3.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (timings on a shared machine)")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 16)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    start = time.perf_counter()
    with memtrim.track() as trace:
        for _ in range(args.steps):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    loop = time.perf_counter() - start
    tracemalloc.stop()
    ops, rows = len(trace.log.ops), len(trace.log.allocations)
    per_op = held / ops
    print(
        f"{args.steps:,} steps: {ops:,} ops, {rows:,} allocations recorded in {loop:.0f} s (tracemalloc on)"
    )
    print(
        f"held by the recording: {held / 2**20:.1f} MiB = {per_op:.0f} B per recorded op "
        f"(target at most {BYTES_PER_OP_TARGET} B) -> {'met' if per_op <= BYTES_PER_OP_TARGET else 'NOT met'}"
    )
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        start = time.perf_counter()
        stream.save(trace.log, path)
        save = time.perf_counter() - start
        size = os.path.getsize(path)
    per_million = save / (ops / 1e6)
    met = "met" if per_million <= SAVE_TARGET_S_PER_MILLION else "NOT met"
    print(
        f"save: {save:.2f} s, {per_million:.2f} s per million ops (target at most "
        f"{SAVE_TARGET_S_PER_MILLION:.0f} s) -> {met}; {size / 2**20:.1f} MiB of JSON"
    )
    packing_cost(model, opt, x, args.rounds)


def packing_cost(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, rounds: int) -> None:
    times: dict[str, list[float]] = {"packed": [], "not packed": []}
    every = recorder.SEAL_EVERY
    try:
        for _ in range(rounds):
            for name, seal_every in (("packed", every), ("not packed", 10**15)):
                recorder.SEAL_EVERY = seal_every
                gc.collect()
                start = time.perf_counter()
                with memtrim.track() as trace:
                    for _ in range(1500):
                        model(x).sum().backward()
                        opt.step()
                        opt.zero_grad()
                times[name].append(time.perf_counter() - start)
                del trace
    finally:
        recorder.SEAL_EVERY = every
    packed, unpacked = statistics.median(times["packed"]), statistics.median(times["not packed"])
    print(
        f"a 1,500-step region: {packed:.2f} s packed, {unpacked:.2f} s not packed "
        f"(medians of {rounds}, alternating): packing costs {packed / unpacked:.3f}x"
    )


if __name__ == "__main__":
    sys.exit(main())
