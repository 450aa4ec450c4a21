"""A :class:`~memtrim.analysis.diff.TraceDiff` for people: terminal text (100 columns), Markdown for a
pull request, JSON, and an HTML page with both timelines on one axis."""

from __future__ import annotations

from typing import Any

from memtrim.analysis.diff import LineChange, LineFigures, TraceDiff
from memtrim.report.escape import safe
from memtrim.report.html import page
from memtrim.report.series import timeline
from memtrim.report.svg import compare_svg, plot_columns, text
from memtrim.trace.model import Site, shape_text, site_text
from memtrim.units import format_bytes, format_delta

WIDTH = 100


def _where(change: LineChange) -> str:
    before = change.before.site if change.before else None
    after = change.after.site if change.after else None
    if change.matched in ("same line", "before only", "after only") or before == after:
        return site_text(after or before)
    if change.matched == "renamed":
        return f"{site_text(before)} -> {site_text(after)}"
    line_before = before.line if before else "?"
    return f"{site_text(after)} (was line {line_before})"


def _temp(f: LineFigures | None) -> str:
    if f is None or f.largest_temporary is None:
        return "none"
    t = f.largest_temporary
    return f"{format_bytes(t.bytes)} {t.op.removeprefix('aten.')} {shape_text(t.shape)}"


def _pair(before: int, after: int) -> str:
    return f"{format_bytes(before)} -> {format_bytes(after)} ({format_delta(before, after)})"


def _clip(line: str, width: int = WIDTH) -> str:
    return line if len(line) <= width else line[: width - 1] + "…"


def render_text(d: TraceDiff, *, top: int = 10) -> str:
    """The diff for a terminal."""
    if d.empty:
        return f"memtrim diff: no differences (peak {format_bytes(d.peak[0])} in both)"
    out = [f"memtrim diff: peak {_pair(*d.peak)}"]
    phases = [f"{p} {_pair(*v)}" for p, v in d.by_phase.items() if v[0] != v[1]]
    if phases:  # one line when it fits the width, else one phase a line
        line = "  by phase:  " + ";  ".join(phases)
        out += [line] if len(line) <= WIDTH else ["  by phase:", *(f"    {p}" for p in phases)]
    changed_roles = {r: v for r, v in d.by_role.items() if v[0] != v[1]}
    if changed_roles:
        out.append("")
        out.append("At the peak, by role:")
        for role, (b, a) in changed_roles.items():
            out.append(f"  {role!s:<16} {_pair(b, a)}")
    if d.lines:
        out.append("")
        out.append("By source line (largest change first):")
        for change in d.lines[:top]:
            (pb, pa), (tb, ta) = change.at_peak, change.largest_temporary
            out.append(_clip(f"  {safe(_where(change))}  [{change.matched}]"))
            code = change.code
            if code:
                out.append(_clip(f"      {safe(code)}"))
            if pb != pa:
                out.append(_clip(f"      alive at the peak  {_pair(pb, pa)}"))
            if tb != ta:
                out.append(
                    _clip(
                        f"      largest temporary  {safe(_temp(change.before))} -> "
                        f"{safe(_temp(change.after))}"
                    )
                )
        if len(d.lines) > top:
            out.append(f"  ({len(d.lines) - top} more lines changed; --top to see them)")
    return "\n".join(out)


def _md(value: str) -> str:
    """Text safe in a Markdown table cell."""
    return safe(value).replace("|", "\\|").replace("`", "'").replace("<", "&lt;").replace(">", "&gt;")


def _md_code(value: str) -> str:
    """Text for a Markdown code span in a table cell (entities are not decoded there; a pipe still
    needs its escape)."""
    return safe(value).replace("|", "\\|").replace("`", "'")


def render_markdown(d: TraceDiff, *, top: int = 10) -> str:
    """The diff as Markdown for a pull request."""
    if d.empty:
        return f"**memtrim**: no memory differences (peak {format_bytes(d.peak[0])} in both)."
    out = [
        f"**memtrim**: peak {format_bytes(d.peak[0])} → {format_bytes(d.peak[1])} ({format_delta(*d.peak)})",
        "",
    ]
    out += ["| | before | after | change |", "|---|---:|---:|---:|"]
    out.append(f"| peak | {format_bytes(d.peak[0])} | {format_bytes(d.peak[1])} | {format_delta(*d.peak)} |")
    for phase, (b, a) in d.by_phase.items():
        out.append(f"| peak in {phase} | {format_bytes(b)} | {format_bytes(a)} | {format_delta(b, a)} |")
    for role, (b, a) in d.by_role.items():
        if b != a:
            out.append(
                f"| {role} at the peak | {format_bytes(b)} | {format_bytes(a)} | {format_delta(b, a)} |"
            )
    if d.lines:
        out += ["", "| line | code | alive at the peak | largest temporary |", "|---|---|---:|---:|"]
        for change in d.lines[:top]:
            figures = change.after or change.before
            code = f"`{_md_code(figures.code)}`" if figures and figures.code else ""
            (pb, pa) = change.at_peak
            out.append(
                f"| {_md(_where(change))} | {code} | {format_bytes(pb)} → {format_bytes(pa)} | "
                f"{_md(_temp(change.before))} → {_md(_temp(change.after))} |"
            )
        if len(d.lines) > top:
            out.append(f"\n{len(d.lines) - top} more lines changed.")
    return "\n".join(out)


