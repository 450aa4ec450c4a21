"""How long the doctor takes: ``diagnose()`` over a 20-step GPT-2 training trace and a 1M-op one.

1. A real trace: 20 AdamW steps of transformers' GPT-2 (``GPT2Config(n_layer=4, n_embd=256,
   n_head=4)``, the issue's model; a small vocabulary and batch, which change no op count) recorded
   by ``memtrim.track``: about 27k ops.
2. A synthetic trace of at least 1,000,000 ops: one recorded GPT-2 step tiled end to end (ticks,
   op numbers and allocation rows shifted per copy), so it has real data flow, saved tensors, a loss,
   a backward and an optimizer step in every stretch.

For each: the time to build the Analysis (``analyze``) and, on a fresh Analysis each round, the time
of ``diagnose()`` (which builds the data-flow index and runs every rule), median of ``--repeats``.
Target (issue 12): under 1 s for the 20-step trace; the 1M-op figure shows no quadratic scan (about
40x the 27k-op one for 37x the ops). Timings on a shared machine are noisy: see the load line.

    python bench/diagnose.py [--repeats 3] [--ops 1000000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
import transformers

import memtrim
from memtrim.analysis import analyze
from memtrim.doctor.diagnosis import diagnose
from memtrim.trace.model import AllocationLog, AllocRow, FreeRow, OpLog, OpRow, TraceLog


def gpt2_trace(steps: int) -> TraceLog:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=512, n_positions=32)
    model = transformers.GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 512, (1, 32))
    with memtrim.track() as trace:
        for _ in range(steps):
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            opt.step()
            opt.zero_grad()
    return trace.log


def tiled(log: TraceLog, min_ops: int) -> TraceLog:
    """``log`` repeated end to end until it has at least ``min_ops`` ops."""
    rows = log.ops.rows
    allocations = log.allocations
    copies = -(-min_ops // len(rows))
    span = log.end_tick + 1
    ops = OpLog()
    recorded = AllocationLog()
    seq_of = {}  # allocation id -> the op number that made it (-1: from before the region)
    ticks = [row.tick for row in rows]
    import bisect

    for a in allocations:
        seq_of[a.id] = -1 if a.preexisting else bisect.bisect_right(ticks, a.alloc_tick) - 1
    for copy in range(copies):
        tick_shift, seq_shift, id_shift = copy * span, copy * len(rows), copy * len(allocations)
        for row in rows:
            ops.rows.append(
                OpRow(
                    row.tick + tick_shift,
                    row.op,
                    row.phase,
                    row.site,
                    row.node,
                    row.module,
                    tuple(i + id_shift for i in row.inputs),
                )
            )
        for a in allocations:
            seq = seq_of[a.id]
            recorded.rows.append(
                AllocRow(
                    seq + seq_shift if seq >= 0 else -1,
                    a.bytes,
                    a.dtype,
                    a.shape,
                    a.device,
                    a.alloc_tick + tick_shift if not a.preexisting else -1,
                    a.call_site,
                )
            )
            if a.free_tick is not None:
                recorded.frees[a.id + id_shift] = FreeRow(a.free_tick + tick_shift, a.free_phase or a.phase)
            if a.saved:
                recorded.saved.add(a.id + id_shift)
    out = TraceLog(ops=ops, end_tick=copies * span, finished=True)
    out.recorded = recorded
    return out


def timed(log: TraceLog, repeats: int) -> tuple[float, float, int]:
    start = time.perf_counter()
    analysis = analyze(log)
    build = time.perf_counter() - start
    runs = []
    found = 0
    for _ in range(repeats):
        fresh = analyze(log)
        start = time.perf_counter()
        found = len(diagnose(fresh))
        runs.append(time.perf_counter() - start)
    del analysis
    return build, statistics.median(runs), found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ops", type=int, default=1_000_000)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (timings on a shared machine)")
    log = gpt2_trace(args.steps)
    one_step = gpt2_trace(1)
    for name, trace in (
        (f"GPT-2, {args.steps} AdamW steps", log),
        (f"GPT-2 step tiled to >= {args.ops:,} ops", tiled(one_step, args.ops)),
    ):
        build, seconds, found = timed(trace, args.repeats)
        print(
            f"{name}: {len(trace.ops):,} ops, {len(trace.allocations):,} allocations; "
            f"analyze {build:.2f} s; diagnose {seconds:.3f} s (median of {args.repeats}), {found} findings"
        )


if __name__ == "__main__":
    main()
