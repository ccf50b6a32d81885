"""Capacity plan: the save-step peak as the sum of what is alive together, against the limit.

Contract (guide, Memory budget 4)::

    peak  = pinned optimizer offload, after power-of-two rounding per pinned block
          + D2H staging of the save (rounded too when pinned)
          + page cache of the newly written checkpoint files
          + serving backup (vLLM level-1 sleep keeps a pinned copy of the weights per rank)
          + the other processes' floors
    limit = (memory.max, else MemTotal) x Ray threshold

``compute_plan(inputs)`` returns every term with its bytes and whether it was measured or
estimated, the peak, the limit (with where its parts came from), the headroom and a ``Verdict``.
Inputs come from a PLAN.toml (``load_plan_toml``: estimates, every size written as an int of
bytes or a string such as "1.1 GiB") or from phase records (``plan_from_records``: measured at
the end of the last save phase, from cgroup memory.stat: shmem (pinned memory is shmem), the
page cache the save added, and anon, which holds the other processes' floors; and the peak
sampled during that save).

With both, the measured terms are summed and each TOML estimate is kept beside the measured term
whose memory.stat class holds it (pinned blocks: shmem; pageable or exact-size blocks and other
processes' floors: anon; page cache: page cache), shown but not summed, so nothing is counted
twice; a note says where the estimates exceed the measurement (something they list may not
have been alive in the recorded save). A class the records could not measure is summed from the
TOML. The limit's parts are labelled by source: memory.max / MemTotal and the Ray threshold
that the TOML's [limit] gives are "configured"; the rest come from the records ("measured").
"""

from __future__ import annotations

import dataclasses
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

__all__ = [
    "Plan",
    "PlanInputs",
    "PlanTerm",
    "Verdict",
    "compute_plan",
    "load_plan_toml",
    "parse_bytes",
    "plan_from_records",
]

_UNITS = {
    "": 1,
    "b": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}


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


SHMEM, PAGE_CACHE, ANON = "shmem", "page cache", "anon"


