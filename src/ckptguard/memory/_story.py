"""What the memory report says, computed once for the HTML page and the PNG (``report``,
``figure``).

Contract: ``build_story(records, ray_log)`` returns, per node, the host series (anon / shmem / file
without shmem, and the current figure the sampler polls), every phase as a span with its in-phase
peak, the limit lines, the budget limit of docs/practices.md (memory.max x Ray threshold) and the
save step's peak with its headroom to that limit; and, for the whole job, the failure verdict. Both
renderers draw exactly this, so the PNG tells the same story as the page.

The in-phase peak of a span is the maximum of the recorder's sampled peak (``peak.host_current``
of the end or failure record: boundary readings and every sample between them) and of any other
record of the same node and cgroup inside the span (``mem watch`` samples, nested boundaries).
A phase the process died in has no end record; its peak then comes from those other records
only, or is said to be not recorded. The time of a sampled peak inside a phase is not recorded,
so a peak is drawn across its phase, never as a point at a guessed time.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any

from .killer import KillVerdict, classify_failure
from .records import RecordKind

GiB, MiB = 1 << 30, 1 << 20

_CURRENT_NAME = {
    "v2": "memory.current",
    "v1": "memory.usage_in_bytes",
    "none": "MemTotal - MemFree",
}


def fmt_bytes(n: float | None) -> str:
    """Readable size: GiB from 1 GiB up, MiB below (a 600 MiB spike is not '0.59 GiB')."""
    if n is None:
        return "not obtained"
    if abs(n) >= GiB:
        return f"{n / GiB:,.2f} GiB"
    return f"{n / MiB:,.0f} MiB"


@dataclass
class Span:
    """One phase of one process, start to end (or to the last record when it never ended)."""

    node: str
    pid: Any
    rank: Any
    phase: str
    step: Any
    t0: float
    t1: float
    start_current: int | None
    end_current: int | None
    peak: int | None
    peak_source: str
    samples: int | None
    failed: bool = False
    never_ended: bool = False
    gpu_peak_allocated: int | None = None
    gpu_peak_reserved: int | None = None

    @property
    def died(self) -> bool:
        return self.failed or self.never_ended


@dataclass(frozen=True)
class LimitLine:
    """A horizontal line of the host chart; ``bytes`` None: not obtained, ``why`` says why."""

    name: str
    bytes: int | None
    label: str
    why: str = ""


@dataclass(frozen=True)
class Budget:
    """The limit the save-step peak is budgeted against, and how it was derived."""

    bytes: int | None
    derivation: str


@dataclass(frozen=True)
class SaveMark:
    span: Span
    limit: int
    headroom: int

    @property
    def headroom_fraction(self) -> float:
        return self.headroom / self.limit if self.limit else 0.0


@dataclass
class NodeStory:
    node: str
    current_name: str
    stack: list[tuple[float, dict[str, int]]]
    current: list[tuple[float, int]]
    spans: list[Span]
    limits: list[LimitLine]
    budget: Budget
    save: SaveMark | None
    save_note: str | None
    memory_peak: int | None


@dataclass
class Story:
    t0: float
    t1: float
    nodes: list[NodeStory]
    failure: KillVerdict

    def headline(self) -> str:
        k = self.failure
        if k.killer.value == "none":
            return "Failure: none (every phase that started also ended)"
        where = f" in phase {k.phase!r} (step {k.step})" if k.phase else ""
        return f"Failure: {k.killer.value}{where}"

    def summary_lines(self) -> list[str]:
        """The sentences both renderers print: one per node's save step, then the failure."""
        out = []
        for n in self.nodes:
            if n.save is not None:
                out.append(save_sentence(n))
            elif n.save_note:
                out.append(n.save_note)
        out.append(self.headline())
        return out


def save_sentence(n: NodeStory) -> str:
    assert n.save is not None
    s, lim = n.save.span, n.save.limit
    room = n.save.headroom
    room_text = (
        f"headroom {fmt_bytes(room)} ({n.save.headroom_fraction:.0%} of the limit)"
        if room >= 0
        else f"OVER the limit by {fmt_bytes(-room)}"
    )
    return (
        f"Save step {s.step} on {n.node}: peak {fmt_bytes(s.peak)} of {n.current_name} "
        f"({s.peak_source}); limit {fmt_bytes(lim)} = {n.budget.derivation}; {room_text}."
    )


