"""``mem report``: one self-contained HTML page of the memory records.

Contract: ``render_html(records)`` returns a page with inline SVG and inline CSS only; its
Content-Security-Policy forbids every network load, so it opens the same offline, from a
ticket attachment or a CI artifact. It shows what docs/practices.md says matters (memory budget):
the failure verdict (who killed it) first, then the save step's peak and its headroom to the
limit (cgroup memory.max x Ray threshold), then one chart per node, each an
``<svg data-chart=...>``:

* ``host-memory`` (``data-node``): host memory over time, stacked by anon, shmem and file (page
  cache without shmem: memory.stat counts shmem inside file); the current figure (memory.current)
  at every record (``data-series="current"``); phases as bands (``data-phase``) named in a strip
  above the plot; each phase's in-phase sampled peak drawn across its band (``data-peak`` =
  phase, ``data-bytes``); the limit lines (``data-limit`` = memory.max, ray-threshold,
  MemTotal; ``data-bytes``) labelled inside the plot; and the save step's peak marked with its
  headroom to the limit (``data-mark="save-peak"``, ``data-bytes``, ``data-headroom``);
* a phase table (``table.phases``): per phase its boundary figures, sampled peak and headroom;
* ``process-floors``: each process's PSS floor per interval (``data-series`` = "pid comm"), next to
  a table with the growth verdict (``data-verdict`` = rising or flat);
* ``gpu-memory``: allocated and reserved from the phase records (and in-phase peaks).

A chart with nothing to draw is left out and the page says why in one line; a figure that was
not obtained is said so, never drawn as 0. The same content is drawn in the PNG (``figure``).
"""

from __future__ import annotations

from typing import Any

from ._story import (
    NodeStory,
    Span,
    Story,
    build_story,
    fmt_bytes,
    gpu_series,
    save_sentence,
)
from .growth import GrowthConfig, GrowthReport, analyze_growth
from .killer import Killer
from .svgchart import (
    CLEAR,
    COLORS,
    PALETTE,
    ROW,
    B,
    H,
    L,
    R,
    T,
    W,
    bands,
    bar_x,
    esc,
    frame,
    hline,
    limit_lines,
    peak_bars,
    save_mark,
    scaled,
)

__all__ = ["render_html"]

MAX_TABLE_ROWS = 40


