"""The ``memtrim`` command: thin glue over the library.

Expected failures (a missing script, an unreadable trace, an unwritable output path, a missing
optional extra) raise :class:`CliError` anywhere below, and :func:`main` — the one place that catches
them — prints one line that names the fix (exit 2 for bad usage, 1 otherwise). What the user's script
raises is not one of them: it is printed as Python would print it, and the script's exit status is
memtrim's.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import runpy
import shlex
import signal
import sys
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from memtrim.api import Diff, RanksDiff, Trace, diff, load, rank_set, track
from memtrim.trace.serialize import TraceFormatError, check_writable

_HERE = os.path.dirname(os.path.abspath(__file__))
_MEMTRIM_FRAMES = (os.path.join(_HERE, "cli.py"), os.path.join(_HERE, "capture") + os.sep)


class CliError(Exception):
    """An expected failure, said in one line that names the fix."""

    status = 1


class UsageError(CliError):
    """Bad input from the command line: exit status 2."""

    status = 2


# -- progress ------------------------------------------------------------------------------------
@contextlib.contextmanager
def progress(label: str) -> Iterator[None]:
    """A spinner on stderr while a long analysis or export runs (only on a terminal)."""
    if not sys.stderr.isatty():
        yield
        return
    from rich.console import Console

    with Console(stderr=True).status(f"memtrim: {label}…", spinner="dots"):
        yield


# -- outputs -------------------------------------------------------------------------------------
VIEWS = (
    ("html", "--html", "write the HTML report (one self-contained file)"),
    ("png", "--png", "write the timeline as a PNG (needs the 'plots' extra: matplotlib)"),
    ("perfetto", "--perfetto", "write Chrome-trace JSON for ui.perfetto.dev"),
    ("memory_viz", "--memory-viz", "write a snapshot pickle for pytorch.org/memory_viz"),
)


def _add_views(parser: argparse.ArgumentParser) -> None:
    for dest, flag, help_text in VIEWS:
        parser.add_argument(flag, dest=dest, metavar="FILE", help=help_text)


def _check_output(flag: str, path: str | None) -> None:
    if path is None:
        return
    try:
        check_writable(path)
    except OSError as exc:
        raise UsageError(
            f"cannot write {flag} {path}: {exc}; create the folder or give another path"
        ) from exc


def _check_views(args: argparse.Namespace) -> None:
    """Every output path and extra a run will need, checked before it starts."""
    for dest, flag, _ in VIEWS:
        _check_output(flag, getattr(args, dest, None))
    if getattr(args, "png", None):
        from memtrim.report.plot import MissingExtra, require_matplotlib

        try:
            require_matplotlib()
        except MissingExtra as exc:
            raise CliError(str(exc)) from exc


def _write_views(trace: Trace, args: argparse.Namespace) -> None:
    written = []
    notes = []  # what a viewer will not show of a long trace, said after the files it is about
    if args.html:
        with progress("writing the HTML report"):
            trace.save_html(args.html)
        written.append(args.html)
    if args.png:
        with progress("drawing the PNG"):
            trace.save_png(args.png)
        written.append(args.png)
    if args.perfetto:
        from memtrim.report import perfetto

        with progress("writing the Perfetto trace"):
            thinning = perfetto.save(trace.analysis, args.perfetto)
        written.append(args.perfetto)
        if thinning.thinned:
            notes.append(f"{args.perfetto} holds {thinning.text()}")
    if args.memory_viz:
        from memtrim.report import memory_viz

        with progress("writing the memory_viz snapshot"):
            counts = memory_viz.save(trace.analysis, args.memory_viz)
        written.append(args.memory_viz)
        notes.append(f"{args.memory_viz}: {memory_viz.viewer_note(counts)}")
    for path in written:
        print(f"memtrim: wrote {path}", file=sys.stderr)
    for note in notes:
        print(f"memtrim: {note}", file=sys.stderr)


def _report(trace: Trace, args: argparse.Namespace) -> None:
    with progress("analysing the trace"):
        trace.diagnoses()  # the analysis and its diagnoses, computed once
    print(json.dumps(trace.to_dict()["peak"]) if args.json else trace.report(top=args.top))


def _load(path: str) -> Trace:
    # The commands that read traces (show, export, diff) keep them to the end of the process, and their
    # rows hold no reference cycles: the cyclic collector would walk them on every full pass and free
    # nothing (0.8 s a pass on a million-op trace), so they are frozen out of its sight as they arrive.
    # Refcounting still frees them.
    collecting = gc.isenabled()
    gc.disable()
    try:
        with progress(f"reading {path}"):
            return load(path)
    except FileNotFoundError as exc:
        raise UsageError(f"no such trace file {path!r}; give a file written by memtrim run -o") from exc
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except TraceFormatError as exc:
        raise UsageError(f"{exc} (give a file written by memtrim run -o or Trace.save)") from exc
    finally:
        gc.freeze()
        if collecting:
            gc.enable()


# -- running the user's program --------------------------------------------------------------------
@dataclass
class Outcome:
    """How the program ended. ``held`` keeps its globals (and a failure's frames) alive until the
    region is closed, so what the program still holds at the end counts as alive, not as freed."""

    status: int = 0
    failure: BaseException | None = None
    message: str | None = None
    held: list[Any] = field(default_factory=list)
    pid: int = field(default_factory=os.getpid)
    """The process that started the run: a child the program forks never reports or writes."""


def _exit_status(exc: SystemExit, outcome: Outcome) -> None:
    """``sys.exit()`` semantics, as the interpreter applies them."""
    code = exc.code
    if code is None:
        outcome.status = 0
    elif isinstance(code, int):
        outcome.status = code
    else:
        outcome.status, outcome.message = 1, str(code)


def _execute(args: argparse.Namespace, outcome: Outcome) -> None:
    try:
        if args.module:
            outcome.held.append(runpy.run_module(args.module, run_name="__main__", alter_sys=True))
        else:
            # the absolute path, as Python 3.11 names a script it runs (tracebacks, __file__)
            outcome.held.append(runpy.run_path(os.path.abspath(args.script), run_name="__main__"))
    except SystemExit as exc:
        _exit_status(exc, outcome)
        outcome.held.append(exc)
    except KeyboardInterrupt as exc:
        outcome.status, outcome.failure = 130, exc
    except BaseException as exc:  # the trace up to the failure is what the user came for
        outcome.status, outcome.failure = 1, exc
    if os.getpid() != outcome.pid:
        _end_forked_child(outcome)


def _end_forked_child(outcome: Outcome) -> None:
    """A child of ``os.fork()`` that returned out of the program ends here, as Python would end it
    (its traceback or exit message, its status), before it could overwrite the parent's trace."""
    if outcome.failure is not None and not isinstance(outcome.failure, KeyboardInterrupt):
        print_traceback(outcome.failure)
    elif outcome.message is not None:
        print(outcome.message, file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(outcome.status)


def _die_by_sigint() -> None:
    """End as ``python`` does after an uncaught ``KeyboardInterrupt``: killed by SIGINT, so the shell or
    the parent sees the signal (status -2 to a subprocess), not a plain exit status."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)


def _strip(te: traceback.TracebackException, seen: set[int] | None = None) -> None:
    """Drop memtrim's and runpy's frames, so the traceback reads as ``python script.py`` prints it."""
    seen = set() if seen is None else seen
    if id(te) in seen:
        return
    seen.add(id(te))
    runpy_file = runpy.__file__ or "<frozen runpy>"
    kept = [
        f
        for f in te.stack
        if not (f.filename.startswith(_MEMTRIM_FRAMES) or f.filename in (runpy_file, "<frozen runpy>"))
    ]
    te.stack = traceback.StackSummary.from_list(kept)
    for chained in (te.__cause__, te.__context__):
        if chained is not None:
            _strip(chained, seen)


def print_traceback(exc: BaseException) -> None:
    te = traceback.TracebackException.from_exception(exc)
    _strip(te)
    print("".join(te.format()), file=sys.stderr, end="")


def _check_target(args: argparse.Namespace) -> None:
    if args.module:
        try:
            found = importlib.util.find_spec(args.module)
        except (ImportError, ValueError) as exc:
            raise UsageError(
                f"cannot find module {args.module!r} ({exc}); check the name and sys.path"
            ) from exc
        if found is None:
            raise UsageError(
                f"no module named {args.module!r}; check the name, or run it from its project folder"
            )
    elif not args.script:
        raise UsageError(
            "give a script to run (memtrim run train.py) or a module (memtrim run -m package.module)"
        )
    elif not os.path.isfile(args.script):
        raise UsageError(f"no such script {args.script!r}; give the path of a Python file")


def _rank_path(path: str | None, rank: int) -> str | None:
    """``trace.json`` -> ``trace.rank1.json``: one file per rank of a torchrun job."""
    from memtrim.trace.ranks import rank_path

    return None if path is None else rank_path(path, rank)


def _per_rank(args: argparse.Namespace) -> tuple[int, int]:
    """(rank, world size) under torchrun (``RANK``, ``WORLD_SIZE``), else (0, 1); each rank writes its
    own files, and only rank 0 reports."""
    from memtrim.capture.distributed import world_from_environment

    world = world_from_environment()
    if world is None:
        return 0, 1
    rank, size = int(world["rank"]), int(world["world_size"])
    args.rank_outputs = [_rank_path(args.output, r) for r in range(size)]
    args.output = _rank_path(args.output, rank)
    for dest, _, _ in VIEWS:
        setattr(args, dest, _rank_path(getattr(args, dest, None), rank))
    return rank, size


def _record(args: argparse.Namespace, outcome: Outcome) -> Trace | None:
    """Run the program once, recorded (only inside ``--region`` when given)."""
    if args.region:
        return _run_region(args, outcome)
    with track(fake=args.fake) as trace:
        _execute(args, outcome)
        if outcome.failure is not None and not isinstance(outcome.failure, KeyboardInterrupt):
            trace.log.error = f"{type(outcome.failure).__name__}: {outcome.failure}"
    return trace


def _set_program(args: argparse.Namespace) -> None:
    """``sys.argv`` and ``sys.path`` as ``python script.py ARGS`` (or ``python -m``) would set them."""
    if args.module:
        sys.argv = [args.module, *args.args]
        sys.path.insert(0, os.getcwd())
    else:
        sys.argv = [args.script, *args.args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))


def _read_plan(path: str) -> Any:
    from memtrim.plan import PlanFormatError, load_plan

    try:
        return load_plan(path)
    except FileNotFoundError as exc:
        raise UsageError(f"no such plan file {path!r}; give a file written by memtrim fit -o") from exc
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except PlanFormatError as exc:
        raise UsageError(f"{exc} (give a file written by memtrim fit -o or Plan.save)") from exc


@contextlib.contextmanager
def _plan_applied(path: str | None) -> Iterator[None]:
    if path is None:
        yield
        return
    from memtrim.plan.apply import applied

    plan = _read_plan(path)
    print(f"memtrim: running with the plan {path} ({len(plan.levers)} lever(s) applied)", file=sys.stderr)
    with applied(plan):
        yield


def _fit(args: argparse.Namespace) -> int:
    from memtrim.plan import parse_budget
    from memtrim.plan.command import fit_program

    _check_target(args)
    if args.budget is None:
        raise UsageError("give the memory budget to fit: memtrim fit --budget 24GiB script.py")
    try:
        budget = parse_budget(args.budget)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    _check_output("-o", args.output)
    _set_program(args)
    args.entry = None
    started_in = os.getcwd()

    def once() -> Any:
        outcome = Outcome()
        try:
            trace = _record(args, outcome)
        finally:
            with contextlib.suppress(OSError):
                os.chdir(started_in)
        failed = outcome.failure is not None or outcome.status != 0
        if outcome.failure is not None:
            print_traceback(outcome.failure)
        elif outcome.message is not None:
            print(outcome.message, file=sys.stderr)
        if isinstance(outcome.failure, KeyboardInterrupt):
            raise outcome.failure
        outcome.held.clear()
        if failed:
            print(
                f"memtrim: the program ended with status {outcome.status or 1}; nothing to fit",
                file=sys.stderr,
            )
            return None
        return None if trace is None else trace.analysis

    allow = frozenset({"exact", "reference", *args.allow})
    check = None
    if args.check_args is not None:
        if not args.fake:
            raise UsageError(
                "--check-args is the small config the numeric check of a --fake fit runs on; without "
                "--fake memtrim fit checks the program itself: drop --check-args or add --fake"
            )
        try:
            small_args = shlex.split(args.check_args)
        except ValueError as exc:
            raise UsageError(f"--check-args {args.check_args!r}: {exc}") from exc

        def check() -> Any:
            # the same script on real tensors, with the small config's arguments
            full_argv = sys.argv
            args.fake, sys.argv = False, [full_argv[0], *small_args]
            try:
                return once()
            finally:
                args.fake, sys.argv = True, full_argv

    label = f"arguments {args.check_args!r}" if args.check_args is not None else ""
    return fit_program(
        once, budget, allow=allow, output=args.output, fake=args.fake, check=check, check_label=label
    )


def _run(args: argparse.Namespace) -> int:
    _check_target(args)
    if args.plan is not None:
        _read_plan(args.plan)  # a bad plan file is said before the program runs
    rank, world_size = _per_rank(args)
    if args.entry is not None and not args.region:
        raise UsageError("--entry N picks an entry of --region NAME; give the region too")
    _check_output("-o", args.output)
    _check_views(args)
    _set_program(args)
    outcome = Outcome()
    started_in = os.getcwd()  # -o and the views name paths from here, whatever the program's os.chdir
    with _plan_applied(args.plan):
        trace = _record(args, outcome)
    with contextlib.suppress(OSError):  # back where the paths were given (unless that folder was removed)
        os.chdir(started_in)
    if outcome.failure is not None:
        print_traceback(outcome.failure)
    elif outcome.message is not None:
        print(outcome.message, file=sys.stderr)
    if trace is not None:
        trace.save(args.output)
        if rank == 0:
            _report(trace, args)
        _write_views(trace, args)
        if world_size > 1 and rank == 0:
            every = " ".join(args.rank_outputs)
            print(
                f"\nrank 0's report above; {world_size} rank traces written ({every}): memtrim show {every}",
                file=sys.stderr,
            )
        elif world_size == 1:
            print(f"\ntrace written to {args.output} (memtrim show {args.output})", file=sys.stderr)
    # the program's objects go only now, after the region closed and everything was written
    outcome.held.clear()
    interrupted, outcome.failure = isinstance(outcome.failure, KeyboardInterrupt), None
    if interrupted:
        _die_by_sigint()
    return outcome.status


def _run_region(args: argparse.Namespace, outcome: Outcome) -> Trace | None:
    from memtrim.capture.regions import capture_region

    with contextlib.ExitStack() as stack:
        if args.fake:
            from torch._subclasses.fake_tensor import FakeTensorMode

            stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        captured = stack.enter_context(capture_region(args.region, fake=args.fake))
        _execute(args, outcome)
    if not captured.traces:
        print(
            f"memtrim: the program never entered memtrim.region({args.region!r}); nothing was recorded "
            "(mark the code with `with memtrim.region(...)`, or run without --region)",
            file=sys.stderr,
        )
        outcome.status = outcome.status or 1
        return None
    traces = [Trace(log) for log in captured.traces]
    return _choose_entry(traces, args)


def _choose_entry(traces: list[Trace], args: argparse.Namespace) -> Trace:
    """The entry to report: the one whose absolute peak (with what was alive at its start) is highest —
    a training loop's later steps start with the optimizer state the first made — or ``--entry N``."""
    from memtrim.analysis.roles import Role
    from memtrim.trace.entries import RegionEntries, RegionEntry, note_entries

    entries = tuple(
        RegionEntry(
            i + 1,
            t.analysis.peak.bytes,
            t.analysis.absolute_peak_bytes,
            t.analysis.made_bytes(Role.OPTIMIZER_STATE),
        )
        for i, t in enumerate(traces)
    )
    chosen, picked = max(entries, key=lambda e: (e.absolute, -e.number)).number, "highest"
    if args.entry is not None and args.entry <= len(traces):
        chosen, picked = args.entry, "asked"
    elif args.entry is not None:  # the run is done: report what it recorded rather than lose it
        print(
            f"memtrim: --entry {args.entry}: the region {args.region!r} was entered {len(traces)} time(s); "
            f"reporting entry {chosen}, the highest",
            file=sys.stderr,
        )
    trace = traces[chosen - 1]
    if len(traces) > 1:
        note_entries(trace.log, RegionEntries(args.region, chosen, picked, entries))  # type: ignore[arg-type]
    return trace


# -- the other commands ------------------------------------------------------------------------------
def _show(args: argparse.Namespace) -> int:
    _check_views(args)
    if len(args.trace) > 1:
        return _show_ranks(args)
    trace = _load(args.trace[0])
    if args.json:
        print(json.dumps(trace.to_dict(), indent=1))
    else:
        _report(trace, args)
    _write_views(trace, args)
    return 0


def _show_ranks(args: argparse.Namespace) -> int:
    """``memtrim show trace.rank0.json trace.rank1.json ...``: the ranks of one job side by side."""
    from memtrim.report import ranks

    traces = [_load(path) for path in args.trace]
    if args.json:
        pairs = zip(traces, args.trace, strict=True)
        print(json.dumps([t.to_dict()["peak"] | {"trace": path} for t, path in pairs]))
    else:
        with progress("analysing the traces"):
            print(ranks.render([t.analysis for t in traces], top=args.top))
    if any(getattr(args, dest, None) for dest, _, _ in VIEWS):
        raise UsageError("views are written one trace at a time: memtrim show TRACE --html FILE")
    return 0


def _export(args: argparse.Namespace) -> int:
    if not any(getattr(args, dest) for dest, _, _ in VIEWS):
        raise UsageError("say what to export: --html, --png, --perfetto or --memory-viz FILE")
    _check_views(args)
    _write_views(_load(args.trace[0]), args)
    return 0


DIFF_USAGE = (
    "memtrim diff [options] BEFORE AFTER\n"
    "       memtrim diff [options] BEFORE.rank0.json BEFORE.rank1.json ... -- AFTER.rank0.json ..."
)
SETS_HINT = (
    "memtrim diff BEFORE AFTER for two traces; for two torchrun jobs, their rank traces with -- between: "
    "memtrim diff before.rank0.json before.rank1.json -- after.rank0.json after.rank1.json "
    "(or the base names given to -o: memtrim diff before.json after.json)"
)


def _diff_sides(args: argparse.Namespace) -> tuple[list[str], list[str], bool]:
    """The files before and after, and whether they are two jobs' rank traces: given with ``--``
    between, or as base names (``before.json``, no such file) whose ``before.rank*.json`` exist."""
    if args.after_set is not None:
        sides, sets = (args.traces, args.after_set), True
        for side, words in zip(("before", "after"), sides, strict=True):
            if not words:
                raise UsageError(f"no trace {side} --; {SETS_HINT}")
    elif len(args.traces) == 2:
        sides, sets = ([args.traces[0]], [args.traces[1]]), False
    else:
        raise UsageError(f"{len(args.traces)} traces given; {SETS_HINT}")
    found = [[name for _, name in rank_set(words)] for words in sides]
    sets = sets or any(names != list(words) for names, words in zip(found, sides, strict=True))
    return found[0], found[1], sets


def _diff(args: argparse.Namespace) -> int:
    _check_output("--html", args.html)
    before_files, after_files, sets = _diff_sides(args)
    if sets:
        return _diff_sets(args, before_files, after_files)
    before, after = _load(before_files[0]), _load(after_files[0])
    with progress("comparing the traces"):
        result = diff(before, after)
    _print_diff(result, args)
    if args.html:
        from memtrim.report.files import write_text

        write_text(args.html, result.html())
        print(f"memtrim: wrote {args.html}", file=sys.stderr)
    return 0


def _diff_sets(args: argparse.Namespace, before_files: list[str], after_files: list[str]) -> int:
    """Two torchrun jobs, rank by rank (ranks paired by the rank each trace recorded)."""
    from memtrim.analysis.rankdiff import RankSetError, diff_rank_sets

    if args.html:
        raise UsageError(
            "--html draws two traces, not two sets of ranks; draw one rank of each job "
            "(memtrim diff before.rank1.json after.rank1.json --html FILE), or use --markdown or --json"
        )
    before = [_load(path) for path in before_files]
    after = [_load(path) for path in after_files]
    try:
        with progress("comparing the ranks"):
            analyses = [t.analysis for t in before], [t.analysis for t in after]
            result = RanksDiff(diff_rank_sets(*analyses, names=(before_files, after_files)))
    except RankSetError as exc:
        raise UsageError(str(exc)) from exc
    _print_diff(result, args)
    return 0


def _print_diff(result: Diff | RanksDiff, args: argparse.Namespace) -> None:
    """A comparison as JSON, Markdown or the terminal text, as asked."""
    if args.json:
        print(json.dumps(result.to_dict(), indent=1))
    elif args.markdown:
        print(result.markdown(top=args.top))
    else:
        print(result.report(top=args.top))


def _demo(args: argparse.Namespace) -> int:
    if args.case == "gsq":
        from memtrim.cases.gsq import main as gsq_main

        return gsq_main(args.rest)
    if args.case == "gpt":
        from memtrim.cases.gpt_demo import gpt_demo

        return gpt_demo(args.rest)
    from memtrim.cases.demo import heads_demo

    return heads_demo(args.rest)


# -- parsing -----------------------------------------------------------------------------------------
def rows(value: str) -> int:
    """``--top``: a whole number of table rows, 1 or more."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a whole number of rows, e.g. --top 5 (got {value!r})"
        ) from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more rows (got {n})")
    return n


def entry_number(value: str) -> int:
    """``--entry``: which entry of the region to report, 1 for the first."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, e.g. --entry 2 (got {value!r})") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"entries count from 1 (got {n})")
    return n


