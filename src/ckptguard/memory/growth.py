"""Slow growth: per-process PSS floors, a robust slope, and a rising verdict.

Contract: ``analyze_growth(records, config)`` takes ``sample`` records (``mem watch``) and/or
phase records (each carries the writer's own PSS) and, per process (node, pid):

* floors per step: when phase records carry steps, step k spans from its first record to the
  first record of the next step; the floor is the minimum PSS sampled in that span. In-phase
  peaks swing with offload and say nothing about growth; the floor does.
* floors per interval: the minimum PSS in each window of ``interval_s`` (auto: the span / 20),
  placed at the time of that minimum. With steps, only the stepped span counts (from the first
  step's first record to the last step's last record): start-up and teardown are not growth.
* Theil-Sen slopes (median of pairwise slopes) in bytes/step and bytes/s, each with a
  ``confidence`` interval from Kendall's tau (Sen 1968), as scipy.stats.theilslopes computes it.
* ``rising`` is True when the lower bound of the slope is above the noise floor: per step when
  there are at least ``min_points`` step floors, else per second.

Noise floors (documented defaults, override in ``GrowthConfig``): 256 KiB per step and 4 KiB/s
(about 14 MiB per hour). Below them a rise is not told apart from allocator arena churn and from
shared pages being re-divided when a sibling process starts or exits.

Where a limit is known (Ray's threshold in bytes, from the records), the node's floor slope gives a
time and step at which the node would reach it. That figure is a HINT only: docs/practices.md warns
that OOMs do not follow a short timeline linearly; continue from a verified checkpoint and observe
instead of trusting it.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from statistics import NormalDist
from typing import Any

import numpy as np

from ..errors import ConfigError
from .records import RecordKind

__all__ = [
    "GrowthConfig",
    "GrowthReport",
    "NodeGrowth",
    "ProcessGrowth",
    "Slope",
    "analyze_growth",
    "theil_sen",
]


@dataclass(frozen=True, kw_only=True)
class GrowthConfig:
    """Thresholds of the growth verdict."""

    noise_floor_bytes_per_step: int = 256 << 10
    """A per-step slope whose lower bound stays at or below this is not rising."""
    noise_floor_bytes_per_s: int = 4 << 10
    """A per-second slope whose lower bound stays at or below this is not rising."""
    min_rise_bytes: int = 1 << 20
    """A lower-bound slope that adds up to no more than this over the span judged is not rising:
    a process's PSS moves by tens of KiB as the processes sharing its libraries come and go, which
    over a watch of a few seconds is a steep slope of nothing."""
    confidence: float = 0.95
    """Two-sided confidence of the slope interval."""
    min_points: int = 5
    """Fewest floors for a slope; fewer gives no verdict (rising False, reason says why)."""
    interval_s: float | None = None
    """Window of the per-interval floor; None: the sampled span / 20."""
    skip_s: float = 0.0
    """Ignore each process's first seconds (start-up imports are a rise, not a leak). When phase
    records carry steps, everything before the first step is ignored as well."""

    def __post_init__(self) -> None:
        if not (0.5 < self.confidence < 1.0):
            raise ConfigError(f"GrowthConfig.confidence must be in (0.5, 1), got {self.confidence}")
        if self.min_points < 3:
            raise ConfigError(f"GrowthConfig.min_points must be >= 3, got {self.min_points}")
        if self.interval_s is not None and self.interval_s <= 0:
            raise ConfigError(f"GrowthConfig.interval_s must be > 0 or None, got {self.interval_s}")
        if self.skip_s < 0:
            raise ConfigError(f"GrowthConfig.skip_s must be >= 0 seconds, got {self.skip_s}")
        if (
            min(self.noise_floor_bytes_per_step, self.noise_floor_bytes_per_s, self.min_rise_bytes)
            < 0
        ):
            raise ConfigError("GrowthConfig noise floors and min_rise_bytes must be >= 0 bytes")


@dataclass(frozen=True)
class Slope:
    """A Theil-Sen slope with its confidence interval, in bytes per unit of x."""

    value: float
    low: float
    high: float
    points: int


def theil_sen(x: Iterable[float], y: Iterable[float], confidence: float = 0.95) -> Slope | None:
    """Median pairwise slope and its Sen confidence interval; None with fewer than 2 distinct x."""
    xs, ys = np.asarray(list(x), dtype=float), np.asarray(list(y), dtype=float)
    n = len(xs)
    i, j = np.triu_indices(n, k=1)
    dx = xs[j] - xs[i]
    keep = dx != 0
    if not keep.any():
        return None
    slopes = np.sort((ys[j] - ys[i])[keep] / dx[keep])
    med = float(np.median(slopes))
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    sigma = math.sqrt(n * (n - 1) * (2 * n + 5) / 18.0)
    nt = len(slopes)
    hi_i = min(round((nt + z * sigma) / 2.0), nt - 1)
    lo_i = max(round((nt - z * sigma) / 2.0) - 1, 0)
    return Slope(med, float(slopes[lo_i]), float(slopes[hi_i]), n)


@dataclass
class ProcessGrowth:
    """The growth verdict of one process."""

    node: str | None
    pid: int
    comm: str
    argv0: str
    floors_per_step: list[tuple[int, int]] = field(default_factory=list)
    floors_per_interval: list[tuple[float, int]] = field(default_factory=list)
    per_step: Slope | None = None
    per_second: Slope | None = None
    rising: bool = False
    basis: str = "none"
    reason: str = ""

    @property
    def slope_bytes_per_s(self) -> float | None:
        return self.per_second.value if self.per_second else None

    @property
    def slope_bytes_per_step(self) -> float | None:
        return self.per_step.value if self.per_step else None

    @property
    def last_floor(self) -> int | None:
        if self.floors_per_interval:
            return self.floors_per_interval[-1][1]
        return self.floors_per_step[-1][1] if self.floors_per_step else None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["slope_bytes_per_s"] = self.slope_bytes_per_s
        out["slope_bytes_per_step"] = self.slope_bytes_per_step
        out["last_floor"] = self.last_floor
        return out


@dataclass
class NodeGrowth:
    """The node's floor (Ray's figure) and, as a hint only, when it would reach the limit."""

    per_second: Slope | None = None
    per_step: Slope | None = None
    last_floor: int | None = None
    limit_bytes: int | None = None
    limit_name: str | None = None
    hint_seconds_to_limit: float | None = None
    hint_steps_to_limit: float | None = None
    hint_label: str = (
        "HINT ONLY: a slope from a short timeline does not predict an OOM step (guide, 4)"
    )
    not_obtained: dict[str, str] = field(default_factory=dict)


@dataclass
class GrowthReport:
    processes: list[ProcessGrowth]
    node: NodeGrowth
    steps_seen: int

    def to_json(self) -> dict[str, Any]:
        return {
            "processes": [p.to_json() for p in self.processes],
            "node": asdict(self.node),
            "steps_seen": self.steps_seen,
        }


def _step_starts(records: list[dict[str, Any]]) -> list[tuple[int, int]]:
    starts: dict[int, int] = {}
    for r in records:
        if r.get("kind", "").startswith("phase_") and isinstance(r.get("step"), int):
            starts[r["step"]] = min(starts.get(r["step"], r["mono_ns"]), r["mono_ns"])
    return sorted(((t, s) for s, t in starts.items()))


def _series(
    records: list[dict[str, Any]],
) -> tuple[dict[tuple[Any, int], list[tuple[int, int]]], dict[Any, Any]]:
    series: dict[tuple[Any, int], list[tuple[int, int]]] = {}
    names: dict[tuple[Any, int], tuple[str, str]] = {}
    for r in records:
        procs = r.get("procs") if r["kind"] == RecordKind.SAMPLE.value else [r.get("process")]
        for p in procs or []:
            if not p or p.get("pss") is None:
                continue
            key = (r.get("node"), int(p["pid"]))
            series.setdefault(key, []).append((r["mono_ns"], int(p["pss"])))
            names[key] = (p.get("comm") or "", p.get("argv0") or "")
    return series, names


def _floors_per_step(
    points: list[tuple[int, int]], starts: list[tuple[int, int]]
) -> list[tuple[int, int]]:
    if not starts:
        return []
    times = [t for t, _ in starts]
    floors: dict[int, int] = {}
    for t, v in points:
        # bisect on the list: np.searchsorted would copy the whole list into an array per point.
        idx = bisect.bisect_right(times, t) - 1
        if idx < 0:
            continue  # before the first step: warm-up, not part of any step
        step = starts[idx][1]
        floors[step] = min(floors.get(step, v), v)
    return sorted(floors.items())


def _floors_per_interval(points: list[tuple[int, int]], window_ns: int) -> list[tuple[float, int]]:
    out: list[tuple[float, int]] = []
    if not points:
        return out
    t0 = points[0][0]
    best: dict[int, tuple[int, int]] = {}
    for t, v in points:
        w = (t - t0) // window_ns
        if w not in best or v < best[w][1]:
            best[w] = (t, v)
    return [(t / 1e9, v) for _, (t, v) in sorted(best.items())]


def _window_ns(records: list[dict[str, Any]], config: GrowthConfig) -> int:
    if config.interval_s is not None:
        return max(1, int(config.interval_s * 1e9))
    span = records[-1]["mono_ns"] - records[0]["mono_ns"] if records else 0
    return max(1, span // 20)


def _fit(
    points: list[tuple[float, int]] | list[tuple[int, int]], confidence: float
) -> Slope | None:
    xs, ys = zip(
        *points, strict=True
    )  # x values, y values: callers pass at least min_points (>= 3) points
    return theil_sen(xs, ys, confidence=confidence)


def analyze_growth(
    records: list[dict[str, Any]], config: GrowthConfig | None = None
) -> GrowthReport:
    """Growth verdicts for every process in ``records`` (sorted by time, as read_records
    returns)."""
    cfg = config or GrowthConfig()
    starts = _step_starts(records)
    if starts:
        # Before the first step the job is importing and loading, after the last one it is
        # tearing down: a rise and a fall that are not the steady state being judged.
        last = max(r["mono_ns"] for r in records if isinstance(r.get("step"), int))
        records = [r for r in records if starts[0][0] <= r["mono_ns"] <= last]
    window = _window_ns(records, cfg)
    series, names = _series(records)
    out: list[ProcessGrowth] = []
    for key, pts in sorted(series.items(), key=lambda kv: kv[0][1]):
        if cfg.skip_s and pts:
            pts = [p for p in pts if p[0] >= pts[0][0] + cfg.skip_s * 1e9]
        g = ProcessGrowth(node=key[0], pid=key[1], comm=names[key][0], argv0=names[key][1])
        g.floors_per_step = _floors_per_step(pts, starts)
        g.floors_per_interval = _floors_per_interval(pts, window)
        if len(g.floors_per_step) >= cfg.min_points:
            g.per_step = _fit(g.floors_per_step, cfg.confidence)
        if len(g.floors_per_interval) >= cfg.min_points:
            g.per_second = _fit(g.floors_per_interval, cfg.confidence)
        _verdict(g, cfg)
        out.append(g)
    return GrowthReport(out, _node_growth(records, starts, window, cfg), len(starts))


def _verdict(g: ProcessGrowth, cfg: GrowthConfig) -> None:
    if g.per_step is not None:
        g.basis, slope, floor, unit = (
            "per_step",
            g.per_step,
            cfg.noise_floor_bytes_per_step,
            "B/step",
        )
    elif g.per_second is not None:
        g.basis, slope, floor, unit = "per_second", g.per_second, cfg.noise_floor_bytes_per_s, "B/s"
    else:
        g.reason = f"fewer than {cfg.min_points} floors: no verdict"
        return
    points = g.floors_per_step if g.basis == "per_step" else g.floors_per_interval
    rise = slope.low * (points[-1][0] - points[0][0])  # the least the fit says was added
    g.rising = slope.low > floor and rise > cfg.min_rise_bytes
    cmp = ">" if slope.low > floor else "<="
    g.reason = (
        f"slope {slope.value:.0f} {unit}, lower bound {slope.low:.0f} {cmp} noise floor "
        f"{floor} {unit}"
    )
    if slope.low > floor and not g.rising:
        g.reason += f", but {rise:.0f} B over the span judged <= {cfg.min_rise_bytes} B"


def _node_growth(
    records: list[dict[str, Any]], starts: list[tuple[int, int]], window: int, cfg: GrowthConfig
) -> NodeGrowth:
    node = NodeGrowth()
    pts = [
        (r["mono_ns"], r["ray"]["used"])
        for r in records
        if (r.get("ray") or {}).get("used") is not None
    ]
    limits = [
        r["ray"]["threshold_bytes"] for r in records if (r.get("ray") or {}).get("threshold_bytes")
    ]
    if not pts:
        node.not_obtained["node"] = "no record carries Ray's usage figure"
        return node
    per_interval = _floors_per_interval(pts, window)
    per_step = _floors_per_step(pts, starts)
    node.last_floor = per_interval[-1][1]
    if len(per_interval) >= cfg.min_points:
        node.per_second = _fit(per_interval, cfg.confidence)
    if len(per_step) >= cfg.min_points:
        node.per_step = _fit(per_step, cfg.confidence)
    if not limits:
        node.not_obtained["limit"] = "no record carries a limit (neither memory.max nor MemTotal)"
        return node
    node.limit_bytes, node.limit_name = (
        int(limits[-1]),
        "Ray threshold (memory.max or MemTotal x threshold)",
    )
    room = node.limit_bytes - node.last_floor
    if node.per_second and node.per_second.low > cfg.noise_floor_bytes_per_s:
        node.hint_seconds_to_limit = max(0.0, room / node.per_second.value)
    if node.per_step and node.per_step.low > cfg.noise_floor_bytes_per_step:
        node.hint_steps_to_limit = max(0.0, room / node.per_step.value)
    return node