def _t(r: dict[str, Any]) -> float:
    return float(r["mono_ns"]) / 1e9


_Readings = dict[tuple[str, Any], tuple[list[float], list[int]]]


def _readings(records: list[dict[str, Any]]) -> _Readings:
    """Every current reading per (node, cgroup), in time order, for range lookups by bisection."""
    out: _Readings = {}
    for r in records:
        h = r.get("host") or {}
        if h.get("current") is not None:
            ts, vs = out.setdefault((str(r.get("node")), h.get("cgroup_dir")), ([], []))
            ts.append(_t(r))
            vs.append(int(h["current"]))
    return out


def _spans(records: list[dict[str, Any]], t_end: float) -> list[Span]:
    spans: list[Span] = []
    readings = _readings(records)
    # A stack per (node, pid, phase): a phase may nest in another of the same name.
    open_: dict[tuple[str, Any, Any], list[dict[str, Any]]] = {}
    for r in records:
        key = (str(r.get("node")), r.get("pid"), r.get("phase"))
        if r["kind"] == RecordKind.PHASE_START.value:
            open_.setdefault(key, []).append(r)
        elif r["kind"] in (
            RecordKind.PHASE_END.value,
            RecordKind.PHASE_FAILURE.value,
        ) and open_.get(key):
            spans.append(_span(open_[key].pop(), r, readings, t_end))
    for stack in open_.values():
        spans.extend(
            _span(start, None, readings, _death_bound(start, records, t_end)) for start in stack
        )
    spans.sort(key=lambda s: (s.t0, s.t1))
    return spans


def _death_bound(start: dict[str, Any], records: list[dict[str, Any]], t_end: float) -> float:
    """When a phase that never ended was over at the latest: the same rank relaunched (a phase
    start by another PID), or the watched command ended; else the last record."""
    node, t0 = str(start.get("node")), _t(start)
    for r in records:
        if _t(r) <= t0 or str(r.get("node")) != node:
            continue
        relaunch = (
            r["kind"] == RecordKind.PHASE_START.value
            and r.get("rank") == start.get("rank")
            and r.get("pid") != start.get("pid")
        )
        if relaunch or r["kind"] == RecordKind.WATCH_END.value:
            return _t(r)
    return t_end


def _span(
    start: dict[str, Any], end: dict[str, Any] | None, readings: _Readings, t_end: float
) -> Span:
    node, host0 = str(start.get("node")), start.get("host") or {}
    t0, t1 = _t(start), (_t(end) if end is not None else t_end)
    peak_rec = (end or {}).get("peak") or {}
    peak, samples = peak_rec.get("host_current"), peak_rec.get("samples")
    source = f"{samples} samples in {t1 - t0:.2f} s" if peak is not None else ""
    # Other readings of the same cgroup inside the span (mem watch ticks, nested boundaries):
    # they are samples of this phase too, and the only ones left when the process died in it.
    ts, vs = readings.get((node, host0.get("cgroup_dir")), ([], []))
    inside = vs[bisect.bisect_left(ts, t0) : bisect.bisect_right(ts, t1)]
    if inside and (peak is None or max(inside) > peak):
        if peak is None:
            source = (
                f"highest of {len(inside)} readings inside the phase (its start and mem watch "
                "samples)"
            )
        else:
            source += "; other records inside it read higher"
        peak = max(inside)
    if peak is None:
        source = "not recorded: the process died in the phase and no sample fell inside it"
    return Span(
        node=node,
        pid=start.get("pid"),
        rank=start.get("rank"),
        phase=str(start.get("phase")),
        step=start.get("step"),
        t0=t0,
        t1=t1,
        start_current=host0.get("current"),
        end_current=((end or {}).get("host") or {}).get("current"),
        peak=peak,
        peak_source=source,
        samples=samples,
        failed=bool(end is not None and end["kind"] == RecordKind.PHASE_FAILURE.value),
        never_ended=end is None,
        gpu_peak_allocated=peak_rec.get("gpu_allocated"),
        gpu_peak_reserved=peak_rec.get("gpu_reserved"),
    )