def _host_chart(n: NodeStory, t0: float, t1: float) -> str:
    top = max(
        [sum(v.values()) for _, v in n.stack]
        + [v for _, v in n.current]
        + [s.peak for s in n.spans if s.peak is not None]
        + [1]
    )
    # Scale to the data, but keep a limit line in view when it is within 4x of the data.
    near = [lim.bytes for lim in n.limits if lim.bytes is not None and lim.bytes <= 4 * top]
    # Room above the top limit line for its label (a label pushed onto its line is struck through).
    room = 1 / (1 - (ROW + 2 * CLEAR) / (H - T - B))
    ax, unit, div, ticks = scaled(t0, t1, max([top * 1.04, *(b * room for b in near)]))
    out = frame(
        ax, f"Host memory on {n.node} (stacked: anon, shmem, file without shmem)", unit, div, ticks
    )
    out += bands(n.spans, ax)
    base = [0] * len(n.stack)
    for name in ("anon", "shmem", "file"):
        tops = [b + v[name] for b, (_, v) in zip(base, n.stack, strict=True)]
        if n.stack:
            fwd = " ".join(
                f"{ax.x(t):.1f},{ax.y(y):.1f}" for (t, _), y in zip(n.stack, tops, strict=True)
            )
            back = " ".join(
                f"{ax.x(t):.1f},{ax.y(y):.1f}"
                for (t, _), y in reversed(list(zip(n.stack, base, strict=True)))
            )
            out.append(
                f'<polygon data-series="{name}" points="{fwd} {back}" fill="{COLORS[name]}" '
                f'fill-opacity="0.7"><title>{name}</title></polygon>'
            )
        base = tops
    if n.current:
        pts = " ".join(f"{ax.x(t):.1f},{ax.y(v):.1f}" for t, v in n.current)
        out.append(
            f'<polyline data-series="current" points="{pts}" class="current">'
            f"<title>{esc(n.current_name)} at each record</title></polyline>"
        )
    out += peak_bars(n.spans, ax, n.budget.bytes)
    arrow_x = (ax.x(n.save.span.t0) + ax.x(n.save.span.t1)) / 2 if n.save is not None else None
    bars = [hline(ax.y(s.peak), *bar_x(s, ax)) for s in n.spans if s.peak is not None]
    if (
        n.save is not None and arrow_x is not None
    ):  # the save mark's arrow, dot and head: no label on them
        ends = (ax.y(n.save.span.peak or 0), ax.y(min(n.save.limit, ax.ymax)))
        bars.append(
            (arrow_x - 5 - CLEAR, min(ends) - 6 - CLEAR, arrow_x + 5 + CLEAR, max(ends) + 5 + CLEAR)
        )
    lines, taken = limit_lines(n, ax, arrow_x, bars)
    taken += bars
    out += lines
    out += save_mark(n, ax, taken)
    legend = "".join(
        f'<span class="key" style="background:{COLORS[k]}"></span>{k} '
        for k in ("anon", "shmem", "file")
    )
    legend += (
        f'<span class="key line"></span>{esc(n.current_name)} at each record '
        '<span class="key peak"></span>in-phase sampled peak (drawn across its phase) '
        '<span class="key limit"></span>limit'
    )
    missing = "".join(
        f'<p class="note" data-limit="{esc(lim.name)}" data-bytes="">{esc(lim.name)}: not obtained '
        f"({esc(lim.why)})</p>"
        for lim in n.limits
        if lim.bytes is None
    )
    return (
        f'<svg data-chart="host-memory" data-node="{esc(n.node)}" viewBox="0 0 {W} {H}" '
        f'width="{W}" height="{H}" class="chart" role="img">{"".join(out)}</svg><p '
        f'class="legend">{legend}</p>{missing}'
    )


def _phase_table(n: NodeStory) -> str:
    spans = n.spans
    caption = f"{len(spans)} phase(s) on {esc(n.node)}"
    if len(spans) > MAX_TABLE_ROWS:
        # A long run has thousands of phases: keep, per phase name, the one with the highest
        # peak, and every phase a process died in.
        best: dict[str, Span] = {}
        for s in spans:
            if s.phase not in best or (s.peak or -1) > (best[s.phase].peak or -1):
                best[s.phase] = s
        spans = sorted(
            {id(s): s for s in [*best.values(), *(s for s in spans if s.died)]}.values(),
            key=lambda s: s.t0,
        )
        caption += "; shown: the highest peak of each phase name and every phase that did not end"
    limit = n.budget.bytes
    rows = []
    for s in spans:
        room = "n/a" if limit is None or s.peak is None else fmt_bytes(limit - s.peak)
        state = "never ended" if s.never_ended else ("failed" if s.failed else "")
        end = "none (never ended)" if s.never_ended else fmt_bytes(s.end_current)
        cls = (
            ' class="save"' if n.save and s is n.save.span else (' class="died"' if s.died else "")
        )
        rows.append(
            f'<tr data-phase="{esc(s.phase)}" data-step="{esc(s.step)}" '
            f'data-peak="{s.peak or ""}"{cls}>'
            f"<td>{esc(s.phase)} "
            f"{esc(state)}</td><td>{esc(s.step)}</td><td>{esc(s.rank)}</td><td>{esc(s.pid)}</td>"
            f"<td>{s.t1 - s.t0:.2f} s</td><td>{fmt_bytes(s.start_current)}</td><td>{end}"
            f"</td><td><b>{fmt_bytes(s.peak)}</b></td><td>{esc(s.peak_source)}</td><td>{room}</td></tr>"
        )
    hp = (
        ""
        if n.memory_peak is None
        else f'<p class="legend">cgroup memory.peak at the last record: '
        f"{fmt_bytes(n.memory_peak)} (high-water mark "
        "since the cgroup was created or reset, not per phase).</p>"
    )
    return (
        f'<table class="phases"><caption>{caption}; limit {fmt_bytes(limit)} = '
        f"{esc(n.budget.derivation)}"
        f"</caption><tr><th>phase</th><th>step</th><th>rank</th><th>pid</th><th>duration</th>"
        f"<th>{esc(n.current_name)} at start</th><th>at end</th><th>in-phase "
        f"peak</th><th>peak from</th>"
        f"<th>headroom</th></tr>{''.join(rows)}</table>{hp}"
    )


