"""The HTML report: one self-contained file (inline CSS, SVG and a small script; nothing loaded from the
network), and the compact form a notebook shows for a :class:`memtrim.Trace`.

Everything from the trace or the user's code goes through :func:`~memtrim.report.svg.text` (HTML
escaping) or into the JSON block, whose ``<``, ``>`` and ``&`` are written as ``\\u003c``-style escapes
so no string can close the block; the script writes it back with ``textContent`` only.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from importlib import resources
from typing import Any

from memtrim.analysis import Analysis, Role
from memtrim.doctor import diagnoses
from memtrim.report.series import Layer, Timeline, timeline
from memtrim.report.svg import layer_colors, plot_columns, text, timeline_svg
from memtrim.report.terminal import KEEPS_TEXT
from memtrim.trace.model import Allocation, Site, shape_text, site_text
from memtrim.trace.notes import COMPILED_BANNER, COMPILED_KEY
from memtrim.units import format_bytes

SOURCE_LINES = "source_lines"
MAX_LISTED = 20000
"""Allocations the page carries for "what was alive here" (the largest; the rest are summed)."""

CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;color:#222;margin:0;background:#fafafa}
main{max-width:1180px;margin:0 auto;padding:18px 24px 40px}
h1{font-size:20px;margin:6px 0 2px} h2{font-size:16px;margin:26px 0 8px;border-bottom:1px solid #ddd}
.sub{color:#555;margin:2px 0} .warn{background:#fff3cd;border:1px solid #e0c36c;padding:6px 10px;margin:8px 0}
.card{background:#fff;border:1px solid #e2e2e2;border-radius:6px;padding:10px 14px;margin:10px 0}
table{border-collapse:collapse;margin:4px 0;font-size:13px} th,td{padding:3px 10px 3px 0;text-align:left;
vertical-align:top} th{color:#555;font-weight:600;border-bottom:1px solid #ddd}
td.num,th.num{text-align:right}
td.site{white-space:nowrap} td.code,code{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px;
color:#333} td.note{color:#666;font-style:italic}
.legend{display:flex;flex-wrap:wrap;gap:4px 14px;margin:4px 0 2px;font-size:12px}
.legend span.sw{display:inline-block;width:11px;height:11px;margin-right:5px;vertical-align:-1px}
button{font:inherit;padding:2px 10px;border:1px solid #bbb;background:#fff;border-radius:4px;cursor:pointer}
button[aria-pressed=true]{background:#e9eef6;border-color:#7b93b8}
.fix{margin:6px 0 14px} .fix p{margin:2px 0} .hint{color:#666;font-size:12px}
"""


def _json_block(data: Any) -> str:
    raw = json.dumps(data, separators=(",", ":"), allow_nan=False)
    for char, escape in (
        ("<", "\\u003c"),
        (">", "\\u003e"),
        ("&", "\\u0026"),
        ("\u2028", "\\u2028"),
        ("\u2029", "\\u2029"),
    ):
        raw = raw.replace(char, escape)
    return f'<script type="application/json" id="memtrim-data">{raw}</script>'


def _script() -> str:
    code = resources.files("memtrim.report").joinpath("page.js").read_text(encoding="utf-8")
    return f"<script>{code}</script>"


def code_text(analysis: Analysis, site: Site | None) -> str:
    """The recorded text of ``site``'s line ('' when it was not recorded)."""
    if site is None:
        return ""
    table = analysis.log.metadata.get(SOURCE_LINES, {})
    lines = table.get(site.file, {}) if isinstance(table, dict) else {}
    value = lines.get(str(site.line), "") if isinstance(lines, dict) else ""
    return value if isinstance(value, str) else ""


def _table(
    head: Sequence[str], rows: Iterable[Sequence[str]], numeric: frozenset[int] | set[int] = frozenset()
) -> str:
    out = ["<table><tr>"]
    out += [
        f'<th class="num">{text(h)}</th>' if i in numeric else f"<th>{text(h)}</th>"
        for i, h in enumerate(head)
    ]
    out.append("</tr>")
    for row in rows:
        out.append("<tr>")
        for i, value in enumerate(row):
            cls = ' class="num"' if i in numeric else ""
            out.append(f"<td{cls}>{text(value)}</td>")
        out.append("</tr>")
    out.append("</table>")
    return "".join(out)


