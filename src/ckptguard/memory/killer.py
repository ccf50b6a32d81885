"""Who killed it: classify a failure from the memory records (and Ray's log, if given).

Contract: ``classify_failure(records, ray_log=None)`` returns a ``KillVerdict`` naming the
killer and the evidence, each piece of evidence a sentence with the figures it rests on:

* ``CUDA_OOM``: a ``phase_failure`` record whose error is a CUDA allocation failure (the
  requested bytes and the allocator figures are quoted). A retry (num_alloc_retries rising)
  without an exception is memory pressure, not a kill, and is reported as a note only.
* ``RAY``: Ray's log has its kill line, or Ray's figure in the last record before the failure
  was over its threshold.
* ``CGROUP_OOM``: the oom_kill event count rose between two records (cgroup memory.events, v1
  oom_control, or node-wide /proc/vmstat without a cgroup), or the watched command ended by
  SIGKILL while its limit was reached.
* ``UNKNOWN``: the job died (a phase started and never ended, or a nonzero exit) and none of the
  above holds; ``NONE``: every phase that started also ended.

When several hold, the explicit ones win: an exception, then Ray's own log line, then the
oom_kill count, then Ray's figure. The phase in flight and the load-phase peak are reported
with the verdict: loading is a phase like any other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from .ray import parse_ray_kill_lines
from .records import RecordKind

__all__ = ["KillVerdict", "Killer", "classify_failure"]


class Killer(Enum):
    CGROUP_OOM = "cgroup_oom_kill"
    RAY = "ray_memory_monitor"
    CUDA_OOM = "cuda_allocation_failure"
    UNKNOWN = "unknown"
    NONE = "none"


@dataclass
class KillVerdict:
    killer: Killer
    evidence: list[str] = field(default_factory=list)
    also: list[Killer] = field(default_factory=list)
    phase: str | None = None
    step: int | None = None
    last_completed: dict[str, Any] | None = None
    load_peak: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "killer": self.killer.value,
            "evidence": self.evidence,
            "also": [k.value for k in self.also],
            "phase": self.phase,
            "step": self.step,
            "last_completed": self.last_completed,
            "load_peak": self.load_peak,
            "notes": self.notes,
        }


def _gib(n: int | None) -> str:
    return "not obtained" if n is None else f"{n / 2**30:.2f} GiB"


def _in_flight(
    records: list[dict[str, Any]],
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(the failure record, or the last phase_start that never ended) per writer."""
    failure = next(
        (r for r in reversed(records) if r["kind"] == RecordKind.PHASE_FAILURE.value), None
    )
    open_: dict[tuple[Any, Any, Any], dict[str, Any]] = {}
    for r in records:
        key = (r.get("node"), r.get("pid"), r.get("phase"))
        if r["kind"] == RecordKind.PHASE_START.value:
            open_[key] = r
        elif r["kind"] in (RecordKind.PHASE_END.value, RecordKind.PHASE_FAILURE.value):
            open_.pop(key, None)
    dangling = max(open_.values(), key=lambda r: r["mono_ns"]) if open_ else None
    return failure, dangling


def _load_peak(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    for r in reversed(records):
        if r["kind"] == RecordKind.PHASE_END.value and r.get("phase") == "load":
            return {**(r.get("peak") or {}), "step": r.get("step")}
    return None


def _oom_kill_rise(records: list[dict[str, Any]]) -> str | None:
    seen: dict[Any, tuple[int, dict[str, Any]]] = {}
    for r in records:
        host = r.get("host") or {}
        count = host.get("oom_kill")
        if count is None:
            continue
        key = (r.get("node"), host.get("cgroup_dir"))
        if key in seen and count > seen[key][0]:
            before = seen[key][1]
            return (
                f"oom_kill count rose {seen[key][0]} -> {count} on {r.get('node')} (source "
                f"{host.get('source')}, {host.get('cgroup_dir') or 'node-wide'}) between "
                f"{before['kind']} at {before['mono_ns'] / 1e9:.3f}s and {r['kind']} at "
                f"{r['mono_ns'] / 1e9:.3f}s"
            )
        seen[key] = (count, r)
    return None


def classify_failure(records: list[dict[str, Any]], *, ray_log: str | None = None) -> KillVerdict:
    """Classify the failure visible in ``records`` (sorted by time, as read_records returns)."""
    failure, dangling = _in_flight(records)
    watch_end = next(
        (r for r in reversed(records) if r["kind"] == RecordKind.WATCH_END.value), None
    )
    died = (
        failure is not None
        or dangling is not None
        or bool(watch_end and watch_end.get("exit_code"))
    )
    found: list[tuple[Killer, str]] = []
    notes: list[str] = []
    if failure is not None and (
        failure.get("cuda_oom") or "OutOfMemoryError" in failure["error"]["type"]
    ):
        found.append(
            (
                Killer.CUDA_OOM,
                (
                    f"{failure['error']['type']} in phase {failure['phase']!r} (step "
                    f"{failure.get('step')}): requested {_gib(failure.get('requested_bytes'))}, "
                    f"allocated {_gib(failure.get('allocated'))}, reserved "
                    f"{_gib(failure.get('reserved'))}, device free "
                    f"{_gib(failure.get('device_free'))}; failing call "
                    f"{failure['error'].get('failing_call')}"
                ),
            )
        )
    for line in parse_ray_kill_lines(ray_log or ""):
        found.append((Killer.RAY, f"Ray log line {line.line_no}: {line.text}"))
        break
    rise = _oom_kill_rise(records)
    if rise:
        found.append((Killer.CGROUP_OOM, rise))
    before = [r for r in records if (r.get("ray") or {}).get("over_threshold") is not None]
    if before and before[-1]["ray"]["over_threshold"]:
        ray = before[-1]["ray"]
        found.append(
            (
                Killer.RAY,
                (
                    f"Ray's figure {_gib(ray['used'])} was over its threshold "
                    f"{_gib(ray['threshold_bytes'])} in the last {before[-1]['kind']} "
                    f"record ({ray['reported']})"
                ),
            )
        )
    retries = [((r.get("gpu") or {}).get("num_alloc_retries") or 0) for r in records]
    if retries and max(retries) > 0:
        notes.append(
            f"num_alloc_retries reached {max(retries)}: allocator pressure (cache flush and "
            f"retry), not a terminal OOM"
        )
    if watch_end and watch_end.get("signal") == 9 and not found:
        notes.append(
            "the watched command ended by SIGKILL, but no oom_kill rise or Ray line was recorded"
        )
    in_flight = failure or dangling
    verdict = KillVerdict(
        killer=found[0][0] if found else (Killer.UNKNOWN if died else Killer.NONE),
        evidence=[text for _, text in found],
        also=[k for k, _ in found[1:] if k is not found[0][0]],
        phase=in_flight.get("phase") if in_flight else None,
        step=in_flight.get("step") if in_flight else None,
        last_completed=(failure or {}).get("last_completed"),
        load_peak=(failure or {}).get("load_peak") or _load_peak(records),
        notes=notes,
    )
    if verdict.killer is Killer.UNKNOWN:
        verdict.evidence.append(
            "the job died (a phase never ended or the command failed) without an exception record, "
            "an oom_kill rise or a Ray kill line; check dmesg and the scheduler's log"
        )
    return verdict
