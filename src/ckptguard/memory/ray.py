"""Ray's memory monitor, recomputed: its usage figure, its threshold, and its kill log line.

Contract: ``ray_figure(snapshot, config)`` returns both usage figures Ray has been seen to use and
says which one it reports and why:

* ``excluding_page_cache``: current Ray (``memory_monitor_utils.cc``): cgroup ``current -
  active_file - inactive_file`` when the cgroup limit is below MemTotal, else ``MemTotal -
  MemAvailable``. Shmem (pinned CUDA host memory, plasma) counts as used in both.
* ``including_page_cache``: cgroup ``current`` (or ``MemTotal - MemFree``): what the runs behind it
  saw Ray count (older Ray subtracted inactive_file only, and on v2 looked up a v1 key, so the
  page cache stayed in).

The threshold is ``max(total * threshold, total - min_memory_free_bytes)`` over the same total
(the cgroup limit when Ray uses the cgroup, else MemTotal). A figure that cannot be computed is
None with a reason; it is never 0.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from ..errors import ConfigError
from .host import HostSnapshot

__all__ = [
    "RayAccounting",
    "RayConfig",
    "RayFigure",
    "RayKillLine",
    "parse_ray_kill_lines",
    "ray_figure",
]


class RayAccounting(Enum):
    """Which of the two figures the Ray in use reports."""

    EXCLUDES_PAGE_CACHE = "excludes_page_cache"
    """Current Ray: the file LRU is subtracted (cgroup-aware since 2023)."""
    INCLUDES_PAGE_CACHE = "includes_page_cache"
    """Older Ray, and what the runs this tool was built from saw: page cache counted as used."""


@dataclass(frozen=True, kw_only=True)
class RayConfig:
    """Ray's monitor settings (``RAY_memory_usage_threshold``, ``RAY_min_memory_free_bytes``)."""

    threshold: float = 0.95
    """Fraction of the total at which Ray kills a worker; Ray's default is 0.95."""
    min_memory_free_bytes: int | None = None
    """Ray's ``min_memory_free_bytes``; None (Ray's -1) disables that rule."""
    accounting: RayAccounting = RayAccounting.EXCLUDES_PAGE_CACHE
    """Which figure to report as Ray's; both are always computed."""

    def __post_init__(self) -> None:
        if not (0.0 < self.threshold <= 1.0):
            raise ConfigError(f"RayConfig.threshold must be in (0, 1], got {self.threshold}")
        if self.min_memory_free_bytes is not None and self.min_memory_free_bytes < 0:
            raise ConfigError(
                "RayConfig.min_memory_free_bytes must be >= 0 or None (Ray's -1 means None)"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> RayConfig:
        """Read the two RAY_ variables the way Ray does; a malformed value raises, naming it."""
        env = os.environ if environ is None else environ
        kwargs: dict[str, Any] = {}
        raw = env.get("RAY_memory_usage_threshold")
        if raw is not None:
            try:
                kwargs["threshold"] = float(raw)
            except ValueError:
                raise ConfigError(f"RAY_memory_usage_threshold={raw!r} is not a number") from None
        raw = env.get("RAY_min_memory_free_bytes")
        if raw is not None:
            try:
                value = int(raw)
            except ValueError:
                raise ConfigError(f"RAY_min_memory_free_bytes={raw!r} is not an integer") from None
            kwargs["min_memory_free_bytes"] = value if value >= 0 else None
        kwargs.update(overrides)
        return cls(**kwargs)


@dataclass(frozen=True, kw_only=True)
class RayFigure:
    """Ray's view of one host snapshot."""

    excluding_page_cache: int | None
    including_page_cache: int | None
    total: int | None
    threshold_bytes: int | None
    reported: RayAccounting
    uses_cgroup: bool
    why: str
    not_obtained: dict[str, str]

    @property
    def used(self) -> int | None:
        if self.reported is RayAccounting.EXCLUDES_PAGE_CACHE:
            return self.excluding_page_cache
        return self.including_page_cache

    @property
    def over_threshold(self) -> bool | None:
        if self.used is None or self.threshold_bytes is None:
            return None
        return self.used > self.threshold_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "excluding_page_cache": self.excluding_page_cache,
            "including_page_cache": self.including_page_cache,
            "used": self.used,
            "total": self.total,
            "threshold_bytes": self.threshold_bytes,
            "reported": self.reported.value,
            "uses_cgroup": self.uses_cgroup,
            "over_threshold": self.over_threshold,
            "why": self.why,
            "not_obtained": dict(self.not_obtained),
        }


