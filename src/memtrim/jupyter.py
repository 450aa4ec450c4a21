"""``%%memtrim``: track a notebook cell. Load it with ``%load_ext memtrim``.

``%%memtrim [--fake] [--top N] [--html FILE] [--name VAR]`` runs the cell under :func:`memtrim.track`,
shows the compact report with the timeline, and stores the :class:`~memtrim.Trace` in the notebook's
namespace as ``VAR`` (default ``memtrim_trace``).
"""

from __future__ import annotations

import argparse
import shlex
from typing import Any

from memtrim.api import Trace, track

DEFAULT_NAME = "memtrim_trace"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="%%memtrim", add_help=False)
    parser.add_argument("--fake", action="store_true")
    parser.add_argument("--top", type=int, default=3)
    parser.add_argument("--html", metavar="FILE")
    parser.add_argument("--name", default=DEFAULT_NAME)
    return parser


class _Shown:
    """What the magic displays: the compact HTML, or the terminal report where HTML is not shown."""

    def __init__(self, trace: Trace, top: int) -> None:
        self.trace, self.top = trace, top

    def _repr_html_(self) -> str:
        from memtrim.report.html import notebook_html

        return notebook_html(self.trace.analysis, top=self.top)

    def __repr__(self) -> str:
        return self.trace.report(top=self.top)


def track_cell(shell: Any, line: str, cell: str) -> Trace:
    """Run ``cell`` in ``shell`` under the tracker (what ``%%memtrim line`` does) and return its trace.

    The cell runs through the shell's own ``run_cell``, so its lines are named as the notebook names
    them and an error in it shows the notebook's usual traceback; the trace then keeps everything up
    to the failure.
    """
    try:
        options = _parser().parse_args(shlex.split(line))
    except SystemExit:
        raise ValueError(
            f"%%memtrim options: [--fake] [--top N] [--html FILE] [--name VAR]; got {line!r}"
        ) from None
    with track(fake=options.fake) as trace:
        result = shell.run_cell(cell)
        error = getattr(result, "error_in_exec", None) or getattr(result, "error_before_exec", None)
        if error is not None:
            trace.log.error = f"{type(error).__name__}: {error}"
    shell.user_ns[options.name] = trace
    if options.html:
        trace.save_html(options.html)
    return trace


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext memtrim``: registers the ``%%memtrim`` cell magic."""

    def memtrim(line: str, cell: str) -> _Shown:
        return _Shown(track_cell(ipython, line, cell), _parser().parse_known_args(shlex.split(line))[0].top)

    ipython.register_magic_function(memtrim, magic_kind="cell", magic_name="memtrim")