@dataclass(frozen=True)
class PlanTerm:
    name: str
    bytes: int
    measured: bool
    detail: str
    lands_in: str | None = None
    """The memory.stat class these bytes are charged to (shmem, page cache, anon), where known."""
    covered_by: str | None = None
    """The measured term that already holds these bytes: the term is shown, not summed."""


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
    """memory.max / MemTotal were read from phase records (True) or written in a PLAN.toml."""
    tight_fraction: float = 0.10
    """Headroom below this fraction of the limit is TIGHT."""
    sampled_peak: int | None = None
    """The peak sampled during a recorded save phase, if any (measured)."""
    limit_source: str = "configured in PLAN.toml"
    """Where memory.max / MemTotal came from, as the plan prints it."""
    threshold_source: str = "default"
    """Where the Ray threshold came from: "default" (0.95), PLAN.toml, the records or the
    cluster."""
    notes: tuple[str, ...] = ()
    """Findings of assembling the inputs, printed with the plan."""

    def __post_init__(self) -> None:
        if not (0.0 < self.ray_threshold <= 1.0):
            raise ConfigError(
                f"PlanInputs.ray_threshold must be in (0, 1], got {self.ray_threshold}"
            )
        if not (0.0 <= self.tight_fraction < 1.0):
            raise ConfigError(
                f"PlanInputs.tight_fraction must be in [0, 1), got {self.tight_fraction}"
            )


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
    limit_source: str = "configured in PLAN.toml"
    threshold_source: str = "default"

    def to_json(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["terms"] = [t.__dict__ for t in self.terms]
        out["verdict"] = self.verdict.value if self.verdict else None
        return out


def compute_plan(inputs: PlanInputs) -> Plan:
    """Sum the terms and compare with the limit."""
    peak = sum(t.bytes for t in inputs.terms if t.covered_by is None)
    notes: list[str] = list(inputs.notes)
    if inputs.sampled_peak is not None and inputs.sampled_peak > peak:
        notes.append(
            f"the sampled save-phase peak ({inputs.sampled_peak} B) exceeds the "
            f"sum of terms; it is used"
        )
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
    return Plan(
        list(inputs.terms),
        peak,
        base,
        name,
        limit,
        headroom,
        verdict,
        inputs.ray_threshold,
        inputs.limit_measured,
        inputs.sampled_peak,
        notes,
        limit_source=inputs.limit_source,
        threshold_source=inputs.threshold_source,
    )


def _section_term(doc: dict[str, Any], key: str, label: str) -> PlanTerm | None:
    sec = doc.get(key)
    if sec is None:
        return None
    where = f"[{key}]"
    ranks = sec.get("ranks", 1)
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise ConfigError(f"{where} ranks must be a positive int, got {ranks!r}")
    measured = bool(sec.get("measured", False))
    pinned = bool(sec.get("pinned", True)) and not bool(sec.get("exact", False))
    # Pinned blocks from the caching host allocator are shmem in memory.stat; pageable ones and
    # exact-size pinning (cudaHostRegister on a pageable buffer) stay anon.
    lands_in = PAGE_CACHE if key == "page_cache" else (SHMEM if pinned else ANON)
    if "block_bytes" in sec:
        blocks = [
            parse_bytes(b, f"{where} block_bytes[{i}]") for i, b in enumerate(sec["block_bytes"])
        ]
    elif "bytes_per_rank" in sec:
        blocks = [parse_bytes(sec["bytes_per_rank"], f"{where} bytes_per_rank")]
    elif "bytes" in sec:
        return PlanTerm(
            label, parse_bytes(sec["bytes"], f"{where} bytes"), measured, "as given", lands_in
        )
    else:
        raise ConfigError(f"{where} needs block_bytes, bytes_per_rank or bytes")
    per_rank = sum(pow2_ceil(b) if pinned else b for b in blocks)
    nominal = sum(blocks)
    how = (
        "power-of-two rounded per pinned block"
        if pinned
        else "exact size (pageable or pinned_empty)"
    )
    detail = f"{ranks} rank(s) x {per_rank} B ({how}; nominal {nominal} B per rank)"
    return PlanTerm(label, ranks * per_rank, measured, detail, lands_in)


def load_plan_toml(path: Path) -> PlanInputs:
    """Read a PLAN.toml (see tests/fixtures/memory/plan.toml for every field)."""
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"plan file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML ({exc})") from None
    terms = [
        t
        for t in (
            _section_term(doc, "pinned_optimizer", "pinned optimizer offload"),
            _section_term(doc, "staging", "D2H staging"),
            _section_term(doc, "page_cache", "page cache of new checkpoint files"),
            _section_term(doc, "serving_backup", "serving backup (sleep level 1)"),
        )
        if t is not None
    ]
    for i, proc in enumerate(doc.get("other_processes", [])):
        name = proc.get("name", f"process {i}")
        terms.append(
            PlanTerm(
                f"floor: {name}",
                parse_bytes(proc.get("floor"), f"[[other_processes]] {name} floor"),
                bool(proc.get("measured", False)),
                "other process floor",
                ANON,
            )
        )
    lim = doc.get("limit", {})
    mm = lim.get("memory_max")
    marked = bool(lim.get("measured", False))
    return PlanInputs(
        terms=tuple(terms),
        memory_max=parse_bytes(mm, "[limit] memory_max") if mm is not None else None,
        mem_total=parse_bytes(lim["mem_total"], "[limit] mem_total")
        if "mem_total" in lim
        else None,
        ray_threshold=float(lim.get("ray_threshold", 0.95)),
        limit_measured=marked,
        tight_fraction=float(lim.get("tight_fraction", 0.10)),
        limit_source=f"configured in {path.name}" + (", marked measured there" if marked else ""),
        threshold_source=f"configured in {path.name}" if "ray_threshold" in lim else "default",
    )