def _limits(records: list[dict[str, Any]]) -> tuple[list[LimitLine], Budget]:
    last_h: dict[str, Any] = next((r["host"] for r in reversed(records) if r.get("host")), {}) or {}
    last_ray: dict[str, Any] = next((r["ray"] for r in reversed(records) if r.get("ray")), {}) or {}
    cgroup = last_h.get("source") not in (None, "none")
    mm = last_h.get("limit") if cgroup else None
    lines = [
        LimitLine(
            "memory.max",
            mm,
            f"memory.max {fmt_bytes(mm)}",
            ""
            if mm is not None
            else (last_h.get("not_obtained") or {}).get("limit", "no cgroup limit"),
        )
    ]
    thr, total = last_ray.get("threshold_bytes"), last_ray.get("total")
    base_name = "memory.max" if last_ray.get("uses_cgroup") else "MemTotal"
    frac = f"{thr / total:.3g}" if thr and total else None
    derivation = f"{base_name} {fmt_bytes(total)} x Ray threshold {frac}" if frac else ""
    label = f"Ray threshold {fmt_bytes(thr)} = {base_name} x {frac}" if thr else ""
    lines.append(
        LimitLine("ray-threshold", thr, label, "" if thr else "no Ray figure in the records")
    )
    if mm is None:
        mt = last_h.get("mem_total")
        lines.append(
            LimitLine(
                "MemTotal", mt, f"MemTotal {fmt_bytes(mt)}", "" if mt else "meminfo unreadable"
            )
        )
    # The budget (docs/practices.md, memory budget): limit = cgroup memory.max x
    # RAY_memory_usage_threshold; Ray kills first, so its threshold is the line the save peak must
    # stay under.
    if thr:
        budget = Budget(int(thr), derivation)
    elif mm is not None:
        budget = Budget(int(mm), "memory.max (no Ray figure in the records)")
    elif last_h.get("mem_total"):
        budget = Budget(int(last_h["mem_total"]), "MemTotal (no cgroup limit, no Ray figure)")
    else:
        budget = Budget(None, "not obtained: no memory.max, Ray figure or MemTotal in the records")
    return lines, budget


def _node_story(node: str, records: list[dict[str, Any]], spans: list[Span]) -> NodeStory:
    stack, current = [], []
    for r in records:
        h = r.get("host") or {}
        if h.get("anon") is not None:
            shmem = h.get("shmem") or 0
            # memory.stat counts shmem inside file: stacking file whole would count pinned memory
            # twice.
            stack.append(
                (
                    _t(r),
                    {
                        "anon": h["anon"],
                        "shmem": shmem,
                        "file": max(0, (h.get("file") or 0) - shmem),
                    },
                )
            )
        if h.get("current") is not None:
            current.append((_t(r), int(h["current"])))
    last_h: dict[str, Any] = next((r["host"] for r in reversed(records) if r.get("host")), {}) or {}
    limits, budget = _limits(records)
    saves = [s for s in spans if s.phase == "save"]
    measured = [s for s in saves if s.peak is not None]
    mark, note = None, None
    if measured and budget.bytes is not None:
        # The save step closest to the limit is the one the plan has to survive.
        top = max(measured, key=lambda s: (s.peak or 0, s.t0))  # of equal peaks, the latest
        mark = SaveMark(top, budget.bytes, budget.bytes - int(top.peak or 0))
    elif measured:
        note = (
            f"Save-step peak on {node}: {fmt_bytes(max(s.peak or 0 for s in measured))}; "
            "no limit was recorded"
        )
    elif saves:
        note = f"Save step {saves[-1].step} on {node}: {saves[-1].peak_source}"
    else:
        note = f"No save phase recorded on {node}: the save-step peak is not known"
    return NodeStory(
        node=node,
        current_name=_CURRENT_NAME.get(str(last_h.get("source")), "current"),
        stack=stack,
        current=current,
        spans=spans,
        limits=limits,
        budget=budget,
        save=mark,
        save_note=note,
        memory_peak=last_h.get("peak"),
    )


