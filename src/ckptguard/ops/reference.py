"""Which earlier run a resume of step k is compared with: its reference, for ``ckptguard prove``.

Contract: the candidates on one rank are, in order, the run that saved step k (its last save
of k before the restore) and each later run that restored step k (an earlier resume of the
same step in a crash loop); never the resumed run itself. A run's records are those after its
save or restore record and before the next launch's restore record (every launch records one,
step 0 for a fresh start), so a PID that a later launch reuses is not taken for the same run.
For an event (a step record, an export, an old-logprob, an update) the reference is the
earliest candidate that recorded that event past step k: the saving run when it lived long
enough, else the earliest resume that did. An earlier resume may share a bug with the resumed
run; it is used only where the saving run recorded nothing to compare, and the proof says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .._records.proofreader import ProofRecord, shown_pid

__all__ = ["Candidate", "at_step", "candidates", "earliest", "nothing_past"]


@dataclass(frozen=True)
class Candidate:
    """One earlier run of this rank that ran on from step k: records ``[start, end)`` of the rank's
    file."""

    pid: int
    saved: bool  # the run that saved step k (else a resume of it)
    start: int  # its save (or restore) record of step k
    end: int  # the next launch's restore record
    step: int
    # its own launch's restore record (-1: none recorded): an export of step k precedes the save
    launch: int
    save_recorded: bool = True  # its save record is there (False: found by its record of step k)

    def describe(self) -> str:
        what = "the run that saved" if self.saved else "an earlier resume of"
        lost = (
            ""
            if self.save_recorded
            else ", its save record lost with a kill right after the commit"
        )
        return f"{what} step {self.step} (pid {shown_pid(self.pid)}{lost})"


def _next_launch(before: Sequence[ProofRecord], i: int) -> int:
    return next((j for j in range(i + 1, len(before)) if before[j].event == "restore"), len(before))


def _rolled_back(before: Sequence[ProofRecord], k: int, pid: int, save: int | None) -> int | None:
    """The index of the last record of step k, where a process launched after the last save record
    of k with a restore of an earlier step (a rollback) recorded it; None: no such process."""
    if save is None:
        return None
    last = next(
        (
            i
            for i in range(len(before) - 1, save, -1)
            if before[i].event in ("step", "update")
            and before[i].step == k
            and before[i].pid != pid
        ),
        None,
    )
    if last is None:
        return None
    owner = before[last].pid
    launch = next(
        (
            i
            for i in range(last - 1, save, -1)
            if before[i].event == "restore" and before[i].pid == owner
        ),
        None,
    )
    return last if launch is not None and (before[launch].step or 0) < k else None


def candidates(before: Sequence[ProofRecord], k: int, pid: int) -> list[Candidate]:
    """The runs that ran on from step k before the resumed run (``pid``), oldest first. A kill
    between the commit of step k and the append of its save record leaves no save record: the
    process that recorded step k last is then taken as the saving run (a ``save_async`` commit lands
    while steps past k train, so that process may have recorded them: the killed run's own
    evidence), then the resumes of k after it."""
    save = next(
        (
            i
            for i in range(len(before) - 1, -1, -1)
            if before[i].event == "save" and before[i].step == k
        ),
        None,
    )
    out: list[Candidate] = []
    rolled = _rolled_back(before, k, pid, save)
    if rolled is not None:
        # A later process rolled back past k and recorded step k again, and no save record of its
        # step k is there: which of the two step-k checkpoints the resumed run restored is unknown,
        # so neither run is the reference (missing evidence); resumes of k after it still are.
        save = rolled
    elif save is not None:
        launch = next((i for i in range(save - 1, -1, -1) if before[i].event == "restore"), -1)
        out.append(Candidate(before[save].pid, True, save, _next_launch(before, save), k, launch))
    else:
        save = next(
            (
                i
                for i in range(len(before) - 1, -1, -1)
                if before[i].event in ("step", "update") and before[i].step == k
            ),
            -1,
        )
        if save >= 0 and before[save].pid != pid:
            owner = before[save].pid
            launch = next(
                (
                    i
                    for i in range(save - 1, -1, -1)
                    if before[i].event == "restore" and before[i].pid == owner
                ),
                -1,
            )
            out.append(
                Candidate(
                    owner, True, save, _next_launch(before, save), k, launch, save_recorded=False
                )
            )
    for i in range(save + 1, len(before)):
        r = before[i]
        if r.event == "restore" and r.step == k and r.pid != pid and r.get("ok") is not False:
            out.append(Candidate(r.pid, False, i, _next_launch(before, i), k, i))
    return out


def _of(before: Sequence[ProofRecord], c: Candidate, events: tuple[str, ...]) -> list[ProofRecord]:
    """The run's records of ``events`` with a step at or past k, from its launch on."""
    return [
        r
        for r in before[c.launch + 1 : c.end]
        if r.pid == c.pid and r.event in events and r.step is not None and r.step >= c.step
    ]


def earliest(
    before: Sequence[ProofRecord], k: int, pid: int, events: tuple[str, ...] = ("step",)
) -> tuple[Candidate | None, dict[int, list[ProofRecord]]]:
    """The earliest candidate that recorded ``events`` past step k, and those records by step."""
    for c in candidates(before, k, pid):
        found = [r for r in _of(before, c, events) if r.step is not None and r.step > k]
        if found:
            by_step: dict[int, list[ProofRecord]] = {}
            for r in found:
                # _of kept int steps
                by_step.setdefault(int(r.step), []).append(r)  # type: ignore[arg-type]
            return c, by_step
    return None, {}


def at_step(
    before: Sequence[ProofRecord], k: int, pid: int, events: tuple[str, ...], step: int
) -> tuple[Candidate | None, ProofRecord | None]:
    """The earliest candidate's record of ``events`` at ``step``, of the first kind in ``events`` it
    recorded there, whatever the order of its appends (None, None: no run recorded it)."""
    for c in candidates(before, k, pid):
        recorded = [r for r in _of(before, c, events) if r.step == step]
        # record_step before record_update of one step: the update record, not the step's, is the
        # update
        found = next((r for ev in events for r in recorded if r.event == ev), None)
        if found is not None:
            return c, found
    return None, None


def nothing_past(before: Sequence[ProofRecord], k: int, pid: int, what: str) -> str:
    """Why no run before the resumed one recorded ``what`` past step k: what each candidate did
    record."""
    found = candidates(before, k, pid)
    if not found:
        return (
            f"no record of the run that saved step {k} (its save record lost with a kill right "
            "after the commit)"
        )
    parts = []
    for c in found:
        steps = sorted(
            {
                int(r.step)
                for r in _of(before, c, ("step", "update"))
                if r.step is not None and r.step > k
            }
        )
        did = (
            f"recorded steps {steps[0]}-{steps[-1]} but no {what}"
            if steps
            else "recorded no step past it"
        )
        parts.append(f"{c.describe()} {did}")
    return "; ".join(parts)