def _floors_chart(growth: GrowthReport, t0: float, t1: float) -> str:
    procs = [p for p in growth.processes if p.floors_per_interval]
    if not procs:
        return (
            '<p class="note" data-not-obtained="floors">No per-process PSS readings in the records '
            "(run the job under mem watch, or record phases with probe_process).</p>"
        )
    ax, unit, div, ticks = scaled(
        t0, t1, max(v for p in procs for _, v in p.floors_per_interval) * 1.08
    )
    out = frame(ax, "Per-process PSS floor", unit, div, ticks)
    rows = []
    for i, p in enumerate(growth.processes):
        color = PALETTE[i % len(PALETTE)]
        label = f"{p.pid} {p.comm}"
        pts = " ".join(f"{ax.x(t):.1f},{ax.y(v):.1f}" for t, v in p.floors_per_interval)
        if (
            len(p.floors_per_interval) == 1
        ):  # one floor is a point, not a line (a polyline of one point is invisible)
            ((t, v),) = p.floors_per_interval
            out.append(
                f'<circle data-series="{esc(label)}" cx="{ax.x(t):.1f}" cy="{ax.y(v):.1f}" r="4" '
                f'fill="{color}"><title>{esc(label)}: one floor</title></circle>'
            )
        elif pts:
            out.append(
                f'<polyline data-series="{esc(label)}" points="{pts}" fill="none" stroke="{color}" '
                f'stroke-width="2"><title>{esc(label)}</title></polyline>'
            )
        verdict = "rising" if p.rising else "flat"
        per_s = "n/a" if p.per_second is None else f"{p.per_second.value / 1024:.1f} KiB/s"
        per_step = "n/a" if p.per_step is None else f"{p.per_step.value / 2**20:.2f} MiB/step"
        rows.append(
            f'<tr data-pid="{p.pid}" data-verdict="{verdict}"><td><span class="key" '
            f'style="background:{color}">'
            f"</span>{p.pid}</td><td>{esc(p.comm)}</td><td>{esc(p.argv0)}</td><td>{fmt_bytes(p.last_floor)}</td>"
            f'<td>{per_s}</td><td>{per_step}</td><td class="{verdict}">{verdict}</td>'
            f"<td>{esc(p.reason)}</td></tr>"
        )
    table = (
        '<table class="verdicts"><tr><th>pid</th><th>comm</th><th>argv0</th><th>last '
        "floor</th><th>slope/s</th>"
        "<th>slope/step</th><th>verdict</th><th>why</th></tr>" + "".join(rows) + "</table>"
    )
    hint = ""
    n = growth.node
    if n.hint_seconds_to_limit is not None or n.hint_steps_to_limit is not None:
        hint = (
            f'<p class="hint" data-hint="limit">{esc(n.hint_label)}: node floor would reach '
            f"{fmt_bytes(n.limit_bytes)} in ~{n.hint_seconds_to_limit or float('nan'):.0f} s / "
            f"~{n.hint_steps_to_limit or float('nan'):.0f} steps.</p>"
        )
    if all(len(p.floors_per_interval) < 2 for p in procs):
        # A chart of single points over the whole run says nothing the table does not: say why
        # instead.
        why = (
            '<p class="note" data-not-obtained="floors-chart">No PSS floor chart: the '
            "records give each process "
            "one floor only (their PSS samples fall in one interval), so there is no "
            "line to draw; the table "
            "below gives each floor. Sample longer or more often (mem watch "
            "--interval) for a chart.</p>"
        )
        return why + table + hint
    return _svg("process-floors", out) + table + hint