def _version() -> str:
    import torch

    from memtrim import __version__

    return f"memtrim {__version__} (torch {torch.__version__}, Python {sys.version.split()[0]})"


class _PrintVersion(argparse.Action):
    """``--version``, importing torch only when asked: every other command that reads saved traces runs
    without it."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        print(_version())
        parser.exit()


RUN_USAGE = "memtrim run [options] (SCRIPT | -m MODULE) [ARGS ...]"
FIT_USAGE = (
    "memtrim fit --budget BYTES [-o PLAN] [--region NAME] [--fake [--check-args ARGS]] "
    "[--allow changes-training] (SCRIPT | -m MODULE) [ARGS ...]"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memtrim",
        description="Find what sets a PyTorch program's peak memory, cut it, and prove the rewrite safe.",
    )
    parser.add_argument("--version", action=_PrintVersion, help="print the versions and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser(
        "run",
        usage=RUN_USAGE,
        help="run a Python script (or -m module) under the tracker and report its peak",
        description="Run a script under the tracker. Options go before the script (or -m MODULE); "
        "everything after it is the script's own arguments.",
    )
    run.add_argument("-m", dest="module", metavar="MODULE", help="run a module, as python -m does")
    run.add_argument("-o", "--output", default="memtrim-trace.json", help="where to write the trace (JSON)")
    run.add_argument("--fake", action="store_true", help="run under FakeTensorMode: nothing is allocated")
    run.add_argument("--region", metavar="NAME", help="record only inside memtrim.region(NAME)")
    run.add_argument(
        "--entry",
        type=entry_number,
        metavar="N",
        help="with --region: report entry N (default: the entry with the highest peak, counting what was "
        "alive at its start)",
    )
    run.add_argument("--json", action="store_true", help="print the peak as JSON instead of the report")
    run.add_argument("--top", type=rows, default=5, help="rows per table (default 5)")
    run.add_argument("--plan", metavar="PLAN", help="apply a plan written by memtrim fit -o while it runs")
    _add_views(run)
    run.set_defaults(handler=_run, script=None, args=[])

    fitting = sub.add_parser(
        "fit",
        usage=FIT_USAGE,
        help="find the cheapest plan that fits a script into a memory budget, re-run and check it",
        description="Record the script, search the levers for the cheapest plan whose predicted peak is "
        "within the budget, print it with the code that does the same, run the script again with the plan "
        "applied and print the measured peak and the numeric check. Exit status 0: within budget; 3: no "
        "plan fits or the measured peak is over it; 1: the plan changed the numbers.",
    )
    fitting.add_argument("--budget", metavar="BYTES", help="the memory budget: 24GiB, 1500MiB, 8GB or bytes")
    fitting.add_argument("-m", dest="module", metavar="MODULE", help="run a module, as python -m does")
    fitting.add_argument("-o", "--output", metavar="PLAN", help="write the plan (JSON, memtrim.plan/1)")
    fitting.add_argument("--region", metavar="NAME", help="fit only what runs inside memtrim.region(NAME)")
    fitting.add_argument(
        "--fake",
        action="store_true",
        help="record and re-measure under FakeTensorMode: full-size models, no allocation, no numeric check",
    )
    fitting.add_argument(
        "--check-args",
        metavar="ARGS",
        help="with --fake: the script's arguments for a small config of the same model, quoted as one "
        "word; the plan's numeric check runs the script so, on real tensors, without and with the plan",
    )
    fitting.add_argument(
        "--allow",
        action="append",
        default=[],
        choices=["changes-training"],
        help="also use levers that change training (default: only exact and reference ones)",
    )
    fitting.set_defaults(handler=_fit, script=None, args=[])

    show = sub.add_parser(
        "show", help="report a saved trace (and write its views); several: the ranks of one job side by side"
    )
    show.add_argument("trace", nargs="+")
    show.add_argument("--json", action="store_true", help="print the whole trace as JSON")
    show.add_argument("--top", type=rows, default=5, help="rows per table (default 5)")
    _add_views(show)
    show.set_defaults(handler=_show)

    export = sub.add_parser(
        "export", help="write a saved trace for another viewer (HTML, PNG, Perfetto, memory_viz)"
    )
    export.add_argument("trace", nargs=1)
    _add_views(export)
    export.set_defaults(handler=_export)

    compare = sub.add_parser(
        "diff",
        usage=DIFF_USAGE,
        help="compare two saved traces (before, after), or two torchrun jobs' rank traces rank by rank",
        description="Compare two traces, or two torchrun jobs rank by rank: give each job's rank traces "
        "with -- between the jobs (ranks are paired by the rank each trace recorded), or the base names "
        "given to memtrim run -o (before.json for before.rank0.json, before.rank1.json, ...).",
    )
    compare.add_argument("traces", nargs="*", metavar="TRACE", help=argparse.SUPPRESS)
    compare.add_argument("--markdown", action="store_true", help="print Markdown for a pull request")
    compare.add_argument("--json", action="store_true", help="print the comparison as JSON")
    compare.add_argument("--html", metavar="FILE", help="write both timelines and the tables as HTML")
    compare.add_argument("--top", type=rows, default=10, help="lines listed (default 10)")
    compare.set_defaults(handler=_diff, after_set=None)

    demo = sub.add_parser("demo", help="run a built-in case: heads (default), gsq or gpt")
    demo.add_argument("case", nargs="?", choices=["heads", "gsq", "gpt"], default="heads")
    demo.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the case")
    demo.set_defaults(handler=_demo)
    return parser


def _run_options(parser: argparse.ArgumentParser, command: str = "run") -> set[str]:
    """The options of ``command`` that take a value (so the script is the first word that is neither)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    run = sub.choices[command]
    return {flag for action in run._actions if action.nargs != 0 for flag in action.option_strings}


