"""``mem report`` layout (issue 33 item 10), looked at in headless Chromium as an operator sees it:

- no label (a limit's, the save mark's) is struck through by a line: every limit line and every
  in-phase peak bar keeps clear of every label's box, also when the two limits and the save peak
  lie a few pixels apart (memory.max 7.0 GiB, Ray threshold 6.65 GiB, a save peak of 6.59 GiB);
- a PSS floor chart whose processes have one floor each (one sample interval) is not drawn as an
  empty frame: the page says why and keeps the table; a single floor next to longer series is a dot.
"""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner
from test_memory_report import CHROMIUM, NO_CHROMIUM, _Cdp, _open, _record_run

from ckptguard.memory import read_records
from ckptguard.memory.cli import mem
from ckptguard.memory.report import render_html

GiB = 1 << 30

LINES = (
    "JSON.stringify((() => {\n"
    "  const box = (e) => { const r = e.getBoundingClientRect(); "
    "return [r.left, r.top, r.right, r.bottom]; };\n"
    "  const host = 'svg[data-chart=\"host-memory\"] ';\n"
    "  return {\n"
    "    lines: [...document.querySelectorAll(host + '[data-limit] line, "
    "' + host + '[data-peak] line')].map(box),\n"
    "    labels: [...document.querySelectorAll(host + '[data-limit] text, "
    "' + host + '[data-mark] text')].map(\n"
    "      e => [e.textContent, box(e)]),\n"
    "  };\n"
    "})())"
)


def _with_limit(src, dst, limit: int):
    """The records of ``src`` with memory.max (and Ray's figure of it) set to ``limit``."""
    out = []
    for line in src.read_text().splitlines():
        r = json.loads(line)
        if r.get("host"):
            r["host"]["limit"] = limit
        if r.get("ray"):
            r["ray"].update(total=limit, threshold_bytes=int(limit * 0.95))
        out.append(json.dumps(r))
    dst.write_text("\n".join(out) + "\n")
    return dst


def _struck(label: list[float], line: list[float], margin: float = 1.0) -> bool:
    """Whether ``line`` (a box of a horizontal line) runs through ``label``'s box."""
    x_overlap = line[0] < label[2] and label[0] < line[2]
    return x_overlap and line[1] - margin < label[3] and label[1] < line[3] + margin


@pytest.mark.timeout(120)
@pytest.mark.skipif(CHROMIUM is None, reason=NO_CHROMIUM)
def test_no_label_is_struck_through_by_a_line(tmp_path):
    spike = _record_run(tmp_path / "spike")
    pages = {}
    for name, limit in (("default", None), ("crowded", 7 * GiB)):
        src = spike if limit is None else _with_limit(spike, tmp_path / f"{name}.jsonl", limit)
        pages[name] = tmp_path / f"{name}.html"
        assert (
            CliRunner().invoke(mem, ["report", str(src), "--html", str(pages[name])]).exit_code == 0
        )
    cdp = _Cdp(tmp_path / "profile")
    try:
        sid = cdp.blank_page()
        cdp.call("Page.enable", session=sid)
        found = {}
        for name, page in pages.items():
            facts = _open(
                cdp, sid, page, tmp_path / f"{name}.png"
            )  # the screenshot, for a person to look at
            res = cdp.call(
                "Runtime.evaluate", {"expression": LINES, "returnByValue": True}, session=sid
            )
            found[name] = (facts, json.loads(res["result"]["result"]["value"]))
    finally:
        cdp.close()
    for name, (facts, geo) in found.items():
        assert len(geo["lines"]) >= 3 and len(geo["labels"]) >= 3, (name, geo)
        for text, box in geo["labels"]:
            struck = [line for line in geo["lines"] if _struck(box, line)]
            assert not struck, (
                f"{name}: the label {text!r} at {box} is struck through by the line(s) {struck}"
            )
            assert facts["plot"][0] - 0.5 <= box[0] and box[2] <= facts["plot"][2] + 0.5, (
                name,
                text,
                box,
            )
    assert "memory.max 7.00 GiB" in json.dumps(found["crowded"][1]["labels"])


def _one_sample_each(src, dst):
    """The records of ``src`` with one process sample only: every process has a single PSS floor."""
    kept, seen = [], False
    for line in src.read_text().splitlines():
        r = json.loads(line)
        if r.get("kind") == "sample" and r.get("procs"):
            if seen:
                continue
            seen = True
        kept.append(line)
    dst.write_text("\n".join(kept) + "\n")
    return dst


def test_a_one_floor_chart_is_not_an_empty_frame(tmp_path):
    spike = _record_run(tmp_path / "spike")
    page = render_html(read_records([_one_sample_each(spike, tmp_path / "one.jsonl")]))
    assert 'data-chart="process-floors"' not in page
    assert 'data-not-obtained="floors-chart"' in page and "one floor only" in page
    assert re.search(r'<tr data-pid="100" data-verdict="flat">', page)  # the table stays
    full = render_html(read_records([spike]))
    assert 'data-chart="process-floors"' in full and '<polyline data-series="100 leaky"' in full
    # The recording process itself has one floor among the longer series: a dot, not an invisible
    # line.
    single = re.findall(r'<circle data-series="([^"]+)"', full)
    lines = re.findall(r'<polyline data-series="([^"]+)"', full)
    assert not set(single) & set(lines)