def _site_json(site: Site | None) -> dict[str, Any] | None:
    return None if site is None else {"file": site.file, "line": site.line, "function": site.function}


def _figures_json(f: LineFigures | None) -> dict[str, Any] | None:
    if f is None:
        return None
    t = f.largest_temporary
    return {
        "site": _site_json(f.site),
        "code": f.code,
        "at_peak": f.at_peak,
        "ops_at_peak": dict(f.ops_at_peak),
        "largest_temporary": None
        if t is None
        else {"bytes": t.bytes, "op": t.op, "shape": list(t.shape), "dtype": t.dtype, "phase": t.phase.value},
    }


def to_dict(d: TraceDiff) -> dict[str, Any]:
    return {
        "empty": d.empty,
        "peak": {"before": d.peak[0], "after": d.peak[1]},
        "peak_by_phase": {p.value: {"before": b, "after": a} for p, (b, a) in d.by_phase.items()},
        "by_role_at_peak": {r.value: {"before": b, "after": a} for r, (b, a) in d.by_role.items()},
        "lines": [
            {"matched": c.matched, "before": _figures_json(c.before), "after": _figures_json(c.after)}
            for c in d.lines
        ],
    }


def render_html(d: TraceDiff, *, top: int = 20, names: tuple[str, str] = ("before", "after")) -> str:
    """The diff as a self-contained page: both live curves on one axis, then the tables."""
    chart = compare_svg(
        [
            (names[0], timeline(d.before, buckets=plot_columns())),
            (names[1], timeline(d.after, buckets=plot_columns())),
        ]
    )
    body = [
        f"<h1>memtrim diff: peak {text(format_bytes(d.peak[0]))} → {text(format_bytes(d.peak[1]))} "
        f"({text(format_delta(*d.peak))})</h1>"
    ]
    body.append(
        f'<p class="sub">{text(names[0])} (blue) and {text(names[1])} (red), live bytes above each '
        "region's start over its op sequence.</p>"
    )
    body.append(f'<div class="card">{chart}</div>')
    if d.empty:
        body.append("<p>No differences.</p>")
    rows = [["peak", format_bytes(d.peak[0]), format_bytes(d.peak[1]), format_delta(*d.peak)]]
    rows += [
        [f"peak in {p}", format_bytes(b), format_bytes(a), format_delta(b, a)]
        for p, (b, a) in d.by_phase.items()
    ]
    rows += [
        [f"{r} at the peak", format_bytes(b), format_bytes(a), format_delta(b, a)]
        for r, (b, a) in d.by_role.items()
    ]
    table = [
        "<h2>Totals</h2><table><tr><th></th><th class='num'>before</th><th class='num'>after</th>"
        "<th class='num'>change</th></tr>"
    ]
    for row in rows:
        table.append(
            "<tr>"
            + "".join(f"<td{' class=num' if i else ''}>{text(v)}</td>" for i, v in enumerate(row))
            + "</tr>"
        )
    table.append("</table>")
    body.append("".join(table))
    if d.lines:
        out = [
            "<h2>By source line</h2><table><tr><th>line</th><th>matched</th><th>code</th>"
            "<th class='num'>alive at the peak</th><th>largest temporary</th></tr>"
        ]
        for c in d.lines[:top]:
            figures = c.after or c.before
            (pb, pa) = c.at_peak
            out.append(
                f"<tr><td>{text(_where(c))}</td><td>{text(c.matched)}</td>"
                f"<td><code>{text(figures.code or '') if figures else ''}</code></td>"
                f"<td class='num'>{text(format_bytes(pb))} → {text(format_bytes(pa))}</td>"
                f"<td>{text(_temp(c.before))} → {text(_temp(c.after))}</td></tr>"
            )
        out.append("</table>")
        body.append("".join(out))
    return page("memtrim diff", "".join(body))
