"""The HTML report: built on the Analysis, self-contained, escaped; loaded in headless Chromium."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import chromium
import pytest
import torch

import memtrim
from memtrim.analysis import analyze
from memtrim.report.html import notebook_html, report_html
from memtrim.trace.model import Allocation, OpLog, OpRow, Phase, Region, Site, TraceLog, site_text
from memtrim.units import format_bytes

EVIL_FILE = "<script>alert('file')</script>/evil.py"
EVIL_FUNCTION = "<img src=x onerror=alert('fn')>"
EVIL_OP = "aten.</script><script>alert('op')</script>"


def _heads_trace() -> memtrim.Trace:
    z = torch.randn(32, 12, 64, requires_grad=True)
    W_O = torch.randn(12, 64, 768, requires_grad=True)
    with memtrim.track() as trace, memtrim.region("step"):
        heads = (z[..., None] * W_O).sum(-2)  # the line the report must name
        heads.square().sum().backward()
    return trace


def _evil_log() -> TraceLog:
    site = Site(EVIL_FILE, 3, EVIL_FUNCTION)
    ops = OpLog(
        [
            OpRow(0, EVIL_OP, Phase.FORWARD, site, "<b>Node</b>", "<i>mod</i>"),
            OpRow(3, "aten.sum.default", Phase.FORWARD, site, None, None),
        ]
    )
    allocations = [
        Allocation(0, 4096, "float32", (1024,), "cpu", EVIL_OP, Phase.FORWARD, 1, 4, Phase.FORWARD, site),
        Allocation(1, 4, "float32", (), "cpu", "aten.sum.default", Phase.FORWARD, 5, None, None, site),
    ]
    return TraceLog.of(
        allocations,
        ops,
        end_tick=6,
        regions=[Region("<svg onload=alert('region')>", 0, 5)],
        metadata={
            "source_lines": {EVIL_FILE: {"3": "y = x.sum()  # </script><script>alert('code')</script>"}}
        },
    )


def test_report_names_the_peak_the_top_line_and_its_code() -> None:
    trace = _heads_trace()
    page = report_html(trace.analysis)
    product = 32 * 12 * 64 * 768 * 4
    assert trace.analysis.temporaries[0].bytes == product
    assert f"peak {format_bytes(trace.peak_bytes)} above the region" in page
    assert "test_html.py:" in page and "heads = (z[..., None] * W_O).sum(-2)" in page
    assert "How to cut it" in page and "einsum" in page  # the diagnosis and its fix
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "") and "https://" not in page
    assert page.count("<svg") == 2  # by role and by line
    assert ">step<" in page  # the region, as a named span


def test_every_string_from_the_trace_is_escaped() -> None:
    page = report_html(analyze(_evil_log()))
    body = page.split('<script type="application/json"', 1)[0]
    assert "<script>alert" not in page and "<img" not in page and "<svg onload" not in page
    assert (
        "&lt;img src=x onerror=alert(&#x27;fn&#x27;)&gt;" in body
        and "aten.&lt;/script&gt;&lt;script&gt;" in body
    )
    # the page's own script and data block are its only script elements
    assert len(re.findall(r"<script\b", page)) == 2
    note = notebook_html(analyze(_evil_log()))
    assert "<script" not in note and "<img" not in note


@pytest.fixture(scope="module")
def browser() -> Iterator[chromium.Browser]:
    executable, why = chromium.find()
    if executable is None:
        pytest.skip(why)
    b = chromium.Browser(executable)
    try:
        yield b
    finally:
        b.close()


def test_report_loads_in_chromium_without_errors_and_lists_what_a_click_hits(
    browser: chromium.Browser, tmp_path: Path
) -> None:
    trace = _heads_trace()
    path = tmp_path / "report.html"
    trace.save_html(str(path))
    browser.open(path)
    assert browser.problems() == []
    assert browser.evaluate("document.body.getAttribute('data-memtrim-ready')") == "yes"
    text = browser.evaluate("document.body.innerText")
    assert f"peak {format_bytes(trace.peak_bytes)} above the region's start" in text
    top = trace.live_at_peak()[0]
    assert top.site is not None and f"test_html.py:{top.site.line} in _heads_trace" in text
    # at load the listing shows the peak; its first row is the top line with its bytes
    first_row = browser.evaluate("document.querySelector('#memtrim-alive tr:nth-child(2)').innerText")
    assert format_bytes(top.bytes) in first_row and f":{top.site.line} in" in first_row
    browser.screenshot(tmp_path / "report.png")
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # a click at the chart's left edge lists the start of the region, not the peak any more
    box = browser.evaluate(
        "(() => { const r = document.querySelector('svg.memtrim-timeline').getBoundingClientRect();"
        " const s = document.querySelector('svg.memtrim-timeline');"
        " const k = r.width / s.viewBox.baseVal.width;"
        " return [r.left + (Number(s.getAttribute('data-left')) + 2) * k, r.top + r.height / 2]; })()"
    )
    selected = browser.evaluate("document.body.getAttribute('data-memtrim-selected')")
    browser.click(box[0], box[1])
    after = browser.evaluate("document.body.getAttribute('data-memtrim-selected')")
    assert after != selected and int(after) < int(selected)
    assert "Alive after op" in browser.evaluate("document.getElementById('memtrim-alive-heading').innerText")
    # switching to lines shows the other chart
    browser.evaluate("document.querySelector('[data-show-mode=line]').click()")
    shown = browser.evaluate(
        "Array.from(document.querySelectorAll('svg.memtrim-timeline')).map(s => s.style.display)"
    )
    assert shown == ["none", ""]
    assert browser.problems() == []


def test_a_trace_with_script_in_its_names_is_inert_in_chromium(
    browser: chromium.Browser, tmp_path: Path
) -> None:
    path = tmp_path / "evil.html"
    path.write_text(report_html(analyze(_evil_log())))
    browser.open(path)
    assert browser.problems() == []  # no dialog opened, no error
    assert browser.evaluate("document.querySelectorAll('script').length") == 2
    assert browser.evaluate("document.querySelectorAll('img, iframe, object, embed').length") == 0
    assert browser.evaluate("document.querySelectorAll('svg [onload], [onerror]').length") == 0
    text = browser.evaluate("document.body.innerText")
    assert site_text(Site(EVIL_FILE, 3, EVIL_FUNCTION)) in text  # shown as text
    listing = browser.evaluate("document.getElementById('memtrim-alive').innerText")
    assert "alert('code')" in listing  # the recorded code, written as text by the script
