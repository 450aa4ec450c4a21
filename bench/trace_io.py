"""Saving and loading a million-op trace: seconds per million ops, the file's size, and a load split
into the JSON parse and the checks (medians).

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
        saves, loads, parses, checks = [], [], [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            stream.save(log, path)
            saves.append(time.perf_counter() - start)
            start = time.perf_counter()
            serialize.load(path)
            loads.append(time.perf_counter() - start)
            with serialize.collector_paused():  # as load() reads: parse, then the checks
                start = time.perf_counter()
                data = json.loads(Path(path).read_bytes())
                parses.append(time.perf_counter() - start)
                start = time.perf_counter()
                serialize.log_from_dict(data)
                checks.append(time.perf_counter() - start)
                del data
        size = os.path.getsize(path)
    save, load = statistics.median(saves), statistics.median(loads)
    mib = size / 2**20
    print(f"trace: {len(log.ops):,} ops, {len(log.allocations):,} allocations, {mib:,.0f} MiB of JSON")
    print(
        f"save: {save / millions:.2f} s per million ops (target at most {SAVE_TARGET_S_PER_MILLION:.0f} s)"
        f" -> {'met' if save / millions <= SAVE_TARGET_S_PER_MILLION else 'NOT met'}"
    )
    print(
        f"load: {load / millions:.2f} s per million ops (JSON parse {statistics.median(parses):.2f} s,"
        f" then the checks {statistics.median(checks):.2f} s; medians of {args.repeats})"
    )


if __name__ == "__main__":
    main()
