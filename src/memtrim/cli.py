"""The ``memtrim`` command: thin glue over the library."""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
from collections.abc import Sequence

from memtrim.api import load, track
from memtrim.trace.serialize import TraceFormatError


def _run(args: argparse.Namespace) -> int:
    if not os.path.isfile(args.script):
        print(f"memtrim run: no such script {args.script!r}", file=sys.stderr)
        return 2
    sys.argv = [args.script, *args.args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))
    status = 0
    with track(fake=args.fake) as trace:
        try:
            runpy.run_path(args.script, run_name="__main__")
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else 1
        except BaseException as exc:  # the trace up to the failure is what the user came for
            print(f"memtrim run: {args.script} raised {type(exc).__name__}: {exc}", file=sys.stderr)
            status = 1
            trace.log.error = f"{type(exc).__name__}: {exc}"
    trace.save(args.output)
    print(json.dumps(trace.to_dict()["peak"]) if args.json else trace.report(top=args.top))
    print(f"\ntrace written to {args.output} (memtrim show {args.output})", file=sys.stderr)
    return status


def _show(args: argparse.Namespace) -> int:
    try:
        trace = load(args.trace)
    except (OSError, TraceFormatError) as exc:
        print(f"memtrim show: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(trace.to_dict(), indent=1))
    else:
        print(trace.report(top=args.top))
    return 0


def _demo(args: argparse.Namespace) -> int:
    if args.case == "gsq":
        from memtrim.cases.gsq import main as gsq_main

        return gsq_main(args.rest)
    if args.case == "gpt":
        from memtrim.cases.gpt_demo import gpt_demo

        return gpt_demo(args.rest)
    from memtrim.cases.demo import heads_demo

    return heads_demo(args.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memtrim",
        description="Find what sets a PyTorch program's peak memory, cut it, and prove the rewrite safe.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a Python script under the tracker and report its peak")
    run.add_argument("script")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    run.add_argument("-o", "--output", default="memtrim-trace.json", help="where to write the trace (JSON)")
    run.add_argument("--fake", action="store_true", help="run under FakeTensorMode: nothing is allocated")
    run.add_argument("--json", action="store_true", help="print the peak as JSON instead of the report")
    run.add_argument("--top", type=int, default=5, help="rows per table (default 5)")
    run.set_defaults(handler=_run)

    show = sub.add_parser("show", help="report a saved trace")
    show.add_argument("trace")
    show.add_argument("--json", action="store_true", help="print the whole trace as JSON")
    show.add_argument("--top", type=int, default=5)
    show.set_defaults(handler=_show)

    demo = sub.add_parser("demo", help="run a built-in case: heads (default) or gsq")
    demo.add_argument("case", nargs="?", choices=["heads", "gsq", "gpt"], default="heads")
    demo.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the case")
    demo.set_defaults(handler=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except BrokenPipeError:  # `memtrim show t.json --json | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