def test_a_report_with_no_limit_near_the_data(tmp_path):
    """This machine's own records of one save: its limits are far above the data (none in view)."""
    from ckptguard.memory import PhaseKind, PhaseRecorder, RecorderConfig

    path = tmp_path / "r.jsonl"
    with PhaseRecorder(RecorderConfig(path=path, probe_gpu=False)).phase(PhaseKind.SAVE, step=1):
        pass
    page = render_html(read_records([path]))
    assert 'data-chart="host-memory"' in page or "No host chart" in page


WIDTH_FACTS = (
    "JSON.stringify((() => {\n"
    "  const box = (e) => { const r = e.getBoundingClientRect(); "
    "return [r.left, r.top, r.right, r.bottom]; };\n"
    "  const host = document.querySelector('svg[data-chart=\"host-memory\"]');\n"
    "  const plot = box(host.querySelector('[data-plot-area]'));\n"
    "  const edges = [[plot[0], plot[1], plot[2], plot[1]], [plot[0], plot[3], plot[2], "
    "plot[3]]];\n"
    "  return {\n"
    "    width: window.innerWidth, scroll: document.documentElement.scrollWidth, plot: plot,\n"
    "    svgs: [...document.querySelectorAll('svg[data-chart]')].map(box),\n"
    "    lines: [...host.querySelectorAll('[data-limit] line, [data-peak] line, "
    "[data-mark] line')].map(box).concat(edges),\n"
    "    labels: [...host.querySelectorAll('[data-limit] text, text[data-limit], "
    "[data-mark] text')].map(\n"
    "      e => [e.textContent, box(e)]),\n"
    "  };\n"
    "})())"
)


@pytest.mark.timeout(180)
@pytest.mark.skipif(CHROMIUM is None, reason=NO_CHROMIUM)
def test_the_report_is_whole_and_no_label_is_struck_at_800_and_1600_px(tmp_path):
    """At 800 px the chart was cut off on the right; with the limits far above the data the "(above
    the scale)" labels sat on the plot's top border and the save peak's line ran through them."""
    import base64

    from test_memory_report import _Cdp

    spike = _record_run(tmp_path / "spike")
    pages = {}
    for name, limit in (("default", None), ("crowded", 7 * GiB), ("far above the data", 100 * GiB)):
        src = (
            spike if limit is None else _with_limit(spike, tmp_path / f"{len(pages)}.jsonl", limit)
        )
        pages[name] = tmp_path / f"{len(pages)}.html"
        assert (
            CliRunner().invoke(mem, ["report", str(src), "--html", str(pages[name])]).exit_code == 0
        )
    cdp = _Cdp(tmp_path / "profile")
    found = {}
    try:
        sid = cdp.blank_page()
        cdp.call("Page.enable", session=sid)
        for width in (800, 1600):
            cdp.call(
                "Emulation.setDeviceMetricsOverride",
                {"width": width, "height": 900, "deviceScaleFactor": 1, "mobile": False},
                session=sid,
            )
            for name, page in pages.items():
                cdp.call("Page.navigate", {"url": page.as_uri()}, session=sid)
                cdp.wait(
                    lambda m: m.get("method") == "Page.loadEventFired" and m.get("sessionId") == sid
                )
                res = cdp.call(
                    "Runtime.evaluate",
                    {"expression": WIDTH_FACTS, "returnByValue": True},
                    session=sid,
                )
                found[(width, name)] = json.loads(res["result"]["result"]["value"])
                png = cdp.call("Page.captureScreenshot", {"format": "png"}, session=sid)["result"][
                    "data"
                ]
                (tmp_path / f"{name}-{width}.png").write_bytes(
                    base64.b64decode(png)
                )  # for a person to look at
    finally:
        cdp.close()
    for (width, name), geo in found.items():
        assert geo["scroll"] <= width, (
            f"{name} at {width} px: the page is {geo['scroll']} px wide (cut off)"
        )
        assert all(svg[2] <= width for svg in geo["svgs"]), (width, name, geo["svgs"])
        assert len(geo["labels"]) >= 3, (width, name, geo["labels"])
        for text, box in geo["labels"]:
            struck = [line for line in geo["lines"] if _struck(box, line)]
            assert not struck, (
                f"{name} at {width} px: {text!r} at {box} is struck through by {struck}"
            )
            plot = geo["plot"]
            assert plot[0] - 0.5 <= box[0] and box[2] <= plot[2] + 0.5 and plot[1] < box[1], (
                width,
                name,
                text,
            )
