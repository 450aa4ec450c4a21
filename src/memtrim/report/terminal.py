"""The ten-second terminal summary of an :class:`~memtrim.analysis.Analysis`."""

from __future__ import annotations

import re
import textwrap

from memtrim.analysis import Analysis
from memtrim.report.escape import safe
from memtrim.trace.model import Site, shape_text, site_text
from memtrim.units import format_bytes


def _where(site: Site | None) -> str:
    return safe(site_text(site))


WIDTH = 100
"""Report lines fit in this many columns: tables shrink their widest text column (a source line is
shortened from the left, keeping the file name, line and function), other lines wrap."""
_SHRINKABLE = {"line": "left", "what": "right", "op": "right"}
_MIN_WIDTH = 16


_SITE = re.compile(r"^(.*):(\d+) in (.*)$")


def _shorten(cell: str, width: int, side: str) -> str:
    if len(cell) <= width:
        return cell
    if side == "right":
        return cell[: width - 1] + "…"
    site = _SITE.match(cell)
    if site is None:
        return "…" + cell[len(cell) - width + 1 :]
    # a source line: the file gives way from the left first, keeping the line number and function
    file, line, function = site.groups()
    tail = f":{line} in {function}"
    room = width - len(tail)
    if room >= 5:
        return "…" + file[len(file) - room + 1 :] + tail
    head = f"…{file[-max(room, 4) + 1 :]}:{line} in "
    return head + function[: max(width - len(head) - 1, 1)] + "…"


def _floor(rows: list[list[str]], i: int) -> int:
    """How narrow column ``i`` may get in the first round: a source line keeps its line number, its
    function and a few characters of its file; other columns keep :data:`_MIN_WIDTH`."""
    header = rows[0][i]
    if _SHRINKABLE[header] != "left":
        return max(_MIN_WIDTH, len(header))
    tails = [len(m.group(0)) - len(m.group(1)) for row in rows[1:] if (m := _SITE.match(row[i]))]
    return max(_MIN_WIDTH, len(header), min(max(tails, default=0) + 6, 30))


def _fit(rows: list[list[str]], widths: list[int]) -> None:
    """Narrow the widest shrinkable column, one character at a time, until a row fits in
    :data:`WIDTH` (in place): first down to each column's floor, then to :data:`_MIN_WIDTH`."""
    header = rows[0]
    columns = [i for i, name in enumerate(header) if name in _SHRINKABLE]
    original = list(widths)
    for floors in (
        {i: _floor(rows, i) for i in columns},
        {i: max(_MIN_WIDTH, len(header[i])) for i in columns},
    ):
        while 2 + sum(widths) + 2 * (len(widths) - 1) > WIDTH:
            candidates = [i for i in columns if widths[i] > floors[i]]
            if not candidates:
                break
            widths[max(candidates, key=lambda c: widths[c] - floors[c])] -= 1
    for i in columns:
        if widths[i] < original[i]:
            for row in rows[1:]:
                row[i] = _shorten(row[i], widths[i], _SHRINKABLE[header[i]])


def _table(rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    _fit(rows, widths)
    lines = []
    for row in rows:
        pairs = enumerate(zip(row, widths, strict=True))
        cells = [cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in pairs]
        lines.append("  " + "  ".join(cells).rstrip())
    return lines


def _wrap(line: str) -> list[str]:
    """A line longer than :data:`WIDTH`, wrapped under its own indent (plus two)."""
    if len(line) <= WIDTH:
        return [line]
    indent = " " * (len(line) - len(line.lstrip()) + 2)
    return textwrap.wrap(
        line, WIDTH, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False
    )


def render(analysis: Analysis, *, top: int = 5) -> str:
    """The summary: the peak and where it was reached, what was alive then by line, the largest
    temporaries, and how to cut it. ``top`` rows per table."""
    log, peak = analysis.log, analysis.peak
    out: list[str] = []
    mode = " (fake tensors: nothing was allocated)" if log.fake else ""
    if log.error:
        out.append(f"memtrim: the region stopped with {safe(log.error)}")
        if log.failed_op is not None:
            out.append(f"  failing op: {safe(log.failed_op.op)} at {_where(log.failed_op.site)}")
        out.append("  (everything below is up to the failure; 'alive at the end' is the live set then)")
    if peak.allocation is None:
        out.append(f"memtrim: no allocations inside the region{mode}")
        return "\n".join(out)
    a = peak.allocation
    node = f" for {safe(a.node)}" if a.node else ""
    out.append(
        f"memtrim: peak {format_bytes(peak.bytes)} above the region's start on {safe(str(peak.device))}{mode}"
    )
    out.append(f"  reached in {a.phase} by {safe(a.op)}{node} at {_where(a.site)}")
    for device, measured in log.cuda_max_allocated.items():
        out.append(
            f"  torch.cuda.max_memory_allocated over the region on {safe(device)}: {format_bytes(measured)}"
        )

    breakdown = analysis.breakdown_at_peak
    if breakdown.made or breakdown.preexisting:
        out.append("")
        out.append("At the peak, by role:")
        rows = [["role", "made in region", "from before", "total"]]
        for role in dict.fromkeys([*breakdown.made, *breakdown.preexisting]):
            made, before = breakdown.made.get(role, 0), breakdown.preexisting.get(role, 0)
            rows.append(
                [
                    str(role),
                    format_bytes(made) if made else "-",
                    format_bytes(before) if before else "-",
                    format_bytes(made + before),
                ]
            )
        out.extend(_table(rows, right={1, 2, 3}))
        if breakdown.preexisting_freed:
            out.append(
                f"  (pre-region tensors freed before the peak: {format_bytes(breakdown.preexisting_freed)})"
            )

    groups = analysis.lines_at_peak[:top]
    if groups:
        out.append("")
        out.append("Alive at the peak, by source line:")
        rows = [["bytes", "share", "what", "line"]]
        for g in groups:
            what = ", ".join(f"{cat} {format_bytes(b)}" for cat, b in g.categories.items())
            rows.append([format_bytes(g.bytes), f"{100 * g.bytes / peak.bytes:.0f}%", what, _where(g.site)])
        out.extend(_table(rows, right={0, 1}))

    temps = analysis.largest_temporaries(top)
    if temps:
        out.append("")
        out.append("Largest temporaries (made and freed in the same phase):")
        rows = [["bytes", "peak without it", "op", "shape", "dtype", "phase", "line"]]
        for t in temps:
            op = t.op.removeprefix("aten.") + (f" ({t.node})" if t.node else "")
            without = analysis.peak_without([t]) if t.device == peak.device else peak.bytes
            rows.append(
                [
                    format_bytes(t.bytes),
                    format_bytes(without),
                    safe(op),
                    shape_text(t.shape),
                    safe(t.dtype),
                    str(t.phase),
                    _where(t.site),
                ]
            )
        out.extend(_table(rows, right={0, 1}))

    findings = analysis.diagnoses
    if findings:
        out.append("")
        out.append("How to cut it:")
        for d in findings[:top]:
            out.append(
                f"  - {_where(d.site)}: {safe(d.problem)}.\n"
                f"    Fix: {safe(d.fix)}.\n"
                f"    Peak without these {len(d.allocations)} allocation(s): {format_bytes(d.peak_after)} "
                f"(-{format_bytes(peak.bytes - d.peak_after)})."
            )
    return "\n".join(wrapped for text in out for line in text.split("\n") for wrapped in _wrap(line))