def plan_from_records(records: list[dict[str, Any]], base: PlanInputs | None = None) -> PlanInputs:
    """Measured inputs from the last recorded save phase (and the limit of the last host figure);
    with ``base`` (a PLAN.toml), its estimates and limit joined as the module docstring says."""
    hosts = [r["host"] for r in records if r.get("host")]
    if not hosts:
        raise ConfigError(
            "the records carry no host figures; record phases with PhaseRecorder or run mem watch"
        )
    last = hosts[-1]
    thr = next(
        (
            r["ray"]["threshold_bytes"] / r["ray"]["total"]
            for r in reversed(records)
            if (r.get("ray") or {}).get("threshold_bytes") and r["ray"].get("total")
        ),
        None,
    )
    recorded = {
        "memory_max": last.get("limit") if last.get("source") != "none" else None,
        "mem_total": last.get("mem_total"),
    }
    ends = [
        r for r in records if r["kind"] == RecordKind.PHASE_END.value and r.get("phase") == "save"
    ]
    if base is None and not ends:
        raise ConfigError(
            "the records hold no completed save phase; record one with rec.phase('save', ...)"
        )
    terms, missing = _measured_terms(records, ends[-1]) if ends else ([], {})
    notes: list[str] = []
    sampled = (ends[-1].get("peak") or {}).get("host_current") if ends else None
    if base is None:
        if missing:
            name, why = next(iter(missing.items()))
            raise ConfigError(
                f"plan from records: {name} was not obtained ({why}); use a PLAN.toml for it"
            )
        return PlanInputs(
            terms=tuple(terms),
            sampled_peak=sampled,
            **recorded,
            limit_measured=True,
            ray_threshold=round(thr or 0.95, 4),
            limit_source="measured in the records",
            threshold_source="from the records" if thr else "default",
        )
    if not ends:
        notes.append(
            "the records hold no completed save phase: no measured term, "
            "PLAN.toml's estimates are summed"
        )
    by_class = {t.lands_in: t for t in terms}
    joined = list(terms)
    for t in base.terms:
        m = by_class.get(t.lands_in)
        joined.append(dataclasses.replace(t, covered_by=m.name) if m is not None else t)
    for cls, m in by_class.items():
        est = sum(t.bytes for t in base.terms if t.lands_in == cls)
        if est > m.bytes:
            notes.append(
                f"PLAN.toml estimates {_gib(est)} in {cls}, the records measured "
                f"{_gib(m.bytes)} at the end of save step {ends[-1].get('step')}: was all it "
                f"lists alive in the recorded save?"
            )
    for name, why in missing.items():
        notes.append(f"{name} was not measured ({why}): PLAN.toml's estimate is summed instead")
    configured = base.memory_max is not None or base.mem_total is not None
    limit = {"memory_max": base.memory_max, "mem_total": base.mem_total} if configured else recorded
    toml_thr = base.threshold_source != "default"
    return PlanInputs(
        terms=tuple(joined),
        **limit,
        tight_fraction=base.tight_fraction,
        sampled_peak=sampled,
        limit_measured=base.limit_measured if configured else True,
        limit_source=base.limit_source if configured else "measured in the records",
        ray_threshold=base.ray_threshold if toml_thr or thr is None else round(thr, 4),
        threshold_source=base.threshold_source if toml_thr or thr is None else "from the records",
        notes=tuple(notes),
    )


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB"


def _measured_terms(
    records: list[dict[str, Any]], end: dict[str, Any]
) -> tuple[list[PlanTerm], dict[str, str]]:
    """The measured terms at the end of save phase ``end``, and the ones that could not be read."""
    start = next(
        (
            r
            for r in reversed(records)
            if r["kind"] == RecordKind.PHASE_START.value
            and r.get("phase") == "save"
            and r.get("pid") == end.get("pid")
            and r["mono_ns"] <= end["mono_ns"]
        ),
        None,
    )
    h_end = end.get("host") or {}
    terms: list[PlanTerm] = []
    missing: dict[str, str] = {}

    def add(name: str, value: int | None, detail: str, lands_in: str) -> None:
        if value is None:
            missing[name] = detail
        else:
            terms.append(PlanTerm(name, int(value), True, detail, lands_in))

    add(
        "pinned and shared memory (shmem)",
        h_end.get("shmem"),
        "memory.stat shmem at the end of save: pinned optimizer, staging kept in the "
        "pinned cache, serving backup",
        SHMEM,
    )
    rec_end, rec_start = h_end.get("reclaimable"), (start or {}).get("host", {}).get("reclaimable")
    new_cache = (
        max(0, rec_end - rec_start) if rec_end is not None and rec_start is not None else None
    )
    add(
        "page cache of new checkpoint files",
        new_cache,
        "active_file + inactive_file, save end minus save start",
        PAGE_CACHE,
    )
    add(
        "anonymous memory (other processes' floors, pageable staging)",
        h_end.get("anon"),
        "memory.stat anon at the end of save",
        ANON,
    )
    return terms, missing
