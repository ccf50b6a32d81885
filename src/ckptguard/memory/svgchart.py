"""The SVG drawing of the memory report (``report``): a chart's axes and frame, phase bands, peak
bars, limit lines and the save mark, with labels placed so that none overlaps another or is struck
through by a line (the geometry Chromium lays 10-11px labels out with). Strings of SVG only; the
page is ``report``'s."""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

from ._story import (
    NodeStory,
    Span,
    fmt_bytes,
    nice_scale,
    nice_ticks,
    phase_labels,
    time_unit,
)

W, H, L, R, T, B = 940, 360, 64, 16, 44, 36
CHAR_PX = 6.0  # width of one character of the 10-11px labels, to keep labels apart
COLORS = {
    "anon": "#4e79a7",
    "shmem": "#e15759",
    "file": "#76b7b2",
    "allocated": "#59a14f",
    "reserved": "#f28e2b",
}
PALETTE = [
    "#4e79a7",
    "#f28e2b",
    "#e15759",
    "#76b7b2",
    "#59a14f",
    "#edc948",
    "#b07aa1",
    "#ff9da7",
    "#9c755f",
]


def esc(s: Any) -> str:
    return html.escape(str(s), quote=True)


@dataclass
class Axes:
    t0: float
    t1: float
    ymax: float

    def x(self, t: float) -> float:
        span = (self.t1 - self.t0) or 1.0
        return L + (t - self.t0) / span * (W - L - R)

    def y(self, v: float) -> float:
        return H - B - (v / (self.ymax or 1.0)) * (H - T - B)


def scaled(t0: float, t1: float, vmax: float) -> tuple[Axes, str, int, list[float]]:
    unit, div, ticks, top = nice_scale(vmax)
    return Axes(t0, t1, top), unit, div, ticks


def frame(ax: Axes, title: str, unit: str, div: int, ticks: list[float]) -> list[str]:
    out = [
        f'<text x="{L}" y="14" class="title">{esc(title)}</text>',
        f'<rect data-plot-area="" x="{L}" y="{T}" width="{W - L - R}" '
        f'height="{H - T - B}" class="plot-area"/>',
        f'<line x1="{L}" y1="{H - B}" x2="{W - R}" y2="{H - B}" class="axis"/>',
        f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H - B}" class="axis"/>',
    ]
    for v in ticks:
        y = ax.y(v * div)
        out.append(
            f'<line x1="{L}" y1="{y:.1f}" x2="{W - R}" y2="{y:.1f}" class="grid"/>'
            f'<text x="{L - 6}" y="{y + 4:.1f}" class="tick" text-anchor="end">{v:g}</text>'
        )
    tu, tdiv = time_unit(ax.t1 - ax.t0)
    for v in nice_ticks((ax.t1 - ax.t0) / tdiv)[1]:
        x = ax.x(ax.t0 + v * tdiv)
        # The last tick may sit on the right edge: anchor it at its end so it is not cut off.
        anchor = "end" if x > W - R - 20 else "middle"
        out.append(
            f'<text x="{x:.1f}" y="{H - B + 16}" class="tick" '
            f'text-anchor="{anchor}">{v:g} {tu}</text>'
        )
    out.append(f'<text x="{L - 6}" y="{T - 8}" class="tick" text-anchor="end">{unit}</text>')
    return out


def bands(spans: list[Span], ax: Axes) -> list[str]:
    out = []
    for s in spans:
        x0, x1 = ax.x(s.t0), ax.x(s.t1)
        cls = "band fail" if s.died else "band"
        state = "never ended" if s.never_ended else ("failed" if s.failed else "ended")
        out.append(
            f'<g data-phase="{esc(s.phase)}" data-step="{esc(s.step)}" data-state="{state}">'
            f'<rect x="{x0:.1f}" y="{T}" width="{max(1.0, x1 - x0):.1f}" '
            f'height="{H - T - B}" class="{cls}"/>'
            f"<title>{esc(s.phase)} step {esc(s.step)} (pid {esc(s.pid)}): {state}</title></g>"
        )
    for x, text, s in phase_labels(spans, ax.x, CHAR_PX, W - R):
        cls = "phase-label fail" if "died" in text else "phase-label"
        out.append(
            f'<text data-phase-label="{esc(s.phase)}" x="{x:.1f}" y="{T - 6}" '
            f'class="{cls}">{esc(text)}</text>'
        )
    return out


def bar_x(s: Span, ax: Axes) -> tuple[float, float]:
    x0, x1 = ax.x(s.t0), ax.x(s.t1)
    if x1 - x0 < 8:  # a phase shorter than a few pixels still shows its peak
        x0, x1 = (x0 + x1) / 2 - 4, (x0 + x1) / 2 + 4
    return x0, x1