def _legend(layers: Sequence[Layer], mode: str) -> str:
    items = [
        f'<span><span class="sw" style="display:inline-block;width:11px;height:11px;margin-right:5px;'
        f'vertical-align:-1px;background:{color}"></span>{text(layer.name)}</span>'
        for layer, color in zip(layers, layer_colors(layers, mode), strict=True)
    ]
    return f'<div class="legend" data-mode="{mode}">{"".join(items)}</div>'


def _roles_by_line(
    analysis: Analysis, allocations: Iterable[Allocation]
) -> dict[Site | None, dict[Role, int]]:
    found: dict[Site | None, dict[Role, int]] = {}
    for a in allocations:
        roles = found.setdefault(a.site, {})
        role = analysis.role(a)
        roles[role] = roles.get(role, 0) + a.bytes
    return found


def _what(roles: dict[Role, int]) -> str:
    return ", ".join(f"{role} {format_bytes(n)}" for role, n in sorted(roles.items(), key=lambda kv: -kv[1]))


def headline(analysis: Analysis) -> list[str]:
    """The report's first lines: the peak, where it was reached, the top line; failure and fake notes."""
    log, peak = analysis.log, analysis.peak
    out = []
    if log.error:
        failing = (
            f" at op {text(log.failed_op.op)}, {text(site_text(log.failed_op.site))}" if log.failed_op else ""
        )
        out.append(
            f'<p class="warn">The region stopped with {text(log.error)}{failing}. '
            "Everything below is up to the failure.</p>"
        )
    if log.fake:
        out.append('<p class="warn">Fake tensors: shapes and bytes as a real run, nothing was allocated.</p>')
    if COMPILED_KEY in log.metadata:
        out.append(
            f'<p class="warn" id="memtrim-compiled">'
            f"{text(COMPILED_BANNER[0].upper() + COMPILED_BANNER[1:])}.</p>"
        )
    if peak.allocation is None:
        out.append("<h1>memtrim: no allocations inside the region</h1>")
        return out
    a = peak.allocation
    node = f" for {text(a.node)}" if a.node else ""
    out.append(
        f"<h1>memtrim: peak {text(format_bytes(peak.bytes))} above the region's start "
        f"on {text(peak.device)}</h1>"
    )
    out.append(
        f'<p class="sub">reached in {text(a.phase)} by <code>{text(a.op)}</code>{node} '
        f"at {text(site_text(a.site))}</p>"
    )
    if analysis.lines_at_peak:
        top = analysis.lines_at_peak[0]
        share = 100 * top.bytes / peak.bytes if peak.bytes else 0
        code = code_text(analysis, top.site)
        shown = f": <code>{text(code)}</code>" if code else ""
        out.append(
            f'<p class="sub" id="memtrim-top-line">top line: {text(site_text(top.site))}{shown} — '
            f"{text(format_bytes(top.bytes))} alive at the peak ({share:.0f}%)</p>"
        )
    return out


def _breakdown(analysis: Analysis) -> str:
    b = analysis.breakdown_at_peak
    rows = []
    for role in dict.fromkeys([*b.made, *b.preexisting]):
        made, before = b.made.get(role, 0), b.preexisting.get(role, 0)
        rows.append(
            [
                str(role),
                format_bytes(made) if made else "-",
                format_bytes(before) if before else "-",
                format_bytes(made + before),
            ]
        )
    if not rows:
        return ""
    note = (
        '<p class="hint">Tensors from before the region freed before the peak: '
        f"{text(format_bytes(b.preexisting_freed))}.</p>"
        if b.preexisting_freed
        else ""
    )
    return (
        "<h2>At the peak, by role</h2>"
        + _table(["role", "made in region", "from before", "total"], rows, {1, 2, 3})
        + note
    )


def _phases_and_devices(analysis: Analysis, tl: Timeline) -> str:
    rows = [[str(phase), format_bytes(n)] for phase, n in analysis.peak_by_phase.items() if n]
    out = ["<h2>Peaks</h2>", _table(["while running", "peak above start"], rows, {1})]
    if len(analysis.peaks) > 1:
        out.append(
            _table(["device", "peak"], [[d, format_bytes(p.bytes)] for d, p in analysis.peaks.items()], {1})
        )
    if tl.region_peaks:
        out.append(
            _table(
                ["region", "ops", "peak while open"],
                [
                    [name, f"{span.start:.0f}-{span.end:.0f}", format_bytes(n)]
                    for (name, n), span in zip(tl.region_peaks, tl.regions, strict=True)
                ],
                {2},
            )
        )
    for device, measured in analysis.log.cuda_max_allocated.items():
        out.append(
            f'<p class="hint">torch.cuda.max_memory_allocated over the region on {text(device)}: '
            f"{text(format_bytes(measured))}</p>"
        )
    return "".join(out)