def _svg(name: str, parts: list[str]) -> str:
    head = (
        f'<svg data-chart="{name}" viewBox="0 0 {W} {H}" width="{W}" height="{H}" '
        'class="chart" role="img">'
    )
    return head + "".join(parts) + "</svg>"


def _gpu_chart(story: Story, records: list[dict[str, Any]]) -> str:
    series, reasons = gpu_series(records)
    if not any(series.values()):
        why = (
            "; ".join(sorted(reasons))
            or "no record carries GPU figures (no CUDA, or probe_gpu off)"
        )
        return (
            '<p class="note" data-not-obtained="gpu">No GPU chart: GPU figures not obtained '
            f"({esc(why)}).</p>"
        )
    totals = [g["device_total"] for r in records if (g := r.get("gpu")) and g.get("device_total")]
    top = max(v for s in series.values() for _, v in s)
    near = [totals[-1]] if totals and totals[-1] <= 1.5 * top else []
    ax, unit, div, ticks = scaled(story.t0, story.t1, max([top, *near]) * 1.04)
    out = frame(ax, "GPU memory (this process's caching allocator)", unit, div, ticks)
    out += bands([s for n in story.nodes for s in n.spans], ax)
    for name, pts in series.items():
        p = " ".join(f"{ax.x(t):.1f},{ax.y(v):.1f}" for t, v in pts)
        out.append(
            f'<polyline data-series="{name}" data-points="{len(pts)}" points="{p}" fill="none" '
            f'stroke="{COLORS[name]}" stroke-width="2"><title>{name}</title></polyline>'
        )
    if near:
        y = ax.y(near[0])
        out.append(
            f'<g data-limit="device total" data-bytes="{near[0]}"><line x1="{L}" '
            f'y1="{y:.1f}" x2="{W - R}" '
            f'y2="{y:.1f}" class="limit"/><text x="{L + 6}" y="{y - 4:.1f}" '
            f'class="limit-label">device total '
            f"{fmt_bytes(near[0])}</text></g>"
        )
    legend = "".join(
        f'<span class="key" style="background:{COLORS[n]}"></span>{n} ' for n in series
    )
    return _svg("gpu-memory", out) + f'<p class="legend">{legend}</p>'