def build_story(records: list[dict[str, Any]], *, ray_log: str | None = None) -> Story:
    """The report's content; ``records`` sorted by time, as read_records returns them."""
    t0 = _t(records[0]) if records else 0.0
    t1 = _t(records[-1]) if records else 1.0
    spans = _spans(records, t1)
    nodes = []
    for node in sorted({str(r.get("node")) for r in records if r.get("host")}):
        mine = [r for r in records if str(r.get("node")) == node]
        nodes.append(_node_story(node, mine, [s for s in spans if s.node == node]))
    return Story(t0=t0, t1=t1, nodes=nodes, failure=classify_failure(records, ray_log=ray_log))


def gpu_series(
    records: list[dict[str, Any]],
) -> tuple[dict[str, list[tuple[float, int]]], set[str]]:
    """Allocated and reserved over time (boundary figures and in-phase peaks), and why any are
    missing."""
    series: dict[str, list[tuple[float, int]]] = {"allocated": [], "reserved": []}
    reasons = set()
    for r in records:
        g = r.get("gpu")
        if g:
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
    return series, reasons


def nice_ticks(vmax: float, target: int = 5) -> tuple[float, list[float]]:
    """A 1/2/2.5/5 x 10^k step giving about ``target`` ticks in [0, vmax], and the ticks."""
    raw = max(vmax, 1e-12) / target
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw * 0.999)
    return step, [i * step for i in range(int(vmax / step + 1e-9) + 1)]


def nice_scale(vmax: float) -> tuple[str, int, list[float], float]:
    """(unit, bytes per unit, tick values in units, axis top in bytes); the top is ``vmax``
    itself."""
    unit, div = ("GiB", GiB) if vmax >= 2 * GiB else ("MiB", MiB)
    return unit, div, nice_ticks(vmax / div)[1], vmax


def time_unit(span_s: float) -> tuple[str, float]:
    """Axis unit for seconds since the first record: s, min or h."""
    if span_s > 7200:
        return "h", 3600.0
    if span_s > 120:
        return "min", 60.0
    return "s", 1.0


def phase_labels(
    spans: list[Span], x: Any, char_px: float, x_max: float, gap_px: float = 6.0
) -> list[tuple[float, str, Span]]:
    """Phase names that fit side by side: (x, text, first span). A run of same-named phases too
    close to label one by one gets one label with a count ("update x6"). Where labels would
    overlap, a phase the process died in wins, then a save, then the earlier one; a label left
    out keeps its name in the band's tooltip and in the phase table."""
    groups: list[list[Span]] = []
    for s in sorted(spans, key=lambda s: s.t0):
        run = groups and groups[-1][0].phase == s.phase
        if run and x(s.t0) < x(groups[-1][-1].t0) + len(s.phase) * char_px + gap_px:
            groups[-1].append(s)
        else:
            groups.append([s])
    labelled = []
    for g in groups:
        died = any(s.died for s in g)
        text = g[0].phase + (f" x{len(g)}" if len(g) > 1 else "") + (" (died here)" if died else "")
        # A phase that starts near the right end is labelled ending at the edge, not past it.
        x0 = min(x(g[0].t0), x_max - len(text) * char_px)
        labelled.append((0 if died else 1 if g[0].phase == "save" else 2, x0, text, g[0]))
    placed: list[tuple[float, str, Span]] = []
    for _, x0, text, first in sorted(labelled, key=lambda item: (item[0], item[1])):
        x1 = x0 + len(text) * char_px
        if all(x1 + gap_px <= p[0] or p[0] + len(p[1]) * char_px + gap_px <= x0 for p in placed):
            placed.append((x0, text, first))
    return sorted(placed, key=lambda p: p[0])


def spread_labels(ys: list[float], min_gap: float, lo: float, hi: float) -> list[float]:
    """Move label positions (top to bottom, y grows downward) apart by at least ``min_gap`` within
    [lo, hi]."""
    order = sorted(range(len(ys)), key=lambda i: ys[i])
    out = list(ys)
    prev = -math.inf
    for i in order:
        out[i] = max(min(out[i], hi), lo, prev + min_gap)
        prev = out[i]
    # Pushed past the bottom: shift the whole run back up.
    over = (prev - hi) if order else 0
    if over > 0:
        for i in order:
            out[i] = max(lo, out[i] - over)
    return out
