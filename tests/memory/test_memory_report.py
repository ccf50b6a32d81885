"""The report: rendered, then opened in headless Chromium and checked through the DOM (no network
loads)."""

from __future__ import annotations

import base64
import html
import json
import os
import re
import select
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptguard.memory import (
    HostProbe,
    HostProbeConfig,
    PhaseKind,
    PhaseRecorder,
    RecorderConfig,
    read_records,
)
from ckptguard.memory.cli import mem
from ckptguard.memory.report import render_html

FIX = Path(__file__).parents[1] / "fixtures" / "memory"
GiB = 1 << 30
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


MiB = 1 << 20
SPIKE = 600 * MiB
# The resumed job of the kill scenario: its first record (load) sees the raised oom_kill count.
_RESUMED = textwrap.dedent(
    "\n"
    "    import sys\n"
    "    from pathlib import Path\n"
    "    from ckptguard.memory import HostProbe, HostProbeConfig, PhaseKind, PhaseRecorder, "
    "RecorderConfig\n"
    "    tree = Path(sys.argv[1])\n"
    '    probe = HostProbe(HostProbeConfig(proc_root=tree / "proc", '
    'cgroup_root=tree / "sys" / "fs" / "cgroup"))\n'
    '    with PhaseRecorder(RecorderConfig(path=Path(sys.argv[2]), node="n1", probe_gpu=False), '
    "host_probe=probe) as rec:\n"
    "        with rec.phase(PhaseKind.LOAD, step=6):\n"
    "            pass\n"
    "    "
)


def _wait_for_samples(rec: PhaseRecorder, n: int) -> None:
    """Until the recorder's sampler has polled ``n`` more times (it runs on its own thread)."""
    goal, deadline = rec._sampler.samples_taken + n, time.monotonic() + 10
    while rec._sampler.samples_taken < goal:
        assert time.monotonic() < deadline, "the in-phase sampler did not run"
        time.sleep(0.005)


