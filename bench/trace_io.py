"""Saving and loading a million-op trace: seconds per million ops, and the loader's fast row readers
against its field-by-field checks on the same parsed file (A/B interleaved in one process, medians).

The trace is bench/diagnose.py's: one recorded GPT-2 training step tiled end to end to ``--ops`` ops
(real data flow, saved tensors, an optimizer step in every stretch). Target (issue 22, item 4): a save
in at most 3 s per million ops. Timings on a shared machine are noisy: see the load line.

    python bench/trace_io.py [--ops 1000000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from diagnose import gpt2_trace, tiled

from memtrim.trace import serialize, stream

SAVE_TARGET_S_PER_MILLION = 3.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (timings on a shared machine)")
    log = tiled(gpt2_trace(1), args.ops)
    millions = len(log.ops) / 1e6
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        saves, loads, fast, slow = [], [], [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            stream.save(log, path)
            saves.append(time.perf_counter() - start)
            start = time.perf_counter()
            serialize.load(path)
            loads.append(time.perf_counter() - start)
            with serialize.collector_paused():  # as load() reads: parse, then the checks
                data = json.loads(Path(path).read_bytes())
                for checks, runs in ((True, fast), (False, slow)):
                    start = time.perf_counter()
                    serialize.log_from_dict(data, fast=checks)
                    runs.append(time.perf_counter() - start)
                del data
        size = os.path.getsize(path)
    save, load = statistics.median(saves), statistics.median(loads)
    read_fast, read_slow = statistics.median(fast), statistics.median(slow)
    mib = size / 2**20
    print(f"trace: {len(log.ops):,} ops, {len(log.allocations):,} allocations, {mib:,.0f} MiB of JSON")
    print(
        f"save: {save / millions:.2f} s per million ops (target at most {SAVE_TARGET_S_PER_MILLION:.0f} s)"
        f" -> {'met' if save / millions <= SAVE_TARGET_S_PER_MILLION else 'NOT met'}"
    )
    print(f"load: {load / millions:.2f} s per million ops (JSON parse, then the checks)")
    print(
        f"checks, fast row readers vs field by field: {read_fast:.2f} s vs {read_slow:.2f} s"
        f" = {read_slow / read_fast:.2f}x faster (medians of {args.repeats})"
    )


if __name__ == "__main__":
    main()
