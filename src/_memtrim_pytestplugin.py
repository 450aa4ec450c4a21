"""memtrim's pytest plugin: ``@pytest.mark.memtrim(peak="24 MiB")`` fails a test whose tracked peak is over
the limit; ``role="activation"`` limits one role's bytes at the peak; ``fake=True`` runs the test's body
under fake tensors. The ``memtrim_trace`` fixture is the test body's :class:`memtrim.Trace`;
``--memtrim-dir DIR`` keeps each recorded test's trace (JSON) and HTML report.

pytest loads this module in every run of an environment where memtrim is installed (the ``pytest11``
entry point). It lives outside the ``memtrim`` package and imports neither torch nor memtrim (1.5 s)
until a test is marked or asks for the fixture: any other test runs exactly as without the plugin.
The limits and the failure text live in :mod:`memtrim.integrations.budget`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from memtrim.integrations.budget import Budget

FIXTURE = "memtrim_trace"
_BUDGET: pytest.StashKey[Budget] = pytest.StashKey()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("memtrim", "memory budgets per test (memtrim)")
    group.addoption(
        "--memtrim-dir",
        metavar="DIR",
        default=None,
        help="keep each recorded test's trace (NAME.json) and HTML report (NAME.html) in DIR",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "memtrim(peak=None, *, role=None, fake=False): fail the test when its tracked peak (or the "
        'bytes of one role at the peak, role="activation") is over peak ("24 MiB", "1.5GB", bytes); '
        "fake=True runs it under fake tensors",
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker("memtrim")
    if marker is None:
        return
    from memtrim.integrations.budget import BudgetError, read_marker

    try:
        item.stash[_BUDGET] = read_marker(marker.args, marker.kwargs)
        return
    except BudgetError as exc:
        problem = str(exc)
    pytest.fail(f"@pytest.mark.memtrim: {problem}", pytrace=False)  # outside the except: no chained error


class _BodyNotStarted:
    """The ``memtrim_trace`` value until the test's body starts: the plugin puts the body's trace in its
    place. Seen only by a fixture that asks for it, which runs before the body is recorded."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(
            f"{FIXTURE} is the trace of the test's own body: ask for it in the test function, "
            "not in a fixture (fixtures run before the body is recorded)"
        )


@pytest.fixture
def memtrim_trace() -> _BodyNotStarted:
    """The :class:`memtrim.Trace` recording this test's body (under ``@pytest.mark.memtrim``'s options
    when marked). Read while the body runs, its figures are those so far: ``memtrim_trace.peak_bytes``,
    ``memtrim_trace.breakdown_at_peak()``."""
    return _BodyNotStarted()


def _file_name(nodeid: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid).strip("_.") or "test"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    # around the call phase, not pytest_pyfunc_call: a unittest.TestCase method (its setUp and tearDown
    # inside) is recorded too, rather than its marker silently doing nothing
    budget = item.stash.get(_BUDGET, None)
    funcargs: dict[str, object] = getattr(item, "funcargs", {})
    wants_trace = FIXTURE in funcargs
    if budget is None and not wants_trace:
        return (yield)

    import memtrim
    from memtrim.integrations.budget import Budget, failure_text

    budget = budget or Budget(peak=None)
    folder = item.config.getoption("memtrim_dir")
    trace: memtrim.Trace | None = None
    try:
        with memtrim.track(fake=budget.fake) as trace:
            if wants_trace:
                funcargs[FIXTURE] = trace
            result = yield
    finally:
        # also for a test that failed: its trace up to the failure is what CI should keep
        if folder and trace is not None:
            os.makedirs(folder, exist_ok=True)
            name = os.path.join(folder, _file_name(item.nodeid))
            trace.save(name + ".json")
            trace.save_html(name + ".html")
    message = failure_text(budget, trace)
    if message is not None:
        pytest.fail(message, pytrace=False)
    return result
