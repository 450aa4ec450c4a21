"""The ten-second terminal summary of a trace."""

from __future__ import annotations

from memtrim.analysis.diagnoses import diagnose
from memtrim.analysis.timeline import find_peak, largest_temporaries, live_at_peak
from memtrim.analysis.whatif import peak_without
from memtrim.report.units import format_bytes, short_path
from memtrim.trace.model import Site, Trace


def _where(site: Site | None) -> str:
    return "(no user frame)" if site is None else f"{short_path(site.file)}:{site.line} in {site.function}"


def _table(rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        pairs = enumerate(zip(row, widths, strict=True))
        cells = [cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in pairs]
        lines.append("  " + "  ".join(cells).rstrip())
    return lines


def render(trace: Trace, *, top: int = 5) -> str:
    peak = find_peak(trace)
    out: list[str] = []
    mode = " (fake tensors: nothing was allocated)" if trace.fake else ""
    if trace.error:
        out.append(f"memtrim: the region stopped with {trace.error}")
        if trace.failed_op is not None:
            out.append(f"  failing op: {trace.failed_op.op} at {_where(trace.failed_op.site)}")
        out.append("  (everything below is up to the failure; 'alive at the end' is the live set then)")
    if peak.allocation is None:
        out.append(f"memtrim: no allocations inside the region{mode}")
        return "\n".join(out)
    a = peak.allocation
    node = f" for {a.node}" if a.node else ""
    out.append(f"memtrim: peak {format_bytes(peak.bytes)} above the region's start on {peak.device}{mode}")
    out.append(f"  reached in {a.phase} by {a.op}{node} at {_where(a.site)}")
    for device, measured in trace.cuda_max_allocated.items():
        out.append(f"  torch.cuda.max_memory_allocated over the region on {device}: {format_bytes(measured)}")

    groups = live_at_peak(trace)[:top]
    if groups:
        out.append("")
        out.append("Alive at the peak, by source line:")
        rows = [["bytes", "share", "what", "line"]]
        for g in groups:
            what = ", ".join(
                f"{cat} {format_bytes(b)}" for cat, b in sorted(g.categories.items(), key=lambda x: -x[1])
            )
            rows.append([format_bytes(g.bytes), f"{100 * g.bytes / peak.bytes:.0f}%", what, _where(g.site)])
        out.extend(_table(rows, right={0, 1}))

    temps = largest_temporaries(trace, top)
    if temps:
        out.append("")
        out.append("Largest temporaries (made and freed in the same phase):")
        rows = [["bytes", "peak without it", "op", "shape", "dtype", "phase", "line"]]
        for t in temps:
            op = t.op.removeprefix("aten.") + (f" ({t.node})" if t.node else "")
            without = peak_without(trace, [t], peak.device) if t.device == peak.device else peak.bytes
            rows.append(
                [
                    format_bytes(t.bytes),
                    format_bytes(without),
                    op,
                    "x".join(map(str, t.shape)) or "scalar",
                    t.dtype,
                    t.phase,
                    _where(t.site),
                ]
            )
        out.extend(_table(rows, right={0, 1}))

    findings = diagnose(trace)
    if findings:
        out.append("")
        out.append("How to cut it:")
        for d in findings[:top]:
            out.append(
                f"  - {_where(d.site)}: {d.problem}.\n"
                f"    Fix: {d.advice}.\n"
                f"    Peak without these {len(d.allocations)} allocation(s): {format_bytes(d.peak_after)} "
                f"(-{format_bytes(peak.bytes - d.peak_after)})."
            )
    return "\n".join(out)