def _lines_at_peak(analysis: Analysis, top: int) -> str:
    groups = analysis.lines_at_peak[:top]
    if not groups:
        return ""
    roles = _roles_by_line(analysis, analysis.live_at_peak)
    peak = analysis.peak.bytes or 1
    rows = [
        [
            format_bytes(g.bytes),
            f"{100 * g.bytes / peak:.0f}%",
            _what(roles.get(g.site, {})),
            site_text(g.site),
            code_text(analysis, g.site),
        ]
        for g in groups
    ]
    return "<h2>Alive at the peak, by source line</h2>" + _table(
        ["bytes", "share", "what", "line", "code"], rows, {0, 1}
    )


def _temporaries(analysis: Analysis, top: int) -> str:
    temps = analysis.largest_temporaries(top)
    if not temps:
        return ""
    rows = []
    for t in temps:
        op = t.op.removeprefix("aten.") + (f" ({t.node})" if t.node else "")
        without = analysis.peak_without([t]) if t.device == analysis.peak.device else analysis.peak.bytes
        rows.append(
            [
                format_bytes(t.bytes),
                format_bytes(without),
                op,
                shape_text(t.shape),
                t.dtype,
                str(t.phase),
                site_text(t.site),
                t.module or "",
            ]
        )
    return "<h2>Largest temporaries (made and freed in the same phase)</h2>" + _table(
        ["bytes", "peak without it", "op", "shape", "dtype", "phase", "line", "module"], rows, {0, 1}
    )


def _diagnoses(analysis: Analysis, top: int) -> str:
    findings = diagnoses(analysis)[:top]
    if not findings:
        return ""
    out = ["<h2>How to cut it</h2>"]
    for d in findings:
        code = code_text(analysis, d.site)
        keeps = f"; keeps: {KEEPS_TEXT[d.keeps]}" if d.keeps else ""
        out.append('<div class="fix card">')
        out.append(
            f"<p><b>{text(site_text(d.site))}</b>{': <code>' + text(code) + '</code>' if code else ''}</p>"
        )
        out.append(f"<p>{text(d.problem)}.</p>")
        out.append(f"<p><b>Fix:</b> {text(d.fix)}.</p>")
        if d.code:
            binds = "; ".join(f"{n}: {what}" for n, what in d.binds)
            out.append(f"<p><b>Apply:</b></p><pre>{text(d.code)}</pre>")
            if binds:
                out.append(f"<p class='hint'>with {text(binds)}</p>")
        out.append(
            f"<p>Peak {text(format_bytes(d.peak_before))} → {text(format_bytes(d.peak_after))} "
            f"(−{text(format_bytes(d.peak_before - d.peak_after))}) without these "
            f"{len(d.allocations)} allocation(s){keeps}.</p>"
        )
        if d.safe_because:
            out.append("<p class='hint'>Checked on the trace: " + text("; ".join(d.safe_because)) + "</p>")
        if d.proof:
            out.append(f"<p><b>Prove it:</b></p><pre>{text(d.proof)}</pre>")
        out.append("</div>")
    return "".join(out)