def _record_run(tmp_path: Path, *, gpu: bool = False, killed_in_save: bool = False) -> Path:
    """Real phase records on a copy of the v2 fixture cgroup (memory.current 6 GiB, memory.max
    8 GiB): load, six updates and a save whose memory.current rises by 600 MiB between its
    boundaries (only the in-phase sampler sees it), watch-style samples of a rising and a flat
    process and, with ``gpu``, GPU figures as a GPU run writes them. ``killed_in_save``: the save
    never ends (what SIGKILL leaves: its start line, and the in-memory peak is lost), a mem watch
    sample catches the spike, the cgroup's oom_kill count rises, and a resumed job (another
    process) records its load phase."""
    tree = tmp_path / "tree"
    shutil.copytree(FIX / "cgroup_v2", tree)
    cg = tree / "sys" / "fs" / "cgroup" / "job.slice" / "run1"
    probe = HostProbe(
        HostProbeConfig(proc_root=tree / "proc", cgroup_root=tree / "sys" / "fs" / "cgroup")
    )
    phases, watch = tmp_path / "phases.jsonl", []
    rec = PhaseRecorder(
        RecorderConfig(path=phases, node="n1", probe_gpu=False, sample_hz=200), host_probe=probe
    )
    with rec.phase(PhaseKind.LOAD, step=0):
        _wait_for_samples(rec, 2)
    for step in range(1, 7):
        with rec.phase(PhaseKind.UPDATE, step=step):
            _wait_for_samples(rec, 1)
    base = int((cg / "memory.current").read_text())
    save = rec.phase(PhaseKind.SAVE, step=6)
    save.__enter__()
    _wait_for_samples(rec, 2)
    (cg / "memory.current").write_text(str(base + SPIKE))
    _wait_for_samples(rec, 3)
    watch.append(
        {
            "v": 1,
            "kind": "sample",
            "mono_ns": time.monotonic_ns(),
            "node": "n1",
            "pid": 1,
            "procs": [],
            "host": probe.read().to_json(),
        }
    )
    (cg / "memory.current").write_text(str(base))
    if killed_in_save:
        events = cg / "memory.events"
        events.write_text(events.read_text().replace("oom_kill 1", "oom_kill 2"))
        rec.close()
        subprocess.run(
            [sys.executable, "-c", _RESUMED, str(tree), str(phases)], check=True, timeout=60
        )
    else:
        _wait_for_samples(rec, 2)
        save.__exit__(None, None, None)
        rec.close()
    recs = read_records([phases])
    t0, t1 = recs[0]["mono_ns"], recs[-1]["mono_ns"]
    out = tmp_path / "all.jsonl"
    with open(out, "w") as fh:
        for i, r in enumerate(recs):
            if gpu:
                r["gpu"] = {
                    "allocated": (20 + i) * GiB,
                    "reserved": (30 + i) * GiB,
                    "device_total": 140 * GiB,
                }
            fh.write(json.dumps(r) + "\n")
        for r in watch:
            fh.write(json.dumps(r) + "\n")
        for i in range(12):
            t = t0 + (t1 - t0) * i // 11
            procs = [
                {"pid": 100, "comm": "leaky", "argv0": "python", "pss": GiB + i * (64 << 20)},
                {"pid": 200, "comm": "steady", "argv0": "python", "pss": GiB // 2},
            ]
            fh.write(
                json.dumps(
                    {
                        "v": 1,
                        "kind": "sample",
                        "mono_ns": t + 1,
                        "node": "n1",
                        "pid": 1,
                        "procs": procs,
                        "host": recs[0]["host"],
                        "ray": recs[0]["ray"],
                    }
                )
                + "\n"
            )
    return out


@pytest.fixture
def records_file(tmp_path) -> Path:
    return _record_run(tmp_path, gpu=True)


@pytest.fixture
def spike_file(tmp_path) -> Path:
    return _record_run(tmp_path / "spike")


@pytest.fixture
def killed_file(tmp_path) -> Path:
    return _record_run(tmp_path / "killed", killed_in_save=True)


def _visible_text(page: str) -> str:
    body = re.sub(r"<(style|title)>.*?</\1>", " ", page, flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", " ", body))


def test_report_html_is_self_contained_and_complete(records_file, tmp_path):
    page = render_html(read_records([records_file]))
    assert "default-src 'none'" in page
    for needle in (
        'data-chart="host-memory"',
        'data-chart="process-floors"',
        'data-chart="gpu-memory"',
        'data-series="anon"',
        'data-series="shmem"',
        'data-series="file"',
        'data-series="current"',
        'data-phase="save"',
        f'data-limit="memory.max" data-bytes="{8 * GiB}"',
        'data-verdict="rising"',
        'data-verdict="flat"',
    ):
        assert needle in page, needle
    assert "http://" not in page and "https://" not in page and "<script" not in page
    out = tmp_path / "r.html"
    r = CliRunner().invoke(mem, ["report", str(records_file), "--html", str(out)])
    assert r.exit_code == 0 and out.read_text() == page


def test_report_shows_the_in_phase_peaks_and_the_save_headroom(spike_file):
    """A 600 MiB save spike between two equal boundary readings is on the page."""
    recs = read_records([spike_file])
    save_end = next(r for r in recs if r["kind"] == "phase_end" and r["phase"] == "save")
    peak = save_end["peak"]["host_current"]
    boundaries = [r["host"]["current"] for r in recs if r["kind"].startswith("phase_")]
    assert peak == 6 * GiB + SPIKE and max(boundaries) == 6 * GiB  # only the sampler saw it
    page = render_html(recs)
    limit = int(
        8 * GiB * 0.95
    )  # the report's limit: cgroup memory.max x RAY_memory_usage_threshold
    phases = [r for r in recs if r["kind"] == "phase_end"]
    bars = re.findall(r'<g data-peak="([a-z_]+)" data-step="(\d+)" data-bytes="(\d+)">', page)
    assert sorted(bars) == sorted(
        (r["phase"], str(r["step"]), str(r["peak"]["host_current"])) for r in phases
    )
    mark = re.search(
        r'<g data-mark="save-peak" data-step="6" data-bytes="(\d+)" data-limit-bytes="(\d+)" '
        r'data-headroom="(-?\d+)">',
        page,
    )
    assert mark and [int(v) for v in mark.groups()] == [peak, limit, limit - peak]
    text = _visible_text(page)
    assert "save peak 6.59 GiB (step 6), headroom 1.01 GiB to the 7.60 GiB limit" in text
    assert (
        "limit 7.60 GiB = memory.max 8.00 GiB x Ray threshold 0.95; headroom "
        "1.01 GiB (13% of the limit)" in text
    )
    assert re.search(
        r"save\s+6\s+0\s+\d+\s+[\d.]+ s\s+6.00 GiB\s+6.00 GiB\s+6.59 GiB", text
    )  # phase table row
    # No GPU figure in these records: no GPU chart, one line that says why.
    assert 'data-chart="gpu-memory"' not in page and 'data-not-obtained="gpu"' in page
    assert "Ray threshold 7.60 GiB = memory.max x 0.95" in text and "memory.max 8.00 GiB" in text


def test_report_of_a_job_killed_in_its_save(killed_file):
    recs = read_records([killed_file])
    assert [r["phase"] for r in recs if r["kind"] == "phase_start"][-2:] == ["save", "load"]
    assert (
        len({r["pid"] for r in recs if r["kind"] == "phase_start"}) == 2
    )  # the resumed job is another process
    page = render_html(recs)
    assert 'data-killer="cgroup_oom_kill"' in page
    text = _visible_text(page)
    assert (
        "Failure: cgroup_oom_kill in phase 'save' (step 6)" in text and "save (died here)" in text
    )
    assert '<g data-phase="save" data-step="6" data-state="never ended">' in page
    # The recorder's in-memory peak died with the process; mem watch's sample kept the spike.
    mark = re.search(r'data-mark="save-peak" data-step="6" data-bytes="(\d+)"', page)
    assert mark and int(mark[1]) == 6 * GiB + SPIKE
    assert "save peak 6.59 GiB (step 6, died in it)" in text
    # The dead save ends where the resumed job starts, not at the end of the records.
    resumed = next(
        r for r in recs if r["kind"] == "phase_start" and r["phase"] == "load" and r["step"] == 6
    )
    band = re.search(
        r'<g data-phase="save" data-step="6" data-state="never ended"><rect x="([\d.]+)" y="\d+" '
        r'width="([\d.]+)"',
        page,
    )
    assert band is not None
    t0, t1 = recs[0]["mono_ns"], recs[-1]["mono_ns"]
    x_resumed = 64 + (resumed["mono_ns"] - t0) / (t1 - t0) * (940 - 64 - 16)
    assert abs(float(band[1]) + float(band[2]) - x_resumed) < 1.5


def test_one_host_chart_per_node(spike_file):
    recs = read_records([spike_file])
    two = sorted(
        recs + [{**r, "node": "n2"} for r in recs if r.get("node") == "n1"],
        key=lambda r: r["mono_ns"],
    )
    page = render_html(two)
    assert (
        page.count('data-chart="host-memory"') == 2
        and 'data-node="n1"' in page
        and 'data-node="n2"' in page
    )
    assert page.count('data-mark="save-peak"') == 2


def _figure_texts(fig) -> list:
    """The figure's own texts (titles, labels, annotations); matplotlib's tick labels are left out:
    it keeps labels of ticks outside the view, undrawn, among the figure's artists."""
    fig.canvas.draw()
    ticks = {id(t) for ax in fig.axes for t in ax.get_xticklabels() + ax.get_yticklabels()}
    return [
        t
        for t in fig.findobj(lambda a: hasattr(a, "get_text") and hasattr(a, "get_window_extent"))
        if t.get_visible() and t.get_text().strip() and id(t) not in ticks
    ]


def test_report_png_carries_the_same_story(spike_file, killed_file, tmp_path):
    pytest.importorskip("matplotlib", reason="--png is an optional extra (ckptguard[report])")
    from PIL import Image

    from ckptguard.memory.figure import build_figure

    for path, headline, save_text in (
        (
            spike_file,
            "Failure: none",
            "save peak 6.59 GiB (step 6), headroom 1.01 GiB to the 7.60 GiB limit",
        ),
        (
            killed_file,
            "Failure: cgroup_oom_kill in phase 'save' (step 6)",
            "save peak 6.59 GiB (step 6, died in it)",
        ),
    ):
        recs = read_records([path])
        fig = build_figure(recs)
        try:
            texts = _figure_texts(fig)
            words = [t.get_text() for t in texts]
            assert any(w.startswith(headline) for w in words), words
            assert any(w.startswith(save_text) for w in words), words
            # Every phase is named: one by one where they fit, a run as "update xN" where not.
            updates = sum(
                int(w.split(" x")[1]) if " x" in w else 1 for w in words if w.startswith("update")
            )
            assert "load" in words and (
                "save (died here)" in words
                if "cgroup" in headline
                else "save" in words and updates == 6
            ), words
            assert any(w.startswith("memory.max 8.00 GiB") for w in words)
            assert any(w.startswith("Ray threshold 7.60 GiB") for w in words)
            titles = [ax.get_title(loc="left") for ax in fig.axes]
            assert "Host memory on n1" in titles and not any(
                "GPU" in t for t in titles
            )  # no empty GPU chart
            renderer = fig.canvas.get_renderer()
            host = next(ax for ax in fig.axes if ax.get_title(loc="left") == "Host memory on n1")
            for (
                t
            ) in texts:  # every label fully inside the image, limit labels inside the host chart
                e = t.get_window_extent(renderer)
                box = (
                    host.bbox
                    if t.get_text().startswith(("memory.max", "Ray threshold"))
                    else fig.bbox
                )
                assert (
                    box.x0 - 1 <= e.x0
                    and e.x1 <= box.x1 + 1
                    and box.y0 - 1 <= e.y0
                    and e.y1 <= box.y1 + 1
                ), t.get_text()
        finally:
            fig.clf()
        out = tmp_path / f"{path.parent.name}.png"
        r = CliRunner().invoke(mem, ["report", str(path), "--png", str(out)])
        assert r.exit_code == 0, r.output
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
        description = Image.open(out).text["Description"]
        assert headline in description and "Save step 6 on n1: peak 6.59 GiB" in description


def test_report_png_with_gpu(records_file, tmp_path):
    pytest.importorskip("matplotlib", reason="--png is an optional extra (ckptguard[report])")
    from ckptguard.memory.figure import build_figure

    fig = build_figure(read_records([records_file]))
    assert any(ax.get_title(loc="left").startswith("GPU memory") for ax in fig.axes)
    fig.clf()


class _Cdp:
    """Chromium's DevTools protocol over --remote-debugging-pipe (fd 3 in, fd 4 out, NUL-framed
    JSON)."""

    def __init__(self, profile: Path) -> None:
        to_r, self._to_w = os.pipe()
        self._from_r, from_w = os.pipe()

        def wire() -> None:  # in the child: the pipe ends become fds 3 and 4
            a, b = os.dup(to_r), os.dup(from_w)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.proc = subprocess.Popen(
            [
                CHROMIUM,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--disable-dev-shm-usage",
                f"--user-data-dir={profile}",
                "--remote-debugging-pipe",
                "about:blank",
            ],
            preexec_fn=wire,
            close_fds=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_r)
        os.close(from_w)
        self._buf, self._id, self.events = b"", 0, []

    def blank_page(self) -> str:
        """A new blank target, attached (flat): its session id."""
        target = self.call("Target.createTarget", {"url": "about:blank"})["result"]["targetId"]
        return self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["result"][
            "sessionId"
        ]

    def call(
        self,
        method: str,
        params: dict | None = None,
        session: str | None = None,
        timeout: float = 20.0,
    ):
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._to_w, json.dumps(msg).encode() + b"\0")
        return self.wait(lambda m: m.get("id") == self._id, timeout)

    def wait(self, pred, timeout: float = 20.0):
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" in self._buf:
                raw, self._buf = self._buf.split(b"\0", 1)
                m = json.loads(raw)
                if "method" in m:
                    self.events.append(m)
                if pred(m):
                    if "error" in m:
                        raise AssertionError(f"CDP error: {m['error']}")
                    return m
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_r], [], [], left)[0]:
                raise TimeoutError("Chromium did not answer over the DevTools pipe")
            chunk = os.read(self._from_r, 1 << 20)
            if not chunk:
                raise AssertionError("Chromium closed the DevTools pipe")
            self._buf += chunk

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        os.close(self._to_w)
        os.close(self._from_r)