def split_run(argv: list[str], takes_value: set[str]) -> tuple[list[str], list[str]]:
    """``run``'s own options, and the program with its arguments: the script is the first word that
    is not an option or an option's value; ``-m MODULE`` (or ``--``) ends memtrim's options as
    ``python -m`` does."""
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            return argv[:i], argv[i + 1 :]
        if word == "-m":
            return argv[: i + 2], argv[i + 2 :]
        if word.startswith("-m") and not word.startswith("--"):  # -mpackage.module
            return argv[: i + 1], argv[i + 1 :]
        if not word.startswith("-") or word == "-":
            return argv[:i], argv[i:]
        if word in takes_value:
            i += 2
        else:
            i += 1
    return argv, []


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:1] in (["run"], ["fit"]):
        options, program = split_run(words[1:], _run_options(parser, words[0]))
        args = parser.parse_args([words[0], *options])
        if args.module:
            args.args = program
        else:
            args.script, args.args = (program[0], program[1:]) if program else (None, [])
        return args
    if words[:1] == ["diff"] and "--" in words:
        # two jobs' rank traces: BEFORE... -- AFTER...; options may stand on either side
        cut = words.index("--")
        args, after = parser.parse_args(words[:cut]), parser.parse_args(["diff", *words[cut + 1 :]])
        unset = vars(parser.parse_args(["diff"]))
        args.__dict__.update({k: v for k, v in vars(after).items() if k != "traces" and v != unset[k]})
        args.after_set = after.traces
        return args
    return parser.parse_args(words)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse(argv)
        return int(args.handler(args))
    except CliError as exc:
        print(f"memtrim: error: {exc}", file=sys.stderr)
        return exc.status
    except BrokenPipeError:  # `memtrim show t.json --json | head`
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (so the interpreter's final flush is quiet)
        return 0
    except KeyboardInterrupt:
        print("memtrim: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
