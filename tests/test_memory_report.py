"""The report: rendered, then opened in headless Chromium and checked through the DOM (no network loads)."""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptguard.memory import HostProbe, HostProbeConfig, PhaseKind, PhaseRecorder, RecorderConfig, read_records
from ckptguard.memory.cli import mem
from ckptguard.memory.report import render_html

FIX = Path(__file__).parent / "fixtures" / "memory"
GiB = 1 << 30
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture
def records_file(tmp_path) -> Path:
    """Real phase records (v2 fixture cgroup: memory.max 8 GiB), watch-style samples of a rising
    and a flat process, and GPU figures as a GPU run writes them."""
    tree = FIX / "cgroup_v2"
    probe = HostProbe(HostProbeConfig(proc_root=tree / "proc", cgroup_root=tree / "sys" / "fs" / "cgroup"))
    phases = tmp_path / "phases.jsonl"
    with PhaseRecorder(RecorderConfig(path=phases, node="n1", probe_gpu=False), host_probe=probe) as rec:
        with rec.phase(PhaseKind.LOAD, step=0):
            time.sleep(0.01)
        for step in range(1, 7):
            with rec.phase(PhaseKind.UPDATE, step=step):
                pass
        with rec.phase(PhaseKind.SAVE, step=6):
            time.sleep(0.01)
    recs = read_records([phases])
    t0, t1 = recs[0]["mono_ns"], recs[-1]["mono_ns"]
    out = tmp_path / "all.jsonl"
    with open(out, "w") as fh:
        for i, r in enumerate(recs):
            r["gpu"] = {"allocated": (20 + i) * GiB, "reserved": (30 + i) * GiB, "device_total": 140 * GiB}
            fh.write(json.dumps(r) + "\n")
        for i in range(12):
            t = t0 + (t1 - t0) * i // 11
            procs = [{"pid": 100, "comm": "leaky", "argv0": "python", "pss": GiB + i * (64 << 20)},
                     {"pid": 200, "comm": "steady", "argv0": "python", "pss": GiB // 2}]
            fh.write(json.dumps({"v": 1, "kind": "sample", "mono_ns": t + 1, "node": "n1", "pid": 1,
                                 "procs": procs, "host": recs[0]["host"], "ray": recs[0]["ray"]}) + "\n")
    return out


def test_report_html_is_self_contained_and_complete(records_file, tmp_path):
    page = render_html(read_records([records_file]))
    assert "default-src 'none'" in page
    for needle in ('data-chart="host-memory"', 'data-chart="process-floors"', 'data-chart="gpu-memory"',
                   'data-series="anon"', 'data-series="shmem"', 'data-series="file"', 'data-phase="save"',
                   f'data-limit="memory.max" data-bytes="{8 * GiB}"', 'data-verdict="rising"', 'data-verdict="flat"'):
        assert needle in page, needle
    assert "http://" not in page and "https://" not in page and "<script" not in page
    out = tmp_path / "r.html"
    r = CliRunner().invoke(mem, ["report", str(records_file), "--html", str(out)])
    assert r.exit_code == 0 and out.read_text() == page


def test_report_png(records_file, tmp_path):
    pytest.importorskip("matplotlib", reason="--png is an optional extra (ckptguard[report])")
    out = tmp_path / "r.png"
    r = CliRunner().invoke(mem, ["report", str(records_file), "--png", str(out)])
    assert r.exit_code == 0, r.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


class _Cdp:
    """Chromium's DevTools protocol over --remote-debugging-pipe (fd 3 in, fd 4 out, NUL-framed JSON)."""

    def __init__(self, profile: Path) -> None:
        to_r, self._to_w = os.pipe()
        self._from_r, from_w = os.pipe()

        def wire() -> None:  # in the child: the pipe ends become fds 3 and 4
            a, b = os.dup(to_r), os.dup(from_w)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--remote-debugging-pipe", "about:blank"],
            preexec_fn=wire, close_fds=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        os.close(to_r)
        os.close(from_w)
        self._buf, self._id, self.events = b"", 0, []

    def call(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 20.0):
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


DOM_FACTS = """JSON.stringify((() => {
  const q = (sel) => [...document.querySelectorAll(sel)];
  const chart = (name) => `svg[data-chart="${name}"]`;
  return {
    charts: q('svg[data-chart]').map(s => [s.dataset.chart, s.getBoundingClientRect().width]),
    host_series: q(chart('host-memory') + ' [data-series]').map(
      e => [e.dataset.series, e.getAttribute('points').trim().split(/\\s+/).length]),
    phases: q(chart('host-memory') + ' [data-phase]').map(e => e.dataset.phase),
    limits: q(chart('host-memory') + ' [data-limit]').map(e => [e.dataset.limit, e.dataset.bytes, e.textContent]),
    floor_series: q(chart('process-floors') + ' [data-series]').map(e => e.dataset.series),
    verdicts: q('tr[data-verdict]').map(e => [e.dataset.pid, e.dataset.verdict]),
    gpu_series: q(chart('gpu-memory') + ' [data-series]').map(e => [e.dataset.series, +e.dataset.points]),
    killer: document.querySelector('[data-killer]').dataset.killer,
    resources: performance.getEntriesByType('resource').map(e => e.name),
  };
})())"""


NO_CHROMIUM = "chromium is not installed (Debian package 'chromium'; make test installs it)"


@pytest.mark.timeout(60)
@pytest.mark.skipif(CHROMIUM is None, reason=NO_CHROMIUM)
def test_report_in_headless_chromium(records_file, tmp_path):
    page = tmp_path / "report.html"
    assert CliRunner().invoke(mem, ["report", str(records_file), "--html", str(page)]).exit_code == 0
    cdp = _Cdp(tmp_path / "profile")
    try:
        target = cdp.call("Target.createTarget", {"url": "about:blank"})["result"]["targetId"]
        sid = cdp.call("Target.attachToTarget", {"targetId": target, "flatten": True})["result"]["sessionId"]
        cdp.call("Network.enable", session=sid)
        cdp.call("Page.enable", session=sid)
        url = page.as_uri()
        cdp.call("Page.navigate", {"url": url}, session=sid)
        cdp.wait(lambda m: m.get("method") == "Page.loadEventFired" and m.get("sessionId") == sid)
        res = cdp.call("Runtime.evaluate", {"expression": DOM_FACTS, "returnByValue": True}, session=sid)
        facts = json.loads(res["result"]["result"]["value"])
        requested = [e["params"]["request"]["url"] for e in cdp.events
                     if e.get("method") == "Network.requestWillBeSent"]
    finally:
        cdp.close()

    assert {name for name, _ in facts["charts"]} == {"host-memory", "process-floors", "gpu-memory"}
    assert all(width > 100 for _, width in facts["charts"])  # laid out, not just present
    series = dict(facts["host_series"])
    assert set(series) == {"anon", "shmem", "file"} and min(series.values()) >= 2 * 12
    assert {"load", "update", "save"} <= set(facts["phases"])
    limits = {name: (int(b), text) for name, b, text in facts["limits"]}
    assert limits["memory.max"][0] == 8 * GiB and "8.00 GiB" in limits["memory.max"][1]
    assert limits["ray-threshold"][0] == int(8 * GiB * 0.95) and "7.60 GiB" in limits["ray-threshold"][1]
    assert {"100 leaky", "200 steady"} <= set(facts["floor_series"])
    assert ["100", "rising"] in facts["verdicts"] and ["200", "flat"] in facts["verdicts"]
    assert dict(facts["gpu_series"])["allocated"] >= 16 and dict(facts["gpu_series"])["reserved"] >= 16
    assert facts["killer"] == "none"
    # No network: the page itself is the only request, and it fetched no sub-resource.
    assert requested == [url] and facts["resources"] == []