CSS = (
    "body{font:14px sans-serif;margin:24px;color:#222}h1{font-size:20px}"
    "h2{font-size:16px;margin-top:28px}\n"
    ".axis{stroke:#444}.plot-area{fill:none;stroke:none}.grid{stroke:#000;stroke-opacity:.07}"
    ".tick{font-size:11px;fill:#444}\n"
    ".title{font-size:13px;font-weight:bold}.chart{max-width:100%;height:auto}\n"
    ".band{fill:#999;fill-opacity:.12;stroke:#888;stroke-opacity:.6;stroke-dasharray:2 2}\n"
    ".band.fail{fill:#e15759;fill-opacity:.22}\n"
    ".phase-label{font-size:10px;fill:#333}.phase-label.fail{fill:#c00;font-weight:bold}\n"
    ".current{fill:none;stroke:#222;stroke-width:1.2}.peak{stroke:#111;stroke-width:3}\n"
    ".limit{stroke:#c00;stroke-width:1.5;stroke-dasharray:6 3}\n"
    ".limit-label,.mark-label{font-size:11px;fill:#c00;paint-order:stroke;stroke:#fff;"
    "stroke-width:3px}\n"
    ".mark-label{fill:#111;font-weight:bold}.mark-label.over{fill:#c00}\n"
    ".headroom{stroke:#111;stroke-width:1.5}.headroom-head{fill:#111}"
    ".save-dot{fill:#fff;stroke:#111;stroke-width:2}\n"
    ".note{font-size:12px;fill:#a00;color:#a00}\n"
    ".key{display:inline-block;width:12px;height:12px;margin:0 4px 0 10px;vertical-align:middle}\n"
    ".key.line{height:2px;background:#222}.key.peak{height:4px;background:#111}\n"
    ".key.limit{height:0;border-top:2px dashed #c00}\n"
    "table{border-collapse:collapse;margin-top:8px}"
    "td,th{border:1px solid #ccc;padding:3px 8px;font-size:12px}\n"
    "caption{text-align:left;font-size:12px;padding:4px 0}tr.save{background:#fff3cd}"
    "tr.died{background:#fdd}\n"
    ".rising{color:#c00;font-weight:bold}.flat{color:#270}"
    ".verdict{padding:8px;border:2px solid #c00;background:#fee}\n"
    ".ok{border-color:#270;background:#efe}.hint{font-style:italic}\n"
    ".budget{padding:8px;border:2px solid #444;background:#f6f6f6;margin-top:10px}"
)


def _budget_box(story: Story) -> str:
    parts = []
    for n in story.nodes:
        if n.save is not None:
            parts.append(
                f'<li data-save-peak="{n.save.span.peak}" data-headroom="{n.save.headroom}" '
                f'data-node="{esc(n.node)}">{esc(save_sentence(n))}</li>'
            )
        else:
            parts.append(f'<li data-save-peak="" data-node="{esc(n.node)}">{esc(n.save_note)}</li>')
    if not parts:
        parts.append(
            '<li data-save-peak="">No host figures in the records: no '
            "save-step peak, no limit.</li>"
        )
    return (
        f'<div class="budget"><b>Save-step peak against the limit</b> (guide: '
        f"limit = cgroup memory.max x "
        f"RAY_memory_usage_threshold)<ul>{''.join(parts)}</ul></div>"
    )


def render_html(
    records: list[dict[str, Any]],
    *,
    growth: GrowthReport | None = None,
    ray_log: str | None = None,
    title: str = "ckptguard memory report",
) -> str:
    """The whole page as a string; ``records`` sorted by time, as read_records returns them."""
    growth = growth or analyze_growth(records, GrowthConfig())
    story = build_story(records, ray_log=ray_log)
    kill = story.failure
    cls = "verdict ok" if kill.killer is Killer.NONE else "verdict"
    evidence = "".join(f"<li>{esc(e)}</li>" for e in kill.evidence + kill.notes)
    head = (
        f'<div class="{cls}" data-killer="{kill.killer.value}"><b>{esc(story.headline())}</b>'
        f"<ul>{evidence}</ul></div>"
    )
    nodes = sorted({str(r.get("node")) for r in records})
    host = (
        "".join(f"{_host_chart(n, story.t0, story.t1)}{_phase_table(n)}" for n in story.nodes)
        or '<p class="note" data-not-obtained="host">No host figures in the records.</p>'
    )
    return (
        '<!DOCTYPE html><html><head><meta charset="utf-8">'
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
        "style-src 'unsafe-inline'\">"
        f"<title>{esc(title)}</title><style>{CSS}</style></head><body>"
        f"<h1>{esc(title)}</h1><p>{len(records)} records from node(s) {esc(', '.join(nodes))}; "
        f"{growth.steps_seen} steps.</p>{head}{_budget_box(story)}"
        f"<h2>Host memory</h2>{host}"
        f"<h2>Per-process floors and growth</h2>{_floors_chart(growth, story.t0, story.t1)}"
        f"<h2>GPU memory</h2>{_gpu_chart(story, records)}"
        "</body></html>"
    )