DOM_FACTS = (
    "JSON.stringify((() => {\n"
    "  const q = (sel, root) => [...(root || document).querySelectorAll(sel)];\n"
    '  const chart = (name) => `svg[data-chart="${name}"]`;\n'
    "  const box = (e) => { const r = e.getBoundingClientRect(); "
    "return [r.left, r.top, r.right, r.bottom]; };\n"
    "  const host = document.querySelector(chart('host-memory'));\n"
    "  return {\n"
    "    charts: q('svg[data-chart]').map(s => [s.dataset.chart, "
    "s.getBoundingClientRect().width]),\n"
    "    host_series: q(chart('host-memory') + ' [data-series]').map(\n"
    "      e => [e.dataset.series, e.getAttribute('points').trim().split(/\\s+/).length]),\n"
    "    phases: q(chart('host-memory') + ' [data-phase]').map(e => e.dataset.phase),\n"
    "    limits: q(chart('host-memory') + ' [data-limit]').map(e => [e.dataset.limit, "
    "e.dataset.bytes, e.textContent]),\n"
    "    plot: host && host.querySelector('[data-plot-area]') ? "
    "box(host.querySelector('[data-plot-area]')) : null,\n"
    "    svg: host ? box(host) : null,\n"
    "    limit_labels: q(chart('host-memory') + ' [data-limit] text').map(e => [e.textContent, "
    "box(e)]),\n"
    "    phase_labels: q(chart('host-memory') + ' [data-phase-label]').map(e => [e.textContent, "
    "box(e)]),\n"
    "    peaks: q(chart('host-memory') + ' [data-peak]').map(e => [e.dataset.peak, "
    "+e.dataset.bytes, box(e)]),\n"
    "    mark: q(chart('host-memory') + ' [data-mark=\"save-peak\"] text').map(e => "
    "[e.textContent, box(e)]),\n"
    "    floor_series: q(chart('process-floors') + ' [data-series]').map(e => e.dataset.series),\n"
    "    verdicts: q('tr[data-verdict]').map(e => [e.dataset.pid, e.dataset.verdict]),\n"
    "    gpu_series: q(chart('gpu-memory') + ' [data-series]').map(e => [e.dataset.series, "
    "+e.dataset.points]),\n"
    "    killer: document.querySelector('[data-killer]').dataset.killer,\n"
    "    text: document.body.innerText,\n"
    "    height: document.documentElement.scrollHeight,\n"
    "    resources: performance.getEntriesByType('resource').map(e => e.name),\n"
    "  };\n"
    "})())"
)


