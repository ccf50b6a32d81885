"""``mem report``: one self-contained HTML page of the memory records.

Contract: ``render_html(records)`` returns a page with inline SVG and inline CSS only; its
Content-Security-Policy forbids every network load, so it opens the same offline, from a
ticket attachment or a CI artifact. Charts, each an ``<svg data-chart=...>``:

* ``host-memory``: host memory over time, stacked by anon, shmem and file (page cache without
  shmem: in memory.stat shmem is counted inside file, so stacking file whole would count pinned
  memory twice); phases as bands (``data-phase``); limit lines (``data-limit`` = memory.max,
  ray-threshold, MemTotal) with their bytes in ``data-bytes``;
* ``process-floors``: each process's PSS floor per interval (``data-series`` = "pid comm"), next to
  a table with the growth verdict (``data-verdict`` = rising or flat);
* ``gpu-memory``: allocated and reserved from the phase records (and in-phase peaks).

A figure that was not obtained is said so on the page, never drawn as 0. The failure verdict
(who killed it) heads the page when a failure is visible.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

from .growth import GrowthConfig, GrowthReport, analyze_growth
from .killer import Killer, classify_failure

__all__ = ["render_html"]

W, H, L, R, T, B = 940, 280, 70, 190, 20, 36
COLORS = {"anon": "#4e79a7", "shmem": "#e15759", "file": "#76b7b2", "allocated": "#59a14f", "reserved": "#f28e2b"}
PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f"]


def _gib(n: float | None) -> str:
    return "not obtained" if n is None else f"{n / 2**30:.2f} GiB"


def _e(s: Any) -> str:
    return html.escape(str(s), quote=True)


@dataclass
class _Axes:
    t0: float
    t1: float
    ymax: float

    def x(self, t: float) -> float:
        span = (self.t1 - self.t0) or 1.0
        return L + (t - self.t0) / span * (W - L - R)

    def y(self, v: float) -> float:
        return H - B - (v / (self.ymax or 1.0)) * (H - T - B)


def _frame(ax: _Axes, title: str) -> list[str]:
    # Small jobs (and tests) stay readable: MiB ticks below 2 GiB.
    unit, div = ("GiB", 2**30) if ax.ymax >= 2 * 2**30 else ("MiB", 2**20)
    out = [f'<text x="{L}" y="14" class="title">{_e(title)}</text>',
           f'<line x1="{L}" y1="{H - B}" x2="{W - R}" y2="{H - B}" class="axis"/>',
           f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H - B}" class="axis"/>']
    for i in range(5):
        v = ax.ymax * i / 4
        out.append(f'<text x="{L - 6}" y="{ax.y(v) + 4:.1f}" class="tick" text-anchor="end">{v / div:.1f}</text>')
    for i in range(5):
        t = ax.t0 + (ax.t1 - ax.t0) * i / 4
        out.append(f'<text x="{ax.x(t):.1f}" y="{H - B + 16}" class="tick" text-anchor="middle">'
                   f'{t - ax.t0:.1f}s</text>')
    out.append(f'<text x="12" y="{T + 10}" class="tick">{unit}</text>')
    return out


def _phase_bands(records: list[dict[str, Any]], ax: _Axes) -> list[str]:
    out, open_ = [], {}
    for r in records:
        key = (r.get("node"), r.get("pid"), r.get("phase"))
        if r["kind"] == "phase_start":
            open_[key] = r["mono_ns"] / 1e9
        elif r["kind"] in ("phase_end", "phase_failure") and key in open_:
            t0, t1 = open_.pop(key), r["mono_ns"] / 1e9
            x0, x1 = ax.x(t0), ax.x(t1)
            cls = "band fail" if r["kind"] == "phase_failure" else "band"
            out.append(f'<g data-phase="{_e(r["phase"])}" data-step="{_e(r.get("step"))}">'
                       f'<rect x="{x0:.1f}" y="{T}" width="{max(1.0, x1 - x0):.1f}" height="{H - T - B}" '
                       f'class="{cls}"/>'
                       f'<text x="{x0 + 2:.1f}" y="{T + 10}" class="phase">{_e(r["phase"])}</text></g>')
    for (_, _, phase), t0 in open_.items():  # started, never ended: the process died in it
        x0 = ax.x(t0)
        out.append(f'<g data-phase="{_e(phase)}" data-open="true"><rect x="{x0:.1f}" y="{T}" '
                   f'width="{max(1.0, W - R - x0):.1f}" height="{H - T - B}" class="band fail"/>'
                   f'<text x="{x0 + 2:.1f}" y="{T + 10}" class="phase">{_e(phase)} (never ended)</text></g>')
    return out


def _limit(ax: _Axes, name: str, value: int | None, why: str) -> str:
    if value is None:
        return f'<text data-limit="{_e(name)}" data-bytes="" x="{W - R + 6}" y="{H - B}" class="note">' \
               f'{_e(name)}: not obtained ({_e(why)})</text>'
    y = ax.y(value)
    return (f'<g data-limit="{_e(name)}" data-bytes="{value}"><line x1="{L}" y1="{y:.1f}" x2="{W - R}" y2="{y:.1f}" '
            f'class="limit"/><text x="{W - R + 6}" y="{y + 4:.1f}" class="limit-label">{_e(name)} {_gib(value)}'
            '</text></g>')


def _host_chart(records: list[dict[str, Any]], t0: float, t1: float) -> str:
    pts = []
    for r in records:
        h = r.get("host")
        if h and h.get("anon") is not None:
            shmem = h.get("shmem") or 0
            file_ = max(0, (h.get("file") or 0) - shmem)
            pts.append((r["mono_ns"] / 1e9, {"anon": h["anon"], "shmem": shmem, "file": file_}))
    last_h: dict[str, Any] = next((r["host"] for r in reversed(records) if r.get("host")), {}) or {}
    last_ray: dict[str, Any] = next((r["ray"] for r in reversed(records) if r.get("ray")), {}) or {}
    mm = last_h.get("limit") if last_h.get("source") not in (None, "none") else None
    limits = [("memory.max", mm, (last_h.get("not_obtained") or {}).get("limit", "no cgroup"))]
    limits.append(("ray-threshold", last_ray.get("threshold_bytes"), "no Ray figure in the records"))
    if mm is None:
        limits.append(("MemTotal", last_h.get("mem_total"), "meminfo unreadable"))
    top = max([sum(v.values()) for _, v in pts] + [0])
    shown = [v for _, v, _ in limits if v is not None]
    # Scale to the data, but keep a limit line in view when it is within 4x of the data.
    ymax = max([top] + [v for v in shown if v <= 4 * max(top, 1)]) * 1.08 or 1.0
    ax = _Axes(t0, t1, ymax)
    out = _frame(ax, "Host memory (stacked: anon, shmem, file without shmem)")
    out += _phase_bands(records, ax)
    base = [0.0] * len(pts)
    for name in ("anon", "shmem", "file"):
        tops = [b + v[name] for b, (_, v) in zip(base, pts, strict=True)]
        if pts:
            fwd = " ".join(f"{ax.x(t):.1f},{ax.y(min(y, ymax)):.1f}" for (t, _), y in zip(pts, tops, strict=True))
            back = " ".join(f"{ax.x(t):.1f},{ax.y(min(y, ymax)):.1f}" for (t, _), y in reversed(
                list(zip(pts, base, strict=True))))
            out.append(f'<polygon data-series="{name}" points="{fwd} {back}" fill="{COLORS[name]}" '
                       f'fill-opacity="0.75"><title>{name}</title></polygon>')
        base = tops
    off = 0
    for name, value, why in limits:
        if value is not None and value > ymax:
            out.append(_limit_off(name, value, T + 24 + 14 * off))
            off += 1
        else:
            out.append(_limit(ax, name, value, why))
    legend = "".join(f'<span class="key" style="background:{COLORS[n]}"></span>{n} ' for n in ("anon", "shmem", "file"))
    return _svg("host-memory", out) + f'<p class="legend">{legend} (x: seconds since the first record)</p>'


def _limit_off(name: str, value: int, y: float) -> str:
    return (f'<text data-limit="{_e(name)}" data-bytes="{value}" x="{W - R + 6}" y="{y}" class="note">'
            f'{_e(name)} {_gib(value)} (above the scale)</text>')


def _svg(name: str, parts: list[str]) -> str:
    return f'<svg data-chart="{name}" viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img">' + "".join(parts) + \
        "</svg>"


def _floors_chart(growth: GrowthReport, t0: float, t1: float) -> str:
    ymax = max([v for p in growth.processes for _, v in p.floors_per_interval] + [1]) * 1.08
    ax = _Axes(t0, t1, ymax)
    out = _frame(ax, "Per-process PSS floor")
    rows = []
    for i, p in enumerate(growth.processes):
        color = PALETTE[i % len(PALETTE)]
        label = f"{p.pid} {p.comm}"
        pts = " ".join(f"{ax.x(t):.1f},{ax.y(v):.1f}" for t, v in p.floors_per_interval)
        out.append(f'<polyline data-series="{_e(label)}" points="{pts}" fill="none" stroke="{color}" '
                   f'stroke-width="2"><title>{_e(label)}</title></polyline>')
        verdict = "rising" if p.rising else "flat"
        per_s = "n/a" if p.per_second is None else f"{p.per_second.value / 1024:.1f} KiB/s"
        per_step = "n/a" if p.per_step is None else f"{p.per_step.value / 2**20:.2f} MiB/step"
        rows.append(f'<tr data-pid="{p.pid}" data-verdict="{verdict}"><td><span class="key" style="background:{color}">'
                    f'</span>{p.pid}</td><td>{_e(p.comm)}</td><td>{_e(p.argv0)}</td><td>{_gib(p.last_floor)}</td>'
                    f'<td>{per_s}</td><td>{per_step}</td><td class="{verdict}">{verdict}</td>'
                    f'<td>{_e(p.reason)}</td></tr>')
    table = ('<table class="verdicts"><tr><th>pid</th><th>comm</th><th>argv0</th><th>last floor</th><th>slope/s</th>'
             '<th>slope/step</th><th>verdict</th><th>why</th></tr>' + "".join(rows) + "</table>")
    hint = ""
    n = growth.node
    if n.hint_seconds_to_limit is not None or n.hint_steps_to_limit is not None:
        hint = (f'<p class="hint" data-hint="limit">{_e(n.hint_label)}: node floor would reach '
                f'{_gib(n.limit_bytes)} in ~{n.hint_seconds_to_limit or float("nan"):.0f} s / '
                f'~{n.hint_steps_to_limit or float("nan"):.0f} steps.</p>')
    return _svg("process-floors", out) + table + hint


def _gpu_chart(records: list[dict[str, Any]], t0: float, t1: float) -> str:
    series: dict[str, list[tuple[float, int]]] = {"allocated": [], "reserved": []}
    reasons = set()
    for r in records:
        g = r.get("gpu")
        if not g:
            continue
        for name in series:
            if g.get(name) is not None:
                series[name].append((r["mono_ns"] / 1e9, g[name]))
            else:
                reasons.add((g.get("not_obtained") or {}).get(name, "not obtained"))
        peak = r.get("peak") or {}
        for name in series:
            if peak.get("gpu_" + name) is not None:
                series[name].append((r["mono_ns"] / 1e9 - 1e-6, peak["gpu_" + name]))
    for s in series.values():
        s.sort()
    totals = [g["device_total"] for r in records if (g := r.get("gpu")) and g.get("device_total")]
    ymax = max([v for s in series.values() for _, v in s] + [1]) * 1.08
    ax = _Axes(t0, t1, ymax)
    out = _frame(ax, "GPU memory (this process's caching allocator)")
    out += _phase_bands(records, ax)
    for name, pts in series.items():
        p = " ".join(f"{ax.x(t):.1f},{ax.y(v):.1f}" for t, v in pts)
        out.append(f'<polyline data-series="{name}" data-points="{len(pts)}" points="{p}" fill="none" '
                   f'stroke="{COLORS[name]}" stroke-width="2"><title>{name}</title></polyline>')
    if totals and totals[-1] <= ymax:
        out.append(_limit(ax, "device total", totals[-1], ""))
    note = ""
    if not any(series.values()):
        why = "; ".join(sorted(reasons)) or "no GPU records"
        note = f'<p class="note" data-not-obtained="gpu">GPU figures not obtained: {_e(why)}</p>'
    legend = "".join(f'<span class="key" style="background:{COLORS[n]}"></span>{n} ' for n in series)
    return _svg("gpu-memory", out) + f'<p class="legend">{legend}</p>' + note


CSS = """body{font:14px sans-serif;margin:24px;color:#222}h1{font-size:20px}h2{font-size:16px;margin-top:28px}
.axis{stroke:#444}.tick{font-size:11px;fill:#444}.title{font-size:13px;font-weight:bold}
.band{fill:#bbb;fill-opacity:.18;stroke:#999;stroke-dasharray:2 2}.band.fail{fill:#e15759;fill-opacity:.25}
.phase{font-size:10px;fill:#333}.limit{stroke:#c00;stroke-width:1.5;stroke-dasharray:6 3}
.limit-label{font-size:11px;fill:#c00}.note{font-size:12px;fill:#a00;color:#a00}
.key{display:inline-block;width:12px;height:12px;margin:0 4px 0 10px;vertical-align:middle}
table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px;font-size:12px}
.rising{color:#c00;font-weight:bold}.flat{color:#270}.verdict{padding:8px;border:2px solid #c00;background:#fee}
.ok{border-color:#270;background:#efe}.hint{font-style:italic}"""


def render_html(records: list[dict[str, Any]], *, growth: GrowthReport | None = None, ray_log: str | None = None,
                title: str = "ckptguard memory report") -> str:
    """The whole page as a string; ``records`` sorted by time, as read_records returns them."""
    growth = growth or analyze_growth(records, GrowthConfig())
    kill = classify_failure(records, ray_log=ray_log)
    t0 = records[0]["mono_ns"] / 1e9 if records else 0.0
    t1 = records[-1]["mono_ns"] / 1e9 if records else 1.0
    cls = "verdict ok" if kill.killer is Killer.NONE else "verdict"
    evidence = "".join(f"<li>{_e(e)}</li>" for e in kill.evidence + kill.notes)
    head = (f'<div class="{cls}" data-killer="{kill.killer.value}"><b>Failure:</b> {_e(kill.killer.value)}'
            f'{" in phase " + _e(kill.phase) if kill.phase else ""}<ul>{evidence}</ul></div>')
    nodes = sorted({str(r.get("node")) for r in records})
    return (
        "<!DOCTYPE html><html><head><meta charset=\"utf-8\">"
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'\">"
        f"<title>{_e(title)}</title><style>{CSS}</style></head><body>"
        f"<h1>{_e(title)}</h1><p>{len(records)} records from node(s) {_e(', '.join(nodes))}; "
        f"{growth.steps_seen} steps.</p>{head}"
        f"<h2>Host memory</h2>{_host_chart(records, t0, t1)}"
        f"<h2>Per-process floors and growth</h2>{_floors_chart(growth, t0, t1)}"
        f"<h2>GPU memory</h2>{_gpu_chart(records, t0, t1)}"
        "</body></html>"
    )
