"""Goodput from the proof records: what checkpointing and failures cost a run, per launch and in
total.

Contract. ``goodput(root)`` reads rank 0's proof records (``ROOT/proof``) and splits them into
launches (one process id each, in time order). For each launch:

- time to recover: from the process start (``/proc``, recorded with the restore) to the first
  training step recorded after the restore (``record_step``: the end of that step), split into
  start-up (process start to the restore call), the restore, and the rest up to that first step
  (derived-state rebuild, the first step's own compute);
- the steps lost to the failure before it: the last step the killed launch recorded minus the step
  this one restored (work done again);
- the seconds the loop was held by saves (``blocked_s`` of each save record), the saves skipped
  because a commit was in flight (``busy_skip`` records), the ones replaced in the queue by a newer
  request (``busy_coalesced``, ``OnBusy.COALESCE``), the ones written to the fast tier only
  (``busy_redirect``, ``OnBusy.FAST_TIER``) and the retention time spent off the path.

In total: the wall time (first process start to the last step recorded), the failures (relaunches),
and the ETTR, effective training time ratio: (time training after each recovery, first to last step
of each launch, less the seconds held by saves and less the lost steps at the measured step time) /
wall time. From the mean blocking cost
of a save C and the mean time between failures M (observed: wall time / failures, or declared),
the Young/Daly interval sqrt(2 C M) that maximises goodput, in seconds and in steps; never shorter
than one measured commit (a save requested sooner is skipped). Only the records the root keeps are
read (old records are pruned with their checkpoints); rank 0's view is the loop's.
"""

from __future__ import annotations

import itertools
import math
import os
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .._records.proofreader import ProofRecord, read_records

__all__ = ["Goodput", "Launch", "goodput", "young_daly"]


@dataclass
class Launch:
    """One process (pid) of rank 0, in time order."""

    pid: int
    start: float
    """Wall time the process started (from /proc; else its first record)."""
    end: float
    """Wall time of its last record."""
    restored_step: int | None = None
    """The step its restore loaded (0: a fresh start; None: no restore recorded)."""
    startup_s: float | None = None
    restore_s: float | None = None
    to_first_step_s: float | None = None
    recover_s: float | None = None
    """Process start to the first training step recorded after the restore."""
    first_step: int | None = None
    last_step: int | None = None
    steps: int = 0
    step_s: float | None = None
    """Median seconds per step between its step records."""
    saves: int = 0
    blocked_s: float = 0.0
    commit_s: list[float] = field(default_factory=list)
    skipped_saves: int = 0
    coalesced_saves: int = 0
    redirected_saves: int = 0
    cleanup_s: float = 0.0
    lost_steps: int | None = None
    """Steps the launch before it had recorded past the step this one restored."""
    training_s: float = 0.0
    """From the first step after the restore to its last step."""
    last_step_time: float | None = None
    """Wall time of its last step record (the end of its training)."""