NO_CHROMIUM = "chromium is not installed (Debian package 'chromium'; make test installs it)"


def _open(cdp: _Cdp, sid: str, page: Path, shot: Path) -> dict:
    """Load ``page`` 1000 px wide, read the DOM facts, and save a full-page screenshot to
    ``shot``."""
    # The charts scale to the page's width: the facts are read at the width the screenshot is taken
    # at.
    cdp.call(
        "Emulation.setDeviceMetricsOverride",
        {"width": 1000, "height": 900, "deviceScaleFactor": 1, "mobile": False},
        session=sid,
    )
    cdp.call("Page.navigate", {"url": page.as_uri()}, session=sid)
    cdp.wait(lambda m: m.get("method") == "Page.loadEventFired" and m.get("sessionId") == sid)
    res = cdp.call(
        "Runtime.evaluate", {"expression": DOM_FACTS, "returnByValue": True}, session=sid
    )
    facts = json.loads(res["result"]["result"]["value"])
    cdp.call(
        "Emulation.setDeviceMetricsOverride",
        {"width": 1000, "height": facts["height"], "deviceScaleFactor": 1, "mobile": False},
        session=sid,
    )
    png = cdp.call("Page.captureScreenshot", {"format": "png"}, session=sid)["result"]["data"]
    shot.write_bytes(base64.b64decode(png))
    return facts


