"""What ``@pytest.mark.memtrim`` checks: a test's limits (:class:`Budget`), read from the marker's
arguments, and the failure text when a recorded trace goes over them.

Kept apart from the plugin (the top-level module ``_memtrim_pytestplugin``), which pytest loads into
every run of an environment where memtrim is installed: it imports this module, and with it torch and
memtrim, only for a test that is marked or asks for the ``memtrim_trace`` fixture.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from memtrim.analysis import LineGroup
from memtrim.analysis.roles import Role
from memtrim.api import Trace
from memtrim.plan import parse_budget
from memtrim.report.escape import safe
from memtrim.units import format_bytes, format_change

MARKER_SIGNATURE = "memtrim(peak=None, *, role=None, fake=False)"
TOP_LINES = 5


class BudgetError(ValueError):
    """A marker memtrim cannot read; the message names the argument and what it should be."""


@dataclass(frozen=True)
class Budget:
    """The limits of one test."""

    peak: int | None
    """The most bytes the test's body may reach above its start, or (with ``role``) the most bytes of
    that role alive at the peak, made in the body or before it; None: record, limit nothing."""
    role: Role | None = None
    """Limit only this role's bytes alive at the peak."""
    fake: bool = False
    """Run the test's body under fake tensors (nothing allocated)."""


def _bytes(n: int) -> str:
    return f"{format_bytes(n)} ({n:,} B)"


def _size(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise BudgetError(f'peak must be a size like "24 MiB", "1.5GB" or bytes as an int; got {value!r}')
    try:
        return parse_budget(value)
    except ValueError as exc:
        raise BudgetError(f"peak: {exc}") from None


def _role(value: object) -> Role:
    known = [r.value for r in Role]
    if isinstance(value, Role):
        return value
    if not isinstance(value, str) or value not in known:
        raise BudgetError(f"role must be one of {', '.join(known)}; got {value!r}")
    return Role(value)


def read_marker(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Budget:
    """The :class:`Budget` of ``@pytest.mark.memtrim(*args, **kwargs)``; a :class:`BudgetError` names
    what is wrong."""
    unknown = sorted(set(kwargs) - {"peak", "role", "fake"})
    if unknown:
        raise BudgetError(f"unknown argument {unknown[0]!r}: the marker is {MARKER_SIGNATURE}")
    if len(args) > 1 or (args and "peak" in kwargs):
        raise BudgetError(f"one limit only, the peak: the marker is {MARKER_SIGNATURE}")
    raw_peak = args[0] if args else kwargs.get("peak")
    peak = None if raw_peak is None else _size(raw_peak)
    role = None if kwargs.get("role") is None else _role(kwargs["role"])
    if role is not None and peak is None:
        raise BudgetError(f'role={role.value!r} limits that role\'s bytes: give the limit too, peak="24 MiB"')
    fake = kwargs.get("fake", False)
    if not isinstance(fake, bool):
        raise BudgetError(f"fake must be True or False; got {fake!r}")
    return Budget(peak=peak, role=role, fake=fake)


def measured(budget: Budget, trace: Trace) -> int:
    """What the budget limits, read from the trace: the peak, or the role's bytes alive at it (made in
    the test or before it)."""
    if budget.role is None:
        return trace.peak_bytes
    return trace.analysis.breakdown_at_peak.total(budget.role)


def _line(group: LineGroup) -> str:
    """bytes, role (the largest), line, op (the largest); a line whose bytes have several roles ends
    with how they split."""
    roles = sorted(((n, role.value) for role, n in group.roles.items() if n), reverse=True)
    op = max(group.ops.items(), key=lambda kv: kv[1])[0] if group.ops else "?"
    where = group.site.text(path_parts=2) if group.site else "(no user line)"
    text = f"  {format_bytes(group.bytes):>9}  {roles[0][1] if roles else '?':<16} {safe(where)}  {safe(op)}"
    if len(roles) > 1:
        text += " (" + ", ".join(f"{format_bytes(n)} {role}" for n, role in roles) + ")"
    return text


def failure_text(budget: Budget, trace: Trace) -> str | None:
    """Why the trace is over the budget — limit and measured figure, the top lines alive at the peak,
    the first diagnosis — or None when it is within it."""
    if budget.peak is None:
        return None
    value = measured(budget, trace)
    if value <= budget.peak:
        return None
    peak = trace.peak
    where = f" on {peak.device}" if peak.device else ""
    fake = " (fake tensors: nothing was allocated)" if trace.fake else ""
    if budget.role is None:
        head = f"memtrim: the test's peak was limited to {_bytes(budget.peak)} but reached {_bytes(value)}"
    else:
        head = (
            f"memtrim: {budget.role.value} bytes at the peak were limited to {_bytes(budget.peak)} "
            f"but were {_bytes(value)} (peak {_bytes(trace.peak_bytes)})"
        )
    lines = [head + where + fake, f"Alive at the peak, top {TOP_LINES} lines (bytes, role, line, op):"]
    lines += [_line(g) for g in trace.live_at_peak()[:TOP_LINES]]
    found = trace.diagnoses()
    if found:
        d = found[0]
        where = d.site.text(path_parts=2) if d.site else "(no user line)"
        lines += [
            "How to cut it (the first finding):",
            f"  - {safe(where)}: {safe(d.problem)}",
            f"    write: {safe(d.fix)}",
            f"    peak after: {format_change(d.peak_before, d.peak_after)} [{safe(d.rule)}]",
        ]
    return "\n".join(lines)
