"""The ten-second terminal summary of an :class:`~memtrim.analysis.Analysis`."""

from __future__ import annotations

import re
import textwrap

from memtrim.analysis import Analysis, Breakdown, LineGroup, Role
from memtrim.doctor import diagnoses
from memtrim.report.escape import safe
from memtrim.trace.entries import region_entries
from memtrim.trace.model import Site, shape_text, site_text
from memtrim.trace.notes import COMPILED_BANNER, COMPILED_KEY
from memtrim.units import format_bytes, format_change


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


def _row_width(widths: list[int]) -> int:
    return 2 + sum(widths) + 2 * (len(widths) - 1)


def _named_width(rows: list[list[str]], i: int) -> int:
    """How wide column ``i`` is with each source line's folders dropped (its file name kept)."""
    width = len(rows[0][i])
    for row in rows[1:]:
        site = _SITE.match(row[i])
        cell = row[i] if site is None else f"{site.group(1).rsplit('/', 1)[-1]}{row[i][len(site.group(1)) :]}"
        width = max(width, len(cell))
    return width


def _table(rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    header = rows[0]
    if "line" in header and _row_width(widths) > WIDTH:
        i = header.index("line")
        if _row_width([*widths[:i], _named_width(rows, i), *widths[i + 1 :]]) > WIDTH:
            # too many columns for a source line that still names its file: it goes under its row
            return _table_lines_below(rows, right, i)
    _fit(rows, widths)
    return _render_rows(rows, widths, right)


def _render_rows(rows: list[list[str]], widths: list[int], right: set[int]) -> list[str]:
    lines = []
    for row in rows:
        pairs = enumerate(zip(row, widths, strict=True))
        cells = [cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in pairs]
        lines.append("  " + "  ".join(cells).rstrip())
    return lines


def _table_lines_below(rows: list[list[str]], right: set[int], i: int) -> list[str]:
    """The table without its ``line`` column, each row followed by its source line."""
    rest = [row[:i] + row[i + 1 :] for row in rows]
    kept = {c if c < i else c - 1 for c in right if c != i}
    widths = [max(len(row[c]) for row in rest) for c in range(len(rest[0]))]
    _fit(rest, widths)
    rendered = _render_rows(rest, widths, kept)
    lines = [rendered[0]]
    for row, text in zip(rows[1:], rendered[1:], strict=True):
        lines.append(text)
        lines.append("      at " + _shorten(row[i], WIDTH - 9, "left"))
    return lines


def _wrap(line: str) -> list[str]:
    """A line longer than :data:`WIDTH`, wrapped under its own indent (plus two)."""
    if len(line) <= WIDTH:
        return [line]
    indent = " " * (len(line) - len(line.lstrip()) + 2)
    return textwrap.wrap(
        line, WIDTH, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False
    )


def _roles(title: str, breakdown: Breakdown) -> list[str]:
    if not (breakdown.made or breakdown.preexisting):
        return []
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
    out = ["", title, *_table(rows, right={1, 2, 3})]
    if breakdown.preexisting_freed:
        out.append(f"  (pre-region tensors freed by then: {format_bytes(breakdown.preexisting_freed)})")
    return out


def _role_text(role: Role, nbytes: int, kept: int) -> str:
    """``activation 336 MiB``, and how much of an activation the program kept after forward."""
    text = f"{role} {format_bytes(nbytes)}"
    if role is Role.ACTIVATION and kept:
        text += " (kept after forward)" if kept == nbytes else f" ({format_bytes(kept)} kept after forward)"
    return text


def _lines(title: str, groups: tuple[LineGroup, ...], total: int, top: int) -> list[str]:
    if not groups[:top]:
        return []
    rows = [["bytes", "share", "what", "line"]]
    for g in groups[:top]:
        what = ", ".join(_role_text(role, b, g.kept_after_forward) for role, b in g.roles.items())
        share = f"{100 * g.bytes / total:.0f}%" if total > 0 else "-"
        rows.append([format_bytes(g.bytes), share, what, _where(g.site)])
    return ["", title, *_table(rows, right={0, 1})]


def _entries(analysis: Analysis, top: int) -> list[str]:
    """Every entry of a region ``memtrim run --region`` recorded, with the one reported marked."""
    noted = region_entries(analysis.log)
    if noted is None:
        return []
    why = "the highest counting what was alive at its start" if noted.picked == "highest" else "as asked"
    out = [
        "",
        f"Region {safe(repr(noted.region))} was entered {len(noted.entries)} times; this report is entry "
        f"{noted.chosen} ({why}):",
    ]
    rows = [["entry", "peak above its start", "with what was alive before"]]
    shown = sorted({0, noted.chosen - 1, *range(min(top, len(noted.entries)))})
    for i in shown:
        e = noted.entries[i]
        mark = " *" if e.number == noted.chosen else ""
        rows.append([f"{e.number}{mark}", format_bytes(e.peak), format_bytes(e.absolute)])
    out += _table(rows, right={1, 2})
    if len(noted.entries) > len(shown):
        out.append(f"  ... and {len(noted.entries) - len(shown)} more entries (memtrim run --top N)")
    first = noted.entries[0]
    later = noted.entries[1:]
    if first.optimizer_state_made and later and all(not e.optimizer_state_made for e in later):
        out.append(
            f"  entry 1 created the optimizer's state ({format_bytes(first.optimizer_state_made)}); later "
            "entries start with it alive"
        )
    return out


def _failure(analysis: Analysis, top: int) -> list[str]:
    failure = analysis.failure
    if failure is None:
        return []
    first_line = failure.error.strip().splitlines()[0] if failure.error.strip() else failure.error
    out = [f"memtrim: the region stopped with {safe(first_line)}"]
    if failure.op is not None:
        asked = f" (it asked for {format_bytes(failure.requested_bytes)})" if failure.requested_bytes else ""
        out.append(
            f"  failing op: {safe(failure.op.op)} in {failure.op.phase} at {_where(failure.op.site)}{asked}"
        )
    elif failure.requested_bytes:
        out.append(f"  the failed request asked for {format_bytes(failure.requested_bytes)}")
    out.append(f"  alive at the failure: {format_bytes(failure.live_bytes)} above the region's start")
    out += _roles("Alive at the failure, by role:", failure.breakdown)
    out += _lines("Alive at the failure, by source line:", failure.lines, failure.live_bytes, top)
    out += ["", "Before the failure:"]
    return out


def _module_text(module: str | None) -> str:
    """`` (lm_head)``: the module a finding's line runs in, as ``named_modules()`` names it where the
    recorded path allows (its leading class name dropped), else as recorded."""
    if not module:
        return ""
    parts = module.split(".")
    return f" ({safe('.'.join(parts[1:]) if len(parts) > 1 else module)})"


def _how_to_cut_it(analysis: Analysis, top: int) -> list[str]:
    """Each finding in three lines, largest saving first: the line and what is wrong there, what to
    write instead, and the peak after (the what-if replay), with the verify mode that proves the fix."""
    findings = diagnoses(analysis)[:top]
    if not findings:
        if analysis.log.ops and not analysis.flow.recorded:
            return [
                "",
                "How to cut it: no op in this trace records a tensor it read, so there is no data flow to "
                "diagnose (a memtrim.trace/1 file never records it: record the program again).",
            ]
        return []
    out = ["", "How to cut it (largest saving first):"]
    for d in findings:
        out.append(f"  - {_where(d.site)}{_module_text(d.module)}: {safe(d.problem)}")
        out.append(f"    write: {safe(d.fix)}")
        if d.code:
            out += _code_lines("    apply", d.code)
            if d.binds:
                out.append("      with " + "; ".join(f"{safe(n)}: {safe(what)}" for n, what in d.binds))
        out.append(f"    peak after: {format_change(d.peak_before, d.peak_after)} [{safe(d.rule)}]")
        keeps = f"    keeps: {KEEPS_TEXT[d.keeps]}" if d.keeps else "   "
        if d.proof:
            out += _code_lines(keeps + ("; prove it" if d.keeps else " prove it"), d.proof)
        elif d.keeps:
            out.append(keeps)
    return out


KEEPS_TEXT = {
    "exact": "bit for bit",
    "reference": "no less accurate than before",
    "changes-training": "changes training",
}
"""What a finding's ``keeps`` means, as the reports say it."""


def _code_lines(label: str, code: str) -> list[str]:
    """``    apply: <one line>``, or the label then each line of the code under it (never wrapped: code
    is copied as printed)."""
    lines = [safe(line) for line in code.splitlines()] or [""]
    if len(lines) == 1 and len(label) + 2 + len(lines[0]) <= WIDTH:
        return [Verbatim(f"{label}: {lines[0]}")]
    return [f"{label}:", *(Verbatim(f"      {line}") for line in lines)]


class Verbatim(str):
    """A report line printed as it is, never wrapped (code the reader copies)."""


def _join(out: list[str]) -> str:
    """The report's lines, each wrapped to :data:`WIDTH` unless it is :class:`Verbatim`."""
    return "\n".join(
        wrapped
        for text in out
        for line in text.split("\n")
        for wrapped in ([line] if isinstance(text, Verbatim) else _wrap(line))
    )


def render(analysis: Analysis, *, top: int = 5) -> str:
    """The summary: the peak and where it was reached, what was alive then by role and by line, the
    largest temporaries, and how to cut it. After a failure, what was alive at the failure comes first.
    ``top`` rows per table."""
    log, peak = analysis.log, analysis.peak
    out = _failure(analysis, top)
    mode = " (fake tensors: nothing was allocated)" if log.fake else ""
    if peak.allocation is None:
        out.append(f"memtrim: no allocations inside the region{mode}")
        return _join(out)
    a = peak.allocation
    node = f" for {safe(a.node)}" if a.node else ""
    label = "the peak was" if analysis.failure else "memtrim: peak"
    out.append(
        f"{label} {format_bytes(peak.bytes)} above the region's start on {safe(str(peak.device))}{mode}"
    )
    out.append(f"  reached in {a.phase} by {safe(a.op)}{node} at {_where(a.site)}")
    if COMPILED_KEY in log.metadata:
        out += textwrap.wrap(COMPILED_BANNER, 100, initial_indent="  ", subsequent_indent="    ")
    for device, measured in log.cuda_max_allocated.items():
        out.append(
            f"  torch.cuda.max_memory_allocated over the region on {safe(device)}: {format_bytes(measured)}"
        )

    out += _entries(analysis, top)
    if len(analysis.region_peaks) > 1:  # one entry is the whole trace: its peak is the headline
        rows = [["region", "entry", "peak while open"]]
        counts: dict[str, int] = {}
        for name, n in analysis.region_peaks:
            counts[name] = counts.get(name, 0) + 1
            rows.append([safe(name), str(counts[name]), format_bytes(n)])
        out += ["", "Regions (memtrim.region), each entry:", *_table(rows[: top + 1], right={1, 2})]
        if len(rows) > top + 1:
            out.append(f"  ... and {len(rows) - top - 1} more entries (memtrim show --top N)")
    out += _roles("At the peak, by role:", analysis.breakdown_at_peak)
    out += _lines("Alive at the peak, by source line:", analysis.lines_at_peak, peak.bytes, top)

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

    out += _how_to_cut_it(analysis, top)
    return _join(out)
