"""Which restore ``ckptguard prove`` judges: the resumes of a root, numbered, and each rank's record
of one.

Contract: every launch of a job appends one ``restore`` record per rank (step 0 for a fresh start).
The launches are the restore records of the lowest rank that has any, in time order; a resume is a
launch that restored a non-zero step, numbered from 1. A rank's record of a launch is its restore
record nearest in time to the launch's, when that launch is also the one nearest to it (a rank the
launch did not have, after a world-size change, has none). ``pick`` chooses the default: the newest
resume with evidence (a step record after the restore, or an ``exit`` record of a process that
trained nothing), and says why when it passed over newer ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._records.proofreader import ProofRecord, shown_pid

Records = dict[int, list[ProofRecord]]


@dataclass(frozen=True)
class Resume:
    number: int  # 1-based, in time order
    step: int
    time: float
    pid: int
    world_size: int | None

    def describe(self) -> str:
        return f"resume {self.number} (step {self.step}, pid {shown_pid(self.pid)})"


def _restores(recs: list[ProofRecord]) -> list[int]:
    return [
        i
        for i, r in enumerate(recs)
        if r["event"] == "restore" and isinstance(r.get("time"), (int, float))
    ]


def _lead(records: Records) -> int | None:
    return next((rank for rank, recs in sorted(records.items()) if _restores(recs)), None)


def launch_times(records: Records) -> list[float]:
    lead = _lead(records)
    return (
        []
        if lead is None
        else sorted(float(records[lead][i]["time"]) for i in _restores(records[lead]))
    )


def resumes(records: Records) -> list[Resume]:
    """Every launch that restored a non-zero step, oldest first."""
    lead = _lead(records)
    if lead is None:
        return []
    rows = sorted(
        (records[lead][i] for i in _restores(records[lead])), key=lambda r: float(r["time"])
    )
    out: list[Resume] = []
    for r in rows:
        step = r.get("step")
        if isinstance(step, int) and step > 0:
            world = r.get("world_size")
            out.append(
                Resume(
                    len(out) + 1,
                    step,
                    float(r["time"]),
                    int(r["pid"]),
                    world if isinstance(world, int) else None,
                )
            )
    return out


def _nearest(times: list[float], t: float) -> float:
    return min(times, key=lambda x: abs(x - t))


def record_of(recs: list[ProofRecord], launch: float, times: list[float]) -> int | None:
    """The index of this rank's restore record of the launch at ``launch`` (None: it took no
    part)."""
    mine = _restores(recs)
    if not mine:
        return None
    best = min(mine, key=lambda i: abs(float(recs[i]["time"]) - launch))
    return best if _nearest(times, float(recs[best]["time"])) == launch else None


def evidence(records: Records, resume: Resume, times: list[float]) -> bool:
    """Whether a resume left anything to judge: a step or update after the restore, or an exit that
    trained nothing."""
    for recs in records.values():
        idx = record_of(recs, resume.time, times)
        if idx is None:
            continue
        pid = recs[idx]["pid"]
        for r in recs[idx + 1 :]:
            if r["pid"] == pid and (
                r["event"] in ("step", "update")
                or (r["event"] == "exit" and not r.get("trained") and _left(r))
            ):
                return True
    return False


def _left(exit_record: ProofRecord) -> bool:
    total, step = exit_record.get("total_steps"), exit_record.get("step")
    return not (isinstance(total, int) and isinstance(step, int) and step >= total)


def pick(records: Records, number: int | None) -> tuple[Resume | None, str]:
    """The resume to judge (``number``, else the newest with evidence) and a line saying which and
    why."""
    found = resumes(records)
    if not found:
        return None, "no restore of a non-zero step recorded"
    if number is not None:
        if not 1 <= number <= len(found):
            raise ValueError(
                f"--resume {number}: the records hold resumes 1-{len(found)} "
                f"({', '.join(f'{r.number}: step {r.step}' for r in found)})"
            )
        chosen = found[number - 1]
        return chosen, f"{chosen.describe()} of {len(found)}, as asked"
    times = launch_times(records)
    with_evidence = [r for r in found if evidence(records, r, times)]
    chosen = with_evidence[-1] if with_evidence else found[-1]
    newer = [r for r in found if r.number > chosen.number]
    if not newer:
        why = (
            "the newest"
            if with_evidence
            else "the newest; no resume recorded a step after its restore"
        )
        return chosen, f"{chosen.describe()} of {len(found)} ({why})"
    skipped = ", ".join(f"{r.number} (step {r.step})" for r in newer)
    return chosen, (
        f"{chosen.describe()} of {len(found)}: the newest with evidence; newer resume(s) {skipped} "
        f"recorded no step after the restore (killed before training, or a finished job "
        f"relaunched): `ckptguard prove --resume N` judges one, `--all` each"
    )
