"""The views of a million-op trace: how long ``memtrim export`` takes for each, how big the files are, and
what the memory_viz export says the viewer will list.

The trace is bench/diagnose.py's (as bench/trace_io.py's): one recorded GPT-2 training step tiled end
to end to ``--ops`` ops, saved to a file. Each export runs as a user runs it, a fresh
``python -m memtrim export trace.json --html FILE`` (``--perfetto``, ``--memory-viz``): read the file,
analyse it, (for the HTML) diagnose it, write the view; median of ``--repeats``. Then the same steps
timed one by one in this process, so the line shows where each export's time goes. When headless
Chromium is there (``make browser``), the HTML is opened in it: its load time, its console, and whether
it opens on the peak's op.

Targets (issue 22, item 3): ``--html`` and ``--perfetto`` each at most 5 s for a million ops; the HTML
under 10 MB. Timings on a shared machine are noisy: see the load line.

    python bench/views.py [--ops 1000000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from diagnose import gpt2_trace, tiled

from memtrim.analysis import analyze
from memtrim.doctor import diagnoses
from memtrim.report import html, memory_viz, perfetto
from memtrim.trace import serialize, stream

ROOT = Path(__file__).resolve().parents[1]
EXPORT_TARGET_S = 5.0
HTML_TARGET_MB = 10.0
CHROMIUM_TARGET_S = 3.0
VIEWS = (("html", "--html", "report.html"), ("perfetto", "--perfetto", "t.perfetto.json"))
VIEWS += (("memory_viz", "--memory-viz", "t.pickle"),)


def median_s(run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def export(folder: str, flag: str, out: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "memtrim", "export", "trace.json", flag, out],
        cwd=folder,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        raise SystemExit(f"memtrim export {flag} failed:\n{done.stderr}")
    return done


def verdict(met: bool) -> str:
    return "met" if met else "NOT met"


def chromium_check(path: Path, peak_op: int) -> str:
    sys.path.insert(0, str(ROOT / "tests"))
    import chromium

    executable, why = chromium.find()
    if executable is None:
        return f"Chromium: not run ({why})"
    browser = chromium.Browser(executable)
    try:
        start = time.perf_counter()
        browser.open(path)
        ready = browser.evaluate("document.body.getAttribute('data-memtrim-ready')")
        seconds = time.perf_counter() - start
        heading = browser.evaluate("document.getElementById('memtrim-alive-heading').innerText")
        problems = browser.problems()
    finally:
        browser.close()
    on_peak = heading.startswith(f"Alive after op {peak_op} (") and ", the peak)" in heading
    return (
        f"Chromium: loaded and ready ({ready}) in {seconds:.2f} s (target under {CHROMIUM_TARGET_S:.0f} s)"
        f" -> {verdict(seconds < CHROMIUM_TARGET_S and ready == 'yes' and not problems and on_peak)}; "
        f"{len(problems)} console problems; opens on {heading.removesuffix(', by source line:')!r} "
        f"(the peak's op: {peak_op:,})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (timings on a shared machine)")
    with tempfile.TemporaryDirectory() as folder:
        trace_path = os.path.join(folder, "trace.json")
        log = tiled(gpt2_trace(1), args.ops)
        stream.save(log, trace_path)
        mib = os.path.getsize(trace_path) / 2**20
        print(f"trace: {len(log.ops):,} ops, {len(log.allocations):,} allocations, {mib:,.0f} MiB of JSON")
        del log

        ends: dict[str, float] = {}
        said: dict[str, str] = {}
        for name, flag, out in VIEWS:
            runs = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                done = export(folder, flag, out)
                runs.append(time.perf_counter() - start)
            ends[name] = statistics.median(runs)
            said[name] = "\n".join(
                line for line in done.stderr.splitlines() if not line.startswith(f"memtrim: wrote {out}")
            )

        # the same steps one by one, in this process
        with serialize.collector_paused():
            start = time.perf_counter()
            loaded = serialize.load(trace_path)
            read = time.perf_counter() - start
            start = time.perf_counter()
            analysis = analyze(loaded)
            _ = analysis.peak, analysis.roles
            analysed = time.perf_counter() - start
            start = time.perf_counter()
            diagnoses(analysis)
            diagnosed = time.perf_counter() - start
        html_path = os.path.join(folder, "report.html")

        def write_html() -> None:  # as Trace.save_html writes it: the cycle collector paused
            with serialize.collector_paused():
                Path(html_path).write_text(html.report_html(analysis), encoding="utf-8")

        page = median_s(write_html, args.repeats)
        perfetto_path = os.path.join(folder, "t.perfetto.json")
        chrome = median_s(lambda: perfetto.save(analysis, perfetto_path), args.repeats)
        pickle_path = os.path.join(folder, "t.pickle")
        snapshot = median_s(lambda: memory_viz.save(analysis, pickle_path), args.repeats)
        peak_tick = analysis.peak.tick
        op_ticks = [row.tick for row in loaded.ops.rows]
        peak_op = max(i for i, t in enumerate(op_ticks) if peak_tick is not None and t <= peak_tick)

        steps = f"read {read:.1f} s, analyse {analysed:.1f} s"
        for name, view, extra in (
            ("html", page, f", diagnose {diagnosed:.1f} s"),
            ("perfetto", chrome, ""),
            ("memory_viz", snapshot, ""),
        ):
            target = (
                f" (target at most {EXPORT_TARGET_S:.0f} s) -> {verdict(ends[name] <= EXPORT_TARGET_S)}"
                if name != "memory_viz"
                else ""
            )
            print(
                f"memtrim export --{name.replace('_', '-')}: {ends[name]:.1f} s end to end{target}; "
                f"in one process: {steps}{extra}, the view {view:.2f} s (medians of {args.repeats})"
            )

        raw = Path(html_path).read_text(encoding="utf-8")
        html_mb = len(raw.encode()) / 1e6
        block = re.search(r'<script type="application/json" id="memtrim-data">(.*?)</script>', raw, re.S)
        points = len(json.loads(block.group(1))["points"]["x"]) if block else 0
        print(
            f"HTML: {html_mb:.2f} MB (target under {HTML_TARGET_MB:.0f} MB) -> "
            f"{verdict(html_mb < HTML_TARGET_MB)}; the timeline's {points:,} points"
        )
        print(f"Perfetto: {os.path.getsize(perfetto_path) / 1e6:.1f} MB; {said['perfetto'] or 'no note'}")
        pickle_mb = os.path.getsize(pickle_path) / 1e6
        print(f"memory_viz: {pickle_mb:.0f} MB pickle; {said['memory_viz'] or 'no note'}")
        print(chromium_check(Path(html_path), peak_op))


if __name__ == "__main__":
    main()