@dataclass
class Goodput:
    root: str
    launches: list[Launch]
    wall_s: float
    failures: int
    recover_s: float
    lost_steps: int
    lost_s: float
    blocked_s: float
    skipped_saves: int
    cleanup_s: float
    ettr: float | None
    step_s: float | None
    save_cost_s: float | None
    """Mean seconds a save held the loop."""
    commit_s: float | None
    """Mean seconds from a save's request to its commit."""
    mtbf_s: float | None
    mtbf_source: str
    interval_s: float | None
    interval_steps: int | None
    coalesced_saves: int = 0
    """Saves replaced in the queue by a newer request (``OnBusy.COALESCE``): never committed."""
    redirected_saves: int = 0
    """Saves of a tiered checkpoint written to the fast tier only (``OnBusy.FAST_TIER``)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def young_daly(cost_s: float, mtbf_s: float) -> float:
    """The first-order optimum checkpoint interval sqrt(2 C M) (Young 1974; Daly 2006)."""
    return math.sqrt(2.0 * cost_s * mtbf_s)


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _launch(pid: int, recs: list[ProofRecord]) -> Launch:
    times = [float(r["time"]) for r in recs if _num(r.get("time")) is not None]
    restore = next((r for r in recs if r["event"] == "restore"), None)
    start = _num(restore.get("process_start")) if restore else None
    out = Launch(pid=pid, start=start if start is not None else min(times), end=max(times))
    steps = [r for r in recs if r["event"] == "step" and isinstance(r.get("step"), int)]
    if restore is not None:
        out.restored_step = int(restore.get("step") or 0)
        end, seconds = _num(restore.get("time")), _num(restore.get("seconds"))
        if end is not None and seconds is not None:
            out.restore_s, out.startup_s = seconds, max(0.0, end - seconds - out.start)
        after = [r for r in steps if float(r["time"]) >= (end or 0.0)]
        if after and end is not None:
            out.to_first_step_s = float(after[0]["time"]) - end
            out.recover_s = float(after[0]["time"]) - out.start
            out.training_s = float(after[-1]["time"]) - float(after[0]["time"])
    elif steps:
        out.training_s = float(steps[-1]["time"]) - float(steps[0]["time"])
    if steps:
        out.last_step_time = max(float(r["time"]) for r in steps)
        out.first_step, out.last_step, out.steps = (
            steps[0]["step"],
            max(r["step"] for r in steps),
            len(steps),
        )
        per = [
            (float(b["time"]) - float(a["time"])) / (b["step"] - a["step"])
            for a, b in itertools.pairwise(steps)
            if b["step"] > a["step"]
        ]
        out.step_s = statistics.median(per) if per else None
    for r in recs:
        if r["event"] == "save":
            out.saves += 1
            out.blocked_s += _num(r.get("blocked_s")) or 0.0
            if _num(r.get("commit_s")) is not None:
                out.commit_s.append(float(r["commit_s"]))
        elif r["event"] == "busy_skip":
            out.skipped_saves += 1
        elif r["event"] == "busy_coalesced":
            out.coalesced_saves += 1
        elif r["event"] == "busy_redirect":
            out.redirected_saves += 1
        elif r["event"] == "cleanup":
            out.cleanup_s += _num(r.get("seconds")) or 0.0
    return out


def launches(records: list[ProofRecord]) -> list[Launch]:
    """Rank 0's records split by process, in the order the processes ran; lost steps filled in."""
    by_pid: dict[int, list[ProofRecord]] = {}
    for r in records:
        by_pid.setdefault(int(r["pid"]), []).append(r)
    out = sorted((_launch(pid, recs) for pid, recs in by_pid.items()), key=lambda x: x.start)
    for before, after in itertools.pairwise(out):
        if before.last_step is not None and after.restored_step is not None:
            after.lost_steps = max(0, before.last_step - after.restored_step)
    return out


def goodput(root: str | os.PathLike[str], *, mtbf_s: float | None = None) -> Goodput:
    """The figures of the module docstring for ``root`` (``mtbf_s``: a declared mean time between
    failures)."""
    root = Path(os.fspath(root))
    records = read_records(root).get(0, [])
    runs = launches(records)
    if not runs:
        return Goodput(
            str(root),
            [],
            0.0,
            0,
            0.0,
            0,
            0.0,
            0.0,
            0,
            0.0,
            None,
            None,
            None,
            None,
            mtbf_s,
            "declared" if mtbf_s else "no records",
            None,
            None,
        )
    # To the end of training (the last step), not to the last record: a final wait for the last
    # commit after the loop is not training time lost to checkpointing's failures.
    ends = [x.last_step_time for x in runs if x.last_step_time is not None]
    wall = (max(ends) if ends else max(x.end for x in runs)) - runs[0].start
    step_times = [x.step_s for x in runs if x.step_s]
    step_s = statistics.median(step_times) if step_times else None
    lost = sum(x.lost_steps or 0 for x in runs)
    lost_s = lost * step_s if step_s else 0.0
    blocked = sum(x.blocked_s for x in runs)
    saves = sum(x.saves for x in runs)
    commits = [c for x in runs for c in x.commit_s]
    training = sum(x.training_s for x in runs)
    failures = len(runs) - 1
    source = (
        "declared"
        if mtbf_s
        else (f"observed: {failures} failure(s) in {wall:.1f} s" if failures else "none")
    )
    mtbf = mtbf_s if mtbf_s else (wall / failures if failures else None)
    cost = blocked / saves if saves else None
    commit = statistics.mean(commits) if commits else None
    interval = None
    if cost is not None and mtbf is not None:
        interval = max(young_daly(cost, mtbf), commit or 0.0)
    return Goodput(
        root=str(root),
        launches=runs,
        wall_s=wall,
        failures=failures,
        recover_s=sum(x.recover_s or 0.0 for x in runs[1:]),
        lost_steps=lost,
        lost_s=lost_s,
        blocked_s=blocked,
        skipped_saves=sum(x.skipped_saves for x in runs),
        cleanup_s=sum(x.cleanup_s for x in runs),
        ettr=max(0.0, training - blocked - lost_s) / wall if wall > 0 else None,
        step_s=step_s,
        save_cost_s=cost,
        commit_s=commit,
        mtbf_s=mtbf,
        mtbf_source=source,
        interval_s=interval,
        interval_steps=max(1, math.ceil(interval / step_s)) if interval and step_s else None,
        coalesced_saves=sum(x.coalesced_saves for x in runs),
        redirected_saves=sum(x.redirected_saves for x in runs),
    )