def ray_figure(snap: HostSnapshot, config: RayConfig | None = None) -> RayFigure:
    """Recompute Ray's usage figure and threshold from a host snapshot."""
    cfg = config or RayConfig()
    missing: dict[str, str] = {}
    # Ray uses cgroup numbers only when the cgroup limit is below MemTotal ("cgroup total bytes
    # will look different than system"); an unlimited cgroup falls back to /proc/meminfo.
    uses_cgroup = (
        snap.source.value != "none"
        and snap.limit is not None
        and (snap.mem_total is None or snap.limit < snap.mem_total)
    )
    if uses_cgroup:
        total = snap.limit
        excl = (
            snap.current - snap.reclaimable
            if snap.current is not None and snap.reclaimable is not None
            else None
        )
        if excl is None:
            missing["excluding_page_cache"] = (
                "cgroup current or active_file/inactive_file not obtained"
            )
        incl = snap.current
    else:
        total = snap.mem_total
        if snap.mem_total is not None and snap.mem_available is not None:
            excl = snap.mem_total - snap.mem_available
        else:
            excl = None
            missing["excluding_page_cache"] = "MemTotal or MemAvailable not obtained"
        incl = (
            snap.mem_total - snap.mem_free
            if snap.mem_total is not None and snap.mem_free is not None
            else None
        )
        if incl is None:
            missing["including_page_cache"] = "MemTotal or MemFree not obtained"
    if total is None:
        missing["threshold_bytes"] = "neither a cgroup limit nor MemTotal was obtained"
        threshold = None
    else:
        threshold = math.floor(total * cfg.threshold)
        if cfg.min_memory_free_bytes is not None:
            threshold = max(threshold, total - cfg.min_memory_free_bytes)
    where = (
        "cgroup (limit below MemTotal)"
        if uses_cgroup
        else "/proc/meminfo (no cgroup limit below MemTotal)"
    )
    if cfg.accounting is RayAccounting.EXCLUDES_PAGE_CACHE:
        why = (
            f"reported as current Ray computes it from {where}: page cache (file LRU) excluded, "
            "shmem counted"
        )
    else:
        why = f"reported with page cache counted, as older Ray did, from {where}"
    return RayFigure(
        excluding_page_cache=excl,
        including_page_cache=incl,
        total=total,
        threshold_bytes=threshold,
        reported=cfg.accounting,
        uses_cgroup=uses_cgroup,
        why=why,
        not_obtained=missing,
    )


_N = r"\d+(?:\.\d+)?"
_KILL_PATTERNS = (
    re.compile(
        rf"was (?P<used>{_N})GB / (?P<total>{_N})GB \((?P<frac>{_N})\), which exceeds the memory "
        rf"usage threshold of (?P<thr>{_N})"
    ),
    re.compile(r"exceeded threshold of (?P<thr_bytes>\d+)B \((?P<pct>\d+(?:\.\d+)?)%"),
    re.compile(r"killed due to (?:the node running low on memory|memory pressure \(OOM\))"),
    re.compile(r"NODE_OUT_OF_MEMORY"),
)


@dataclass(frozen=True)
class RayKillLine:
    """One line of a Ray log that records an OOM kill, with the figures it states."""

    line_no: int
    text: str
    used_fraction: float | None = None
    threshold: float | None = None


def parse_ray_kill_lines(text: str) -> list[RayKillLine]:
    """Every line of ``text`` in which Ray's memory monitor announces a kill."""
    found: list[RayKillLine] = []
    for no, line in enumerate(text.splitlines(), start=1):
        for pat in _KILL_PATTERNS:
            m = pat.search(line)
            if not m:
                continue
            groups = m.groupdict()
            frac = float(groups["frac"]) if groups.get("frac") else None
            thr = float(groups["thr"]) if groups.get("thr") else None
            if groups.get("pct"):
                thr = float(groups["pct"]) / 100.0
            found.append(RayKillLine(no, line.strip()[:500], frac, thr))
            break
    return found
