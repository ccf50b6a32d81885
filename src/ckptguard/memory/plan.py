"""Capacity plan: the save-step peak as the sum of what is alive together, against the limit.

Contract (guide, Memory budget 4)::

    peak  = pinned optimizer offload, after power-of-two rounding per pinned block
          + D2H staging of the save (rounded too when pinned)
          + page cache of the newly written checkpoint files
          + serving backup (vLLM level-1 sleep keeps a pinned copy of the weights per rank)
          + the other processes' floors
    limit = (memory.max, else MemTotal) x Ray threshold

``compute_plan(inputs)`` returns every term with its bytes and whether it was measured or
estimated, the peak, the limit, the headroom and a ``Verdict``. Inputs come from a PLAN.toml
(``load_plan_toml``: estimates, every size written as an int of bytes or a string such as
"1.1 GiB") or from phase records (``plan_from_records``: measured at the end of the last save
phase, from cgroup memory.stat: shmem (pinned memory is shmem), the page cache the save added,
and anon, which holds the other processes' floors). With both, the TOML's terms are used and the
limit is taken from the records where the TOML leaves it out.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .pinned import pow2_ceil
from .records import RecordKind

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["Plan", "PlanInputs", "PlanTerm", "Verdict", "compute_plan", "load_plan_toml", "parse_bytes",
           "plan_from_records"]

_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_bytes(value: Any, where: str) -> int:
    """An int of bytes, or a string "<number> <unit>" (KiB/MiB/GiB/TiB, KB/MB/GB/TB)."""
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected bytes, got a boolean")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{where}: bytes must be >= 0, got {value}")
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([\d.]+)\s*([A-Za-z]*)\s*", value)
        if m and m[2].lower() in _UNITS:
            return round(float(m[1]) * _UNITS[m[2].lower()])
    raise ConfigError(f"{where}: {value!r} is not a byte size (write 123456789 or '1.5 GiB')")


class Verdict(Enum):
    FITS = "fits"
    TIGHT = "tight"
    EXCEEDS = "exceeds"


@dataclass(frozen=True)
class PlanTerm:
    name: str
    bytes: int
    measured: bool
    detail: str


@dataclass(frozen=True, kw_only=True)
class PlanInputs:
    """What the plan sums, and what it compares with."""

    terms: tuple[PlanTerm, ...]
    memory_max: int | None = None
    """cgroup memory.max in bytes; None when unlimited or unknown (MemTotal is used)."""
    mem_total: int | None = None
    """MemTotal in bytes."""
    ray_threshold: float = 0.95
    """RAY_memory_usage_threshold."""
    limit_measured: bool = False
    tight_fraction: float = 0.10
    """Headroom below this fraction of the limit is TIGHT."""
    sampled_peak: int | None = None
    """The peak sampled during a recorded save phase, if any (measured)."""

    def __post_init__(self) -> None:
        if not (0.0 < self.ray_threshold <= 1.0):
            raise ConfigError(f"PlanInputs.ray_threshold must be in (0, 1], got {self.ray_threshold}")
        if not (0.0 <= self.tight_fraction < 1.0):
            raise ConfigError(f"PlanInputs.tight_fraction must be in [0, 1), got {self.tight_fraction}")


@dataclass
class Plan:
    terms: list[PlanTerm]
    peak: int
    limit_base: int | None
    limit_base_name: str
    limit: int | None
    headroom: int | None
    verdict: Verdict | None
    ray_threshold: float
    limit_measured: bool
    sampled_peak: int | None = None
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["terms"] = [t.__dict__ for t in self.terms]
        out["verdict"] = self.verdict.value if self.verdict else None
        return out


def compute_plan(inputs: PlanInputs) -> Plan:
    """Sum the terms and compare with the limit."""
    peak = sum(t.bytes for t in inputs.terms)
    notes: list[str] = []
    if inputs.sampled_peak is not None and inputs.sampled_peak > peak:
        notes.append(f"the sampled save-phase peak ({inputs.sampled_peak} B) exceeds the sum of terms; it is used")
        peak = inputs.sampled_peak
    if inputs.memory_max is not None:
        base, name = inputs.memory_max, "memory.max"
    elif inputs.mem_total is not None:
        base, name = inputs.mem_total, "MemTotal"
    else:
        base, name = None, "not obtained"
        notes.append("no limit: neither memory.max nor MemTotal was given or recorded; no verdict")
    limit = int(base * inputs.ray_threshold) if base is not None else None
    headroom = limit - peak if limit is not None else None
    verdict = None
    if limit is not None and headroom is not None:
        if headroom < 0:
            verdict = Verdict.EXCEEDS
        elif headroom < inputs.tight_fraction * limit:
            verdict = Verdict.TIGHT
        else:
            verdict = Verdict.FITS
    return Plan(list(inputs.terms), peak, base, name, limit, headroom, verdict, inputs.ray_threshold,
                inputs.limit_measured, inputs.sampled_peak, notes)


def _section_term(doc: dict[str, Any], key: str, label: str) -> PlanTerm | None:
    sec = doc.get(key)
    if sec is None:
        return None
    where = f"[{key}]"
    ranks = sec.get("ranks", 1)
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise ConfigError(f"{where} ranks must be a positive int, got {ranks!r}")
    measured = bool(sec.get("measured", False))
    if "block_bytes" in sec:
        blocks = [parse_bytes(b, f"{where} block_bytes[{i}]") for i, b in enumerate(sec["block_bytes"])]
    elif "bytes_per_rank" in sec:
        blocks = [parse_bytes(sec["bytes_per_rank"], f"{where} bytes_per_rank")]
    elif "bytes" in sec:
        return PlanTerm(label, parse_bytes(sec["bytes"], f"{where} bytes"), measured, "as given")
    else:
        raise ConfigError(f"{where} needs block_bytes, bytes_per_rank or bytes")
    pinned = bool(sec.get("pinned", True)) and not bool(sec.get("exact", False))
    per_rank = sum(pow2_ceil(b) if pinned else b for b in blocks)
    nominal = sum(blocks)
    how = "power-of-two rounded per pinned block" if pinned else "exact size (pageable or pinned_empty)"
    detail = f"{ranks} rank(s) x {per_rank} B ({how}; nominal {nominal} B per rank)"
    return PlanTerm(label, ranks * per_rank, measured, detail)


def load_plan_toml(path: Path) -> PlanInputs:
    """Read a PLAN.toml (see tests/fixtures/memory/plan.toml for every field)."""
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"plan file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML ({exc})") from None
    terms = [t for t in (
        _section_term(doc, "pinned_optimizer", "pinned optimizer offload"),
        _section_term(doc, "staging", "D2H staging"),
        _section_term(doc, "page_cache", "page cache of new checkpoint files"),
        _section_term(doc, "serving_backup", "serving backup (sleep level 1)"),
    ) if t is not None]
    for i, proc in enumerate(doc.get("other_processes", [])):
        name = proc.get("name", f"process {i}")
        terms.append(PlanTerm(f"floor: {name}", parse_bytes(proc.get("floor"), f"[[other_processes]] {name} floor"),
                              bool(proc.get("measured", False)), "other process floor"))
    lim = doc.get("limit", {})
    mm = lim.get("memory_max")
    return PlanInputs(
        terms=tuple(terms),
        memory_max=parse_bytes(mm, "[limit] memory_max") if mm is not None else None,
        mem_total=parse_bytes(lim["mem_total"], "[limit] mem_total") if "mem_total" in lim else None,
        ray_threshold=float(lim.get("ray_threshold", 0.95)),
        limit_measured=bool(lim.get("measured", False)),
        tight_fraction=float(lim.get("tight_fraction", 0.10)),
    )


def plan_from_records(records: list[dict[str, Any]], base: PlanInputs | None = None) -> PlanInputs:
    """Measured inputs from the last recorded save phase (and the limit of the last host figure)."""
    ends = [r for r in records if r["kind"] == RecordKind.PHASE_END.value and r.get("phase") == "save"]
    hosts = [r["host"] for r in records if r.get("host")]
    if not hosts:
        raise ConfigError("the records carry no host figures; record phases with PhaseRecorder or run mem watch")
    last = hosts[-1]
    thr = next((r["ray"]["threshold_bytes"] / r["ray"]["total"] for r in reversed(records)
                if (r.get("ray") or {}).get("threshold_bytes") and r["ray"].get("total")), 0.95)
    limit_kw: dict[str, Any] = {
        "memory_max": last.get("limit") if last.get("source") != "none" else None,
        "mem_total": last.get("mem_total"),
        "ray_threshold": round(thr, 4),
        "limit_measured": True,
    }
    if base is not None:
        keep = {k: v for k, v in (("memory_max", base.memory_max), ("mem_total", base.mem_total)) if v is not None}
        return PlanInputs(terms=base.terms, **{**limit_kw, **keep}, tight_fraction=base.tight_fraction,
                          sampled_peak=None)
    if not ends:
        raise ConfigError("the records hold no completed save phase; record one with rec.phase('save', ...)")
    end = ends[-1]
    start = next((r for r in reversed(records) if r["kind"] == RecordKind.PHASE_START.value and
                  r.get("phase") == "save" and r.get("pid") == end.get("pid") and r["mono_ns"] <= end["mono_ns"]), None)
    h_end = end["host"]
    terms: list[PlanTerm] = []

    def add(name: str, value: int | None, detail: str) -> None:
        if value is None:
            raise ConfigError(f"plan from records: {name} was not obtained ({detail}); use a PLAN.toml for it")
        terms.append(PlanTerm(name, int(value), True, detail))

    add("pinned and shared memory (shmem)", h_end.get("shmem"),
        "memory.stat shmem at the end of save: pinned optimizer, staging kept in the pinned cache, serving backup")
    rec_end, rec_start = h_end.get("reclaimable"), (start or {}).get("host", {}).get("reclaimable")
    new_cache = max(0, rec_end - rec_start) if rec_end is not None and rec_start is not None else None
    add("page cache of new checkpoint files", new_cache, "active_file + inactive_file, save end minus save start")
    add("anonymous memory (other processes' floors, pageable staging)", h_end.get("anon"),
        "memory.stat anon at the end of save")
    return PlanInputs(terms=tuple(terms), sampled_peak=(end.get("peak") or {}).get("host_current"), **limit_kw)