def _inside(inner: list[float], outer: list[float]) -> bool:
    return (
        outer[0] - 0.5 <= inner[0]
        and inner[2] <= outer[2] + 0.5
        and outer[1] - 0.5 <= inner[1]
        and inner[3] <= outer[3] + 0.5
    )


def _apart(a: list[float], b: list[float]) -> bool:
    return a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1]


@pytest.mark.timeout(90)
@pytest.mark.skipif(CHROMIUM is None, reason=NO_CHROMIUM)
def test_report_in_headless_chromium(records_file, spike_file, tmp_path):
    pages = {}
    for name, src in (("gpu", records_file), ("spike", spike_file)):
        pages[name] = tmp_path / f"{name}.html"
        assert (
            CliRunner().invoke(mem, ["report", str(src), "--html", str(pages[name])]).exit_code == 0
        )
    cdp = _Cdp(tmp_path / "profile")
    try:
        sid = cdp.blank_page()
        cdp.call("Network.enable", session=sid)
        cdp.call("Page.enable", session=sid)
        facts = {
            name: _open(cdp, sid, page, tmp_path / f"{name}-screenshot.png")
            for name, page in pages.items()
        }
        requested = [
            e["params"]["request"]["url"]
            for e in cdp.events
            if e.get("method") == "Network.requestWillBeSent"
        ]
    finally:
        cdp.close()

    f = facts["gpu"]
    assert {name for name, _ in f["charts"]} == {"host-memory", "process-floors", "gpu-memory"}
    assert all(width > 100 for _, width in f["charts"])  # laid out, not just present
    series = dict(f["host_series"])
    assert set(series) == {"anon", "shmem", "file", "current"} and min(series.values()) >= 12
    assert {"load", "update", "save"} <= set(f["phases"])
    limits = {name: (int(b), text) for name, b, text in f["limits"]}
    assert limits["memory.max"][0] == 8 * GiB and "8.00 GiB" in limits["memory.max"][1]
    assert (
        limits["ray-threshold"][0] == int(8 * GiB * 0.95)
        and "7.60 GiB" in limits["ray-threshold"][1]
    )
    assert {"100 leaky", "200 steady"} <= set(f["floor_series"])
    assert ["100", "rising"] in f["verdicts"] and ["200", "flat"] in f["verdicts"]
    assert dict(f["gpu_series"])["allocated"] >= 16 and dict(f["gpu_series"])["reserved"] >= 16
    assert f["killer"] == "none"

    s = facts["spike"]
    # No GPU figure in the records: no GPU chart is drawn, the page says why.
    assert {name for name, _ in s["charts"]} == {"host-memory", "process-floors"}
    assert "No GPU chart: GPU figures not obtained" in s["text"]
    # Every limit label and the save mark's label lie inside the plot area, apart from each other.
    assert s["plot"] is not None, "the host chart marks no plot area"
    assert len(s["limit_labels"]) == 2 and len(s["mark"]) >= 1
    labels = s["limit_labels"] + s["mark"]
    for text, b in labels:
        assert _inside(b, s["plot"]), (text, b, s["plot"])
    for i, (ta, a) in enumerate(labels):
        for tb, b in labels[i + 1 :]:
            assert _apart(a, b), (ta, tb)
    for i, (ta, a) in enumerate(
        s["phase_labels"]
    ):  # phase names: inside the chart, never on top of another
        assert _inside(a, s["svg"]), ta
        for tb, b in s["phase_labels"][i + 1 :]:
            assert _apart(a, b), (ta, tb)
    # Each phase's in-phase peak is drawn (visible width), the save's above the others.
    peaks = {name: (v, b) for name, v, b in s["peaks"] if name == "save"}
    assert len(s["peaks"]) == 8 and all(b[2] - b[0] >= 7 for _, _, b in s["peaks"])
    assert all(peaks["save"][1][1] < b[1] for name, _, b in s["peaks"] if name != "save")
    mark_text = " ".join(t for t, _ in s["mark"])
    assert (
        "save peak 6.59 GiB (step 6)" in mark_text
        and "headroom 1.01 GiB to the 7.60 GiB limit" in mark_text
    )
    assert "peak" in s["text"] and "headroom 1.01 GiB (13% of the limit)" in s["text"]
    shot = (tmp_path / "spike-screenshot.png").read_bytes()
    assert shot[:8] == b"\x89PNG\r\n\x1a\n" and len(shot) > 20_000
    # No network: the pages themselves are the only requests, and they fetched no sub-resource.
    assert requested == [p.as_uri() for p in pages.values()]
    assert f["resources"] == [] and s["resources"] == []