def peak_bars(spans: list[Span], ax: Axes, limit: int | None) -> list[str]:
    out = []
    for s in spans:
        if s.peak is None:
            continue
        (x0, x1), y = bar_x(s, ax), ax.y(s.peak)
        room = f"; headroom {fmt_bytes(limit - s.peak)}" if limit is not None else ""
        out.append(
            f'<g data-peak="{esc(s.phase)}" data-step="{esc(s.step)}" data-bytes="{s.peak}">'
            f'<line x1="{x0:.1f}" y1="{y:.1f}" x2="{x1:.1f}" y2="{y:.1f}" class="peak"/>'
            f"<title>{esc(s.phase)} step {esc(s.step)}: in-phase peak {fmt_bytes(s.peak)} "
            f"({esc(s.peak_source)}){room}</title></g>"
        )
    return out


Box = tuple[float, float, float, float]


LABEL_UP, LABEL_DOWN = (
    10,
    4,
)  # a 11px label's extent above and below its baseline, as Chromium lays it out
# pixels kept free between a label and any line (a limit, a peak bar): a label is never struck
# through
CLEAR = 3
ROW = LABEL_UP + LABEL_DOWN + 1  # one label row


def hline(y: float, x0: float = L, x1: float = W - R) -> Box:
    """A horizontal line as an obstacle, widened by CLEAR on both sides."""
    return (x0, y - CLEAR, x1, y + CLEAR)


def limit_lines(
    n: NodeStory, ax: Axes, arrow_x: float | None, obstacles: list[Box]
) -> tuple[list[str], list[Box]]:
    """The limit lines and their labels; the boxes returned are the labels' and the lines' (for the
    save mark).

    Each label goes above its line, else below it, at the right end, else the left end, else beside
    the save mark's arrow, the first of those where it crosses no line (limits, peak bars) and no
    other label; where none is free it goes above its line at the right end, as before."""
    shown = sorted(
        (lim for lim in n.limits if lim.bytes is not None and lim.bytes <= ax.ymax),
        key=lambda lim: -(lim.bytes or 0),
    )
    above = [lim for lim in n.limits if lim.bytes is not None and lim.bytes > ax.ymax]
    lines = [hline(ax.y(lim.bytes or 0)) for lim in shown]
    out: list[str] = []
    labels: list[Box] = []
    for lim in shown:
        y = ax.y(lim.bytes or 0)
        width = len(lim.label) * CHAR_PX
        xs = [W - R - 6 - width, L + 6] + (
            [arrow_x - 8 - width, arrow_x + 8] if arrow_x is not None else []
        )
        # A label the save mark's arrow runs through is not readable.
        xs = [
            x
            for x in xs
            if x >= L + 2
            and x + width <= W - R - 2
            and (arrow_x is None or x > arrow_x + 6 or x + width < arrow_x - 6)
        ] or xs[:1]
        # Nearest its line first: just above, just below, then a row further out on either side.
        rows = [y - CLEAR - LABEL_DOWN, y + CLEAR + LABEL_UP + 1]
        rows += [r + d for d in (-ROW, ROW) for r in rows[(d > 0) :][:1]]
        spots = [(x, ly) for ly in rows for x in xs]
        x0, ly = next(
            (
                sp
                for sp in spots
                if fits(label_box(sp[0], sp[1], width), [*lines, *obstacles, *labels])
            ),
            (xs[0], max(y - CLEAR - LABEL_DOWN, T + LABEL_UP + 1)),
        )
        labels.append(label_box(x0, ly, width))
        out.append(
            f'<g data-limit="{esc(lim.name)}" data-bytes="{lim.bytes}">'
            f'<line x1="{L}" y1="{y:.1f}" x2="{W - R}" y2="{y:.1f}" class="limit"/>'
            f'<text x="{x0:.1f}" y="{ly:.1f}" class="limit-label">{esc(lim.label)}</text></g>'
        )
    for lim in (
        above
    ):  # no line to sit on: the first free row from the top, clear of the bars and the arrow
        text = f"{lim.label} (above the scale)"
        width = len(text) * CHAR_PX
        rows = [T + CLEAR + LABEL_UP + 1 + ROW * k for k in range(8)]
        spots = [(x, ly) for ly in rows for x in (W - R - 6 - width, L + 6)]
        x0, ly = next(
            (
                sp
                for sp in spots
                if fits(label_box(sp[0], sp[1], width), [*lines, *obstacles, *labels])
            ),
            spots[0],
        )
        labels.append(label_box(x0, ly, width))
        out.append(
            f'<text data-limit="{esc(lim.name)}" data-bytes="{lim.bytes}" x="{x0:.1f}" '
            f'y="{ly:.1f}" class="limit-label">{esc(text)}</text>'
        )
    return out, labels + lines