def _page_data(analysis: Analysis, tl: Timeline, rows: int) -> dict[str, Any]:
    device = tl.device
    made = [a for a in analysis.allocations if a.device == device and not a.preexisting]
    listed = sorted(made, key=lambda a: -a.bytes)[:MAX_LISTED] if len(made) > MAX_LISTED else made
    listed_min = min((a.bytes for a in listed), default=0) if len(made) > MAX_LISTED else 0
    sites: dict[Site | None, int] = {}
    ops: dict[str, int] = {}
    roles = [role.value for role in Role]
    role_index = {role: i for i, role in enumerate(Role)}
    columns: dict[str, list[Any]] = {
        k: [] for k in ("bytes", "role", "site", "op", "shape", "dtype", "alloc", "free")
    }
    for a in listed:
        columns["bytes"].append(a.bytes)
        columns["role"].append(role_index[analysis.role(a)])
        columns["site"].append(sites.setdefault(a.site, len(sites)))
        columns["op"].append(ops.setdefault(a.op, len(ops)))
        columns["shape"].append(shape_text(a.shape))
        columns["dtype"].append(a.dtype)
        columns["alloc"].append(a.alloc_tick)
        columns["free"].append(-1 if a.free_tick is None else a.free_tick)
    peak_index = None
    peak_tick = analysis.peak.tick
    for i, tick in enumerate(tl.ticks):
        if tick == peak_tick:
            peak_index = i
    made_at = [sum(layer.values[i] for layer in tl.by_role) for i in range(len(tl.x))]
    return {
        "points": {"x": list(tl.x), "tick": list(tl.ticks), "total": list(tl.total), "made": made_at},
        "peakIndex": peak_index,
        "roleNames": roles,
        "sites": [[site_text(site), code_text(analysis, site)] for site in sites],
        "opNames": list(ops),
        "allocs": columns,
        "listedMin": listed_min,
        "rows": rows,
    }


def _timeline_card(tl: Timeline, *, interactive: bool) -> str:
    out = ['<div class="card">']
    if interactive:
        out.append(
            '<div><button type="button" data-show-mode="role" aria-pressed="true">by role</button> '
            '<button type="button" data-show-mode="line" aria-pressed="false">by line</button> '
            '<span class="hint">Click the chart to list what was alive at that moment. Shaded: phases; '
            "black line: live bytes above the region's start.</span></div>"
        )
    out.append(_legend(tl.by_role, "role"))
    out.append(timeline_svg(tl, mode="role"))
    if interactive:
        out.append(
            _legend(tl.by_line, "line").replace('class="legend"', 'class="legend" style="display:none"', 1)
        )
        out.append(timeline_svg(tl, mode="line").replace("<svg ", '<svg style="display:none" ', 1))
        out.append('<p id="memtrim-alive-heading" class="sub"></p><table id="memtrim-alive"></table>')
    out.append("</div>")
    return "".join(out)


def report_html(analysis: Analysis, *, top: int = 10, title: str = "memtrim report") -> str:
    """The full report as one self-contained HTML page."""
    tl = timeline(analysis, buckets=plot_columns())
    body = [
        *headline(analysis),
        _timeline_card(tl, interactive=True),
        _breakdown(analysis),
        _phases_and_devices(analysis, tl),
        _lines_at_peak(analysis, top),
        _temporaries(analysis, top),
        _diagnoses(analysis, top),
    ]
    return page(title, "".join(body), _page_data(analysis, tl, top))


def page(title: str, body: str, data: dict[str, Any] | None = None) -> str:
    """A complete HTML document around ``body`` (with the interactive script when ``data`` is given)."""
    scripts = _json_block(data) + _script() if data is not None else ""
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
        "style-src 'unsafe-inline'; "
        "script-src 'unsafe-inline'; img-src data:\">"
        f"<title>{text(title)}</title><style>{CSS}</style></head><body><main>{body}</main>{scripts}</body></html>\n"
    )


def notebook_html(analysis: Analysis, *, top: int = 3) -> str:
    """The compact report a notebook shows for a trace: the headline, the role timeline (static SVG, no
    script), the top lines at the peak and the fixes."""
    tl = timeline(analysis, buckets=plot_columns())
    parts = [
        '<div class="memtrim-trace" style="font:13px/1.4 system-ui,sans-serif;max-width:980px">',
        *(p.replace("<h1>", '<h1 style="font-size:16px;margin:4px 0">', 1) for p in headline(analysis)),
    ]
    if analysis.peak.allocation is not None:
        parts.append(
            _legend(tl.by_role, "role").replace(
                'class="legend"',
                'class="legend" style="display:flex;flex-wrap:wrap;gap:4px 12px;font-size:12px"',
            )
        )
        parts.append(timeline_svg(tl, mode="role", height=260))
        parts.append(_lines_at_peak(analysis, top).replace("<h2>", '<h2 style="font-size:14px">'))
        parts.append(_diagnoses(analysis, top).replace("<h2>", '<h2 style="font-size:14px">'))
    parts.append("</div>")
    return "".join(parts)
