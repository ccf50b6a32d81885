"""``mem report --png``: the report's story as one PNG (needs matplotlib, an optional extra).

Contract: ``render_png(records, out)`` draws what the HTML page shows (both come from
``_story.build_story``): a header with the failure verdict and, per node, the save step's peak
with its headroom to the limit (memory.max x Ray threshold); per node a host chart stacked by
anon / shmem / file without shmem, with the current figure, phase bands named above the plot,
each phase's in-phase sampled peak drawn across its band, the limit lines labelled inside the
plot and the save peak marked with an arrow to the limit; then per-process PSS floors with their
verdict and GPU allocated / reserved, each only when the records hold such figures (a chart
with nothing in it is left out, and the header says so). The same sentences go into the PNG's
``Description`` text chunk. ``build_figure`` returns the matplotlib figure without saving it.
matplotlib is imported here only, with the Agg backend, so the HTML report and the rest of the
package never need it.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ._story import (
    NodeStory,
    Story,
    build_story,
    fmt_bytes,
    gpu_series,
    nice_scale,
    phase_labels,
    time_unit,
)
from .growth import analyze_growth

__all__ = ["build_figure", "render_png"]

COLORS = {
    "anon": "#4e79a7",
    "shmem": "#e15759",
    "file": "#76b7b2",
    "allocated": "#59a14f",
    "reserved": "#f28e2b",
}
WIDTH_IN, DPI = 11.0, 90
LABEL_PT = 8


def _pyplot() -> Any:
    try:
        import matplotlib  # optional: the report extra

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # optional: the report extra
    except ImportError:
        raise ConfigError(
            "--png needs matplotlib: pip install 'ckptguard[report]' (or use --html)"
        ) from None
    return plt


def _header(ax: Any, story: Story, lines: list[str], title: str) -> None:
    ax.axis("off")
    died = story.failure.killer.value != "none"
    ax.text(0, 1, title, transform=ax.transAxes, va="top", fontsize=12, fontweight="bold")
    y = 1 - 0.9 / len(lines)
    for i, line in enumerate(lines):
        color = ("#c00" if died else "#270") if i == 0 else "#222"
        ax.text(
            0,
            y,
            line,
            transform=ax.transAxes,
            va="top",
            fontsize=9,
            color=color,
            fontweight="bold" if i == 0 else "normal",
        )
        y -= 1 / len(lines)


def _header_lines(story: Story, notes: list[str]) -> list[str]:
    out = [story.headline()]
    out += [textwrap.shorten(e, 150) for e in story.failure.evidence[:1]]
    for sentence in story.summary_lines()[:-1]:  # the last one is the headline, already first
        out += textwrap.wrap(sentence, 140)
    return out + notes


def _host_axes(ax: Any, n: NodeStory, story: Story, axes_px: tuple[float, float]) -> None:
    tu, tdiv = time_unit(story.t1 - story.t0)

    def tx(t: float) -> float:
        return (t - story.t0) / tdiv

    top = max(
        [sum(v.values()) for _, v in n.stack]
        + [v for _, v in n.current]
        + [s.peak for s in n.spans if s.peak is not None]
        + [1]
    )
    near = [lim.bytes for lim in n.limits if lim.bytes is not None and lim.bytes <= 4 * top]
    unit, div, _, ymax = nice_scale(max([top, *near]) * 1.04)
    _bands(ax, n.spans, tx)
    if n.stack:
        ts = [tx(t) for t, _ in n.stack]
        ax.stackplot(
            ts,
            *[[v[k] / div for _, v in n.stack] for k in ("anon", "shmem", "file")],
            labels=["anon", "shmem", "file (no shmem)"],
            colors=[COLORS[k] for k in ("anon", "shmem", "file")],
            alpha=0.7,
        )
    if n.current:
        ax.plot(
            [tx(t) for t, _ in n.current],
            [v / div for _, v in n.current],
            color="#222",
            lw=1,
            label=f"{n.current_name} at each record",
        )
    span_s = (story.t1 - story.t0) or 1.0
    width_px = axes_px[0]
    min_w = 8 / width_px * span_s / tdiv
    bars = []
    for s in n.spans:
        if s.peak is None:
            continue
        a, b = tx(s.t0), tx(s.t1)
        if b - a < min_w:  # a phase a few pixels wide still shows its peak
            a, b = (a + b - min_w) / 2, (a + b + min_w) / 2
        bars.append((s.peak / div, a, b))
    if bars:  # one collection: a long run has thousands of phases
        ax.hlines(*zip(*bars, strict=True), color="#111", lw=2.5, label="in-phase sampled peak")
    # Phase names in a strip above the plot, the same ones the page shows.
    for x, text, _ in phase_labels(
        n.spans, lambda t: (t - story.t0) / span_s * width_px, LABEL_PT * 0.62, width_px
    ):
        ax.text(
            x / width_px,
            1.01,
            text,
            transform=ax.transAxes,
            fontsize=LABEL_PT,
            va="bottom",
            color="#c00" if "died" in text else "#333",
            fontweight="bold" if "died" in text else "normal",
        )
    arrow = None if n.save is None else ((n.save.span.t0 + n.save.span.t1) / 2 - story.t0) / span_s
    _limit_lines(ax, n, ymax, div, axes_px, arrow)
    _save_mark(ax, n, tx, div, ymax, axes_px, arrow or 0.0)
    ax.set_xlim(0, tx(story.t1) or 1)
    ax.set_ylim(0, ymax / div)
    ax.set_title(f"Host memory on {n.node}", pad=16, fontsize=11, loc="left")
    ax.set(xlabel=f"{tu} since the first record", ylabel=unit)
    ax.legend(loc="upper left", bbox_to_anchor=(0, -0.13), ncol=6, fontsize=8, frameon=False)


def _bands(ax: Any, spans: list[Any], tx: Any) -> None:
    """Phase bands as two collections (ended, died): one axvspan per phase takes minutes for a long
    run."""
    for died, color, alpha in ((False, "#999", 0.12), (True, "#e15759", 0.22)):
        ranges = [(tx(s.t0), tx(s.t1) - tx(s.t0)) for s in spans if s.died is died]
        if ranges:
            ax.broken_barh(
                ranges, (0, 1), transform=ax.get_xaxis_transform(), color=color, alpha=alpha, lw=0
            )


def _limit_lines(
    ax: Any, n: NodeStory, ymax: float, div: int, axes_px: tuple[float, float], arrow: float | None
) -> None:
    levels = sorted(
        ((lim.bytes, lim) for lim in n.limits if lim.bytes is not None and lim.bytes <= ymax),
        key=lambda bl: -bl[0],
    )
    prev = None
    for i, (nbytes, lim) in enumerate(levels):
        ax.axhline(nbytes / div, color="#c00", ls="--", lw=1.2, label="limit" if i == 0 else None)
        y_px = nbytes / ymax * axes_px[1]
        # A label that the line above would strike through goes below its own line.
        below = prev is not None and prev - y_px < 15
        # At the right end, else the left end, else just left of the save mark's arrow: a label
        # the arrow runs through is not readable (the same rule as the page).
        w = (
            len(lim.label) * LABEL_PT * 0.7 / axes_px[0]
        )  # DejaVu Sans: ~0.6 em a character, with margin
        starts = [0.995 - w, 0.005] + ([arrow - 0.01 - w] if arrow is not None else [])
        x0 = next(
            (x for x in starts if arrow is None or x > arrow + 0.008 or x + w < arrow - 0.008),
            starts[0],
        )
        ax.annotate(
            lim.label,
            xy=(x0, nbytes / div),
            xycoords=("axes fraction", "data"),
            xytext=(0, -11 if below else 3),
            textcoords="offset points",
            ha="left",
            fontsize=LABEL_PT,
            color="#c00",
        )
        prev = y_px
    for i, lim in enumerate(lm for lm in n.limits if lm.bytes is not None and lm.bytes > ymax):
        ax.text(
            0.995,
            0.97 - 0.06 * i,
            f"{lim.label} (above the scale)",
            transform=ax.transAxes,
            ha="right",
            va="top",
            fontsize=LABEL_PT,
            color="#c00",
        )


def _save_mark(
    ax: Any,
    n: NodeStory,
    tx: Any,
    div: int,
    ymax: float,
    axes_px: tuple[float, float],
    arrow: float,
) -> None:
    if n.save is None:
        return
    s, limit, room = n.save.span, n.save.limit, n.save.headroom
    xm, peak = (tx(s.t0) + tx(s.t1)) / 2, (s.peak or 0) / div
    ax.annotate(
        "",
        xy=(xm, min(limit, ymax) / div),
        xytext=(xm, peak),
        arrowprops={"arrowstyle": "-|>", "color": "#111", "lw": 1.3, "shrinkA": 4, "shrinkB": 0},
    )
    ax.plot([xm], [peak], "o", mfc="white", mec="#111", mew=2, ms=7)
    died = ", died in it" if s.died else ""
    room_text = (
        f"headroom {fmt_bytes(room)} to the {fmt_bytes(limit)} limit"
        if room >= 0
        else f"OVER the {fmt_bytes(limit)} limit by {fmt_bytes(-room)}"
    )
    head = f"save peak {fmt_bytes(s.peak)} (step {s.step}{died})"
    # The side of the arrow with room for the label: one line if it fits there, else two.
    char_px = (LABEL_PT + 1) * 0.66  # bold
    room_px = {"left": arrow * axes_px[0] - 14, "right": (1 - arrow) * axes_px[0] - 14}
    one = f"{head}, {room_text}"
    side = next(
        (k for k in sorted(room_px, key=lambda k: -room_px[k]) if room_px[k] >= len(one) * char_px),
        None,
    )
    text = one if side else f"{head}\n{room_text}"
    side = side or max(room_px, key=lambda k: room_px[k])
    lines = text.count("\n") + 1
    gap_px = abs(limit - (s.peak or 0)) / ymax * axes_px[1]
    mid = (peak + limit / div) / 2
    y, dy = (mid, 0) if gap_px >= 6 + 13 * lines else (min(peak, limit / div), -8 - 7 * lines)
    ax.annotate(
        text,
        xy=(xm, y),
        xytext=(-8 if side == "left" else 8, dy),
        textcoords="offset points",
        ha="right" if side == "left" else "left",
        va="center",
        fontsize=LABEL_PT + 1,
        fontweight="bold",
        color="#c00" if room < 0 else "#111",
        bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.85},
    )


def _floors_axes(ax: Any, growth: Any, story: Story) -> None:
    tu, tdiv = time_unit(story.t1 - story.t0)
    procs = [p for p in growth.processes if p.floors_per_interval]
    top = max(v for p in procs for _, v in p.floors_per_interval)
    unit, div, _, ymax = nice_scale(top * 1.08)
    for p in procs:
        ax.plot(
            [(t - story.t0) / tdiv for t, _ in p.floors_per_interval],
            [v / div for _, v in p.floors_per_interval],
            label=f"{p.pid} {p.comm} ({'RISING' if p.rising else 'flat'})",
            lw=2,
            marker="o" if len(p.floors_per_interval) == 1 else None,
        )  # one floor: a dot, not an empty line
    ax.set_xlim(0, (story.t1 - story.t0) / tdiv or 1)
    ax.set_ylim(0, ymax / div)
    ax.set_title("Per-process PSS floor", fontsize=11, loc="left")
    ax.set(xlabel=f"{tu} since the first record", ylabel=unit)
    ax.legend(loc="upper left", fontsize=8)


def _gpu_axes(ax: Any, series: dict[str, list[tuple[float, int]]], story: Story) -> None:
    tu, tdiv = time_unit(story.t1 - story.t0)
    top = max(v for s in series.values() for _, v in s)
    unit, div, _, ymax = nice_scale(top * 1.08)
    _bands(ax, story.nodes[0].spans if story.nodes else [], lambda t: (t - story.t0) / tdiv)
    for name, pts in series.items():
        if pts:
            ax.plot(
                [(t - story.t0) / tdiv for t, _ in pts],
                [v / div for _, v in pts],
                label=name,
                color=COLORS[name],
                lw=2,
            )
    ax.set_xlim(0, (story.t1 - story.t0) / tdiv or 1)
    ax.set_ylim(0, ymax / div)
    ax.set_title("GPU memory (this process's caching allocator)", fontsize=11, loc="left")
    ax.set(xlabel=f"{tu} since the first record", ylabel=unit)
    ax.legend(loc="upper left", fontsize=8)


def build_figure(
    records: list[dict[str, Any]],
    *,
    ray_log: str | None = None,
    title: str = "ckptguard memory report",
) -> Any:
    """The matplotlib figure of ``render_png``; ``records`` sorted by time, as read_records returns
    them."""
    return _build(records, ray_log, title)[0]


def _build(records: list[dict[str, Any]], ray_log: str | None, title: str) -> tuple[Any, str]:
    plt = _pyplot()
    story = build_story(records, ray_log=ray_log)
    growth = analyze_growth(records)
    has_floors = any(len(p.floors_per_interval) >= 2 for p in growth.processes)
    one_floor = not has_floors and any(p.floors_per_interval for p in growth.processes)
    series, reasons = gpu_series(records)
    has_gpu = any(series.values())
    notes = []
    if not story.nodes:
        notes.append("No host chart: no record carries host figures.")
    if one_floor:
        notes.append(
            "No per-process floor chart: the records give each process one PSS floor only (one "
            "interval), no line to draw."
        )
    elif not has_floors:
        notes.append(
            "No per-process floor chart: no PSS readings in the records (run "
            "the job under mem watch)."
        )
    if not has_gpu:
        why = "; ".join(sorted(reasons)) or "no record carries GPU figures"
        notes.append(f"No GPU chart: GPU figures not obtained ({why}).")
    lines = _header_lines(story, notes)
    rows = [("header", 0.3 + 0.19 * len(lines))] + [("host", 4.6)] * len(story.nodes)
    rows += [("floors", 3.2)] * has_floors + [("gpu", 3.2)] * has_gpu
    fig = plt.figure(figsize=(WIDTH_IN, sum(h for _, h in rows)), dpi=DPI, layout="constrained")
    axes = fig.subplots(
        len(rows), 1, gridspec_kw={"height_ratios": [h for _, h in rows]}, squeeze=False
    )[:, 0]
    _header(axes[0], story, lines, title)
    i = 1
    for n in story.nodes:
        # Pixel size of the plot area, to keep labels apart (constrained layout takes ~85% x 70%).
        _host_axes(axes[i], n, story, (WIDTH_IN * DPI * 0.86, 4.6 * DPI * 0.68))
        i += 1
    if has_floors:
        _floors_axes(axes[i], growth, story)
        i += 1
    if has_gpu:
        _gpu_axes(axes[i], series, story)
    return fig, "\n".join([*story.summary_lines(), *notes])


def render_png(
    records: list[dict[str, Any]],
    out: str | os.PathLike[str],
    *,
    ray_log: str | None = None,
    title: str = "ckptguard memory report",
) -> None:
    out = Path(out)
    plt = _pyplot()
    fig, description = _build(records, ray_log, title)
    try:
        fig.savefig(out, dpi=DPI, metadata={"Title": title, "Description": description})
    finally:
        plt.close(fig)