def label_box(x0: float, baseline: float, width: float) -> Box:
    return (x0, baseline - LABEL_UP, x0 + width, baseline + LABEL_DOWN)


def fits(box: Box, taken: list[Box]) -> bool:
    # CLEAR inside the plot's frame too: its border is a line like any other (it ran through a label
    # at the top)
    return box[1] >= T + CLEAR and box[3] <= H - B - CLEAR and not overlaps(box, taken)


def overlaps(a: Box, boxes: list[Box]) -> bool:
    return any(a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3] for b in boxes)


def save_mark(n: NodeStory, ax: Axes, taken: list[Box]) -> list[str]:
    if n.save is None:
        return []
    s, limit, room = n.save.span, n.save.limit, n.save.headroom
    xa = (ax.x(s.t0) + ax.x(s.t1)) / 2
    yp, yl = ax.y(s.peak or 0), ax.y(min(limit, ax.ymax))
    # Arrowheads as polygons, not <marker> ids that would collide between two nodes' charts.
    tip = 5 if yl < yp else -5
    arrow = (
        f'<line x1="{xa:.1f}" y1="{yp:.1f}" x2="{xa:.1f}" y2="{yl:.1f}" class="headroom"/>'
        f'<polygon points="{xa - 4:.1f},{yl + tip:.1f} '
        f'{xa + 4:.1f},{yl + tip:.1f} {xa:.1f},{yl:.1f}" '
        'class="headroom-head"/>'
    )
    died = ", died in it" if s.died else ""
    room_text = (
        f"headroom {fmt_bytes(room)} to the {fmt_bytes(limit)} limit"
        if room >= 0
        else f"OVER the {fmt_bytes(limit)} limit by {fmt_bytes(-room)}"
    )
    head = f"save peak {fmt_bytes(s.peak)} (step {s.step}{died})"
    # Beside the arrow, clear of the limit labels and inside the plot: one line if it fits
    # somewhere, else two.
    spot = place([f"{head}, {room_text}"], xa, yp, yl, taken) or place(
        [head, room_text], xa, yp, yl, taken
    )
    lines = [f"{head}, {room_text}"] if spot and spot[3] == 1 else [head, room_text]
    wide = max(len(head), len(room_text)) * CHAR_PX
    fallback = (
        "start",
        max(L + 2, min(xa + 8, W - R - 2 - wide)),
        min(max(yp, yl) + 15, H - B - 18),
        2,
    )
    anchor, tx, ty, _ = spot or fallback
    cls = "mark-label over" if room < 0 else "mark-label"
    text = "".join(
        f'<text x="{tx:.1f}" y="{ty + 13 * i:.1f}" text-anchor="{anchor}" '
        f'class="{cls}">{esc(t)}</text>'
        for i, t in enumerate(lines)
    )
    return [
        f'<g data-mark="save-peak" data-step="{esc(s.step)}" data-bytes="{s.peak}" '
        f'data-limit-bytes="{limit}" data-headroom="{room}">{arrow}<circle cx="{xa:.1f}" '
        f'cy="{yp:.1f}" r="4" class="save-dot"/>{text}</g>'
    ]


def place(
    lines: list[str], xa: float, yp: float, yl: float, taken: list[Box]
) -> tuple[str, float, float, int] | None:
    """(anchor, x, first baseline, line count) for a label beside the arrow at ``xa``: between the
    peak and the limit, else under the peak, else above the limit, on the side with more room."""
    width, extra = max(len(t) for t in lines) * CHAR_PX, 13 * (len(lines) - 1)
    top, bottom = min(yp, yl), max(yp, yl)
    rows = [(top + bottom - extra) / 2 + 4] if bottom - top >= 18 + extra else []
    # Under the peak, else above the limit, then a row further out each time (clear of the lines).
    rows += [y for k in range(4) for y in (bottom + 15 + ROW * k, top - 6 - extra - ROW * k)]
    sides = (
        [("end", xa - 8), ("start", xa + 8)]
        if xa > (L + W - R) / 2
        else [("start", xa + 8), ("end", xa - 8)]
    )
    for y in rows:
        for anchor, x in sides:
            x0 = x - width if anchor == "end" else x
            box = (x0, y - LABEL_UP, x0 + width, y + LABEL_DOWN + extra)
            if box[0] >= L + 2 and box[2] <= W - R - 2 and fits(box, taken):
                return anchor, x, y, len(lines)
    return None
