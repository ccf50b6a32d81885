"""Rehearse a long run's resume before the long run (docs/practices.md, 3.2 and 6): kill, resume,
save again.

Contract: run the user's training command (which uses ckptguard on ``root`` and records its
steps with ``record_step``) three times, each time killing its whole process tree with
SIGKILL (torchrun's workers sit in their own sessions; ``_proctree`` finds them all):

1. until a save commits and ``ProofPlan.replay_steps`` steps past it are recorded on every
   rank, so the killed run leaves a segment to replay; where the job records its epoch
   (``record_step(..., epoch=)``), on until a step of the next epoch is recorded past the
   committed step (a sampler generator left out of the state shows only there), within
   ``epoch_reach`` steps of the first committed save; the tree is frozen before the kill
   decision, so a save that commits meanwhile is seen;
2. relaunched, it resumes, replays, and its next save stops in the middle of its write
   (``_faults.PAUSE_ENV``): the kill lands mid-write, nothing of that save is committed;
3. relaunched again, it resumes from the same step, replays the steps the first run recorded
   past that save and must commit a save again (docs/practices.md, 6: kill -> resume -> save again).

Each resume is evaluated by the proof gates (the second while its run sits paused, the third
after its save); the rehearsal passes only if both are proven. Every wait is bounded by
``timeout_s``, and no process of a killed run may survive its kill.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .. import _faults
from .._disk import layout as _layout
from .._records import manifest as _manifest
from .._records.checks import cost
from .._records.entries import Cost
from .._records.proofreader import ProofRecord, read_records
from ..config import ProofPlan
from ..errors import CheckpointError, RehearsalError
from . import _proctree
from .prove import Gate, Outcome, evaluate, outcome, passed, verdict, worst


@dataclass
class Kill:
    """One kill of the command's whole process tree."""

    when: str
    pids: list[int]
    survivors: list[int] = field(default_factory=list)
    tracker: int | None = None


@dataclass
class Resume:
    """One resume of the rehearsal and its proof."""

    after: str
    step: int
    gates: list[Gate]

    @property
    def proven(self) -> bool:
        return passed(self.gates)


@dataclass
class Rehearsal:
    gates: list[Gate]  # the proof after the last resume
    step: int
    cost: Cost | None
    log: Path
    kills: list[Kill] = field(default_factory=list)
    resumes: list[Resume] = field(default_factory=list)

    @property
    def outcome(self) -> Outcome:
        """DIVERGED if a resume's gate FAILed, EVIDENCE_MISSING if one had nothing to compare, else
        PROVEN."""
        if not self.resumes:
            return Outcome.EVIDENCE_MISSING
        return worst([outcome(r.gates) for r in self.resumes])

    @property
    def proven(self) -> bool:
        return self.outcome is Outcome.PROVEN

    def verdict(self) -> str:
        result = self.outcome
        if result is Outcome.PROVEN:
            return "rehearsal PASSED"
        bad = next((r for r in self.resumes if outcome(r.gates) is result), None)
        if bad is None:
            return "rehearsal INCONCLUSIVE: no resume was judged"
        word = "FAILED" if result is Outcome.DIVERGED else "INCONCLUSIVE"
        return f"rehearsal {word}: {verdict(bad.gates)} (the resume after {bad.after})"

    def to_json(self) -> dict[str, Any]:
        return {
            "passed": self.proven,
            "outcome": self.outcome.value,
            "verdict": self.verdict(),
            "step": self.step,
            "kills": [asdict(k) for k in self.kills],
            "resumes": [
                {
                    "after": r.after,
                    "step": r.step,
                    "verdict": verdict(r.gates),
                    "outcome": outcome(r.gates).value,
                    "gates": [g.to_json() for g in r.gates],
                }
                for r in self.resumes
            ],
            "cost": self.cost.to_json() if self.cost else None,
            "log": str(self.log),
        }


class _Run:
    """One launch of the command, followed as a process tree."""

    def __init__(
        self, cmd: Sequence[str], log: Any, env: dict[str, str], label: str, logpath: Path
    ) -> None:
        self.label, self.logpath = label, logpath
        self.since = time.time()
        self.proc = subprocess.Popen(
            list(cmd), stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
        self.tree = _proctree.Tree(self.proc)

    def wait(self, what: str, ready: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            # follow the tree while it runs: a worker whose parent dies stays known
            self.tree.scan()
            if ready():
                return
            if self.proc.poll() is not None:
                self.kill(f"{self.label} exited")
                raise RehearsalError(
                    f"rehearse: the command exited ({self.proc.returncode}) before {what}; "
                    f"see {self.logpath}"
                )
            if time.monotonic() > deadline:
                self.kill(f"{self.label} timed out")
                raise RehearsalError(
                    f"rehearse: no {what} within {timeout_s:.0f} s; see {self.logpath} "
                    "(raise --timeout if the job is slow)"
                )
            time.sleep(0.2)

    def kill_when(self, what: str, ready: Callable[[], bool], timeout_s: float) -> Kill:
        """Wait for ``ready``, then freeze the tree, check again (a save may have committed), and
        kill it."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.wait(what, ready, max(1.0, deadline - time.monotonic()))
            frozen = self.tree.freeze()
            if ready():
                return self.kill(what, frozen=frozen)
            self.tree.thaw(frozen)

    def kill(self, when: str, *, frozen: list[int] | None = None) -> Kill:
        pids, survivors = self.tree.kill(frozen=frozen)
        return Kill(when, pids, survivors)


def _tracker(root: Path) -> int:
    try:
        return _layout.read_tracker(root) or 0
    except CheckpointError:
        return 0


def _world(root: Path) -> int:
    saves = [r for recs in read_records(root).values() for r in recs if r["event"] == "save"]
    return max(
        (int(r.get("world_size", 1)) for r in saves), default=max(1, len(read_records(root)))
    )


def _plan(root: Path) -> ProofPlan:
    saves = [
        r
        for recs in read_records(root).values()
        for r in recs
        if r["event"] == "save" and "plan" in r
    ]
    return ProofPlan(**saves[-1]["plan"]) if saves else ProofPlan()


def _steps_past_save(
    tracker: int, per_rank: dict[int, list[ProofRecord]], since: float, count: int, world: int
) -> bool:
    """Every rank recorded ``count`` steps after the committed step ``tracker``, in this launch."""
    if tracker < 1:
        return False
    for rank in range(world):
        recs = [r for r in per_rank.get(rank, []) if r["time"] >= since]
        event = "step" if any(r["event"] == "step" for r in recs) else "update"
        if len({r["step"] for r in recs if r["event"] == event and r["step"] > tracker}) < count:
            return False
    return True


def _epoch(r: ProofRecord) -> Any:
    return (r.get("extra") or {}).get("epoch") if isinstance(r.get("extra"), dict) else None


@dataclass
class _EpochWait:
    """Whether the first run should go on to the next epoch before its kill (rank 0's records)."""

    since: float
    reach: int
    first_save: int = 0
    crossed_at: int | None = None
    gave_up: bool = False

    def done(self, tracker: int, per_rank: dict[int, list[ProofRecord]]) -> bool:
        """True once the recorded steps past the committed step cross an epoch, none is recorded
        (nothing to wait for), or ``reach`` steps past the first committed save went by without
        one."""
        self.first_save = self.first_save or tracker
        steps = {r["step"]: r for r in per_rank.get(0, []) if r["event"] == "step"}
        base = steps.get(tracker)
        if self.reach <= 0 or base is None or _epoch(base) is None:
            return True
        past = sorted(s for s, r in steps.items() if s > tracker and r["time"] >= self.since)
        self.crossed_at = next((s for s in past if _epoch(steps[s]) != _epoch(base)), None)
        if self.crossed_at is not None:
            return True
        self.gave_up = max(past, default=0) - self.first_save >= self.reach
        return self.gave_up


def _saved_again(root: Path, since: float, world: int) -> bool:
    per_rank = read_records(root)
    return all(
        any(r["event"] == "save" and r["time"] >= since for r in per_rank.get(r_, []))
        for r_ in range(world)
    )


def _paused(where: Path, world: int) -> bool:
    return len(list(where.glob("paused_rank_*"))) >= world


def _newest_restore(root: Path, since: float) -> int | None:
    recs = [
        r for r in read_records(root).get(0, []) if r["event"] == "restore" and r["time"] >= since
    ]
    return int(recs[-1]["step"]) if recs else None


def rehearse(
    cmd: Sequence[str],
    root: str | os.PathLike[str],
    *,
    timeout_s: float = 600.0,
    workdir: str | os.PathLike[str] | None = None,
    echo: Callable[[str], None] = lambda s: None,
    epoch_reach: int = 64,
) -> Rehearsal:
    """``epoch_reach``: how many steps past its first committed save the first run may go on to
    record a step of the next epoch before its kill (0: kill at ``replay_steps`` past the save)."""
    root = Path(os.fspath(root)).absolute()
    start = _tracker(root) if root.exists() else 0
    log = (
        Path(os.fspath(workdir)) if workdir is not None else root.parent
    ) / f"rehearse-{int(time.time())}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    _proctree.become_subreaper()  # orphans of a killed tree come to us and are reaped
    pause_dir = Path(tempfile.mkdtemp(prefix="ckptguard-rehearse-"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop(_faults.PAUSE_ENV, None)
    kills: list[Kill] = []
    resumes: list[Resume] = []
    runs: list[_Run] = []

    def launch(label: str, extra: dict[str, str] | None = None) -> _Run:
        runs.append(_Run(cmd, out, {**env, **(extra or {})}, label, log))
        return runs[-1]

    def check(kill: Kill) -> Kill:
        kill.tracker = _tracker(root)
        kills.append(kill)
        if kill.survivors:
            raise RehearsalError(
                f"rehearse: processes {kill.survivors} of the command "
                f"survived SIGKILL ({kill.when})"
            )
        return kill

    try:
        with open(log, "ab") as out:
            echo(f"[1/4] running until a save commits under {root} and the run continues past it")
            first = launch("the first run")
            first.wait("first committed save", lambda: _tracker(root) > start, timeout_s)
            plan, world = _plan(root), _world(root)
            n = plan.replay_steps
            epochs = _EpochWait(first.since, epoch_reach)

            def past_save() -> bool:  # one reading of the tracker and the records per poll
                tracker, per_rank = _tracker(root), read_records(root)
                return _steps_past_save(tracker, per_rank, first.since, n, world) and epochs.done(
                    tracker, per_rank
                )

            kill = check(
                first.kill_when(
                    f"{n} step(s) recorded past a committed save on {world} rank(s)",
                    past_save,
                    timeout_s,
                )
            )
            saved = kill.tracker or 0
            crossing = (
                f", past the epoch boundary at step {epochs.crossed_at}"
                if epochs.crossed_at is not None
                else f" (no epoch boundary within {epoch_reach} steps)"
                if epochs.gave_up
                else ""
            )
            if epochs.crossed_at is not None:
                kill.when += f", into the next epoch (step {epochs.crossed_at})"
            echo(
                f"      SIGKILLed the whole process tree ({_count(kill.pids)}) {n}+ step(s) past "
                f"the committed step {saved}{crossing}; none survived"
            )

            echo("[2/4] relaunching: it resumes and replays; its next save is SIGKILLed mid-write")
            second = launch("the second run", {_faults.PAUSE_ENV: str(pause_dir)})
            second.wait(
                "a save of the resumed run paused mid-write on every rank",
                lambda: _paused(pause_dir, world),
                timeout_s,
            )
            step_b = _newest_restore(root, second.since)
            resumes.append(
                Resume(f"the kill past the save of step {saved}", step_b or 0, evaluate(root))
            )
            kill = check(second.kill("mid-write of a save"))
            if kill.tracker != saved:
                raise RehearsalError(
                    f"rehearse: the tracker moved from {saved} to {kill.tracker} although the save "
                    "was killed mid-write; the commit protocol is broken on this storage"
                )
            echo(
                f"      resumed from step {step_b}; SIGKILLed the whole process tree "
                f"({_count(kill.pids)}) in the middle of a save; the tracker still says {saved}"
            )

            echo(
                "[3/4] relaunching: it resumes from the same step, replays, and "
                "must commit a save again"
            )
            third = launch("the third run")
            third.wait(
                "a committed save of the resumed run",
                lambda: _saved_again(root, third.since, world),
                timeout_s,
            )
            step_c = _newest_restore(root, third.since)
            kill = check(third.kill("after the resumed run saved again"))
            echo(
                f"      resumed from step {step_c}, committed step {kill.tracker} again; stopped "
                f"the whole process tree ({_count(kill.pids)})"
            )
    finally:
        shutil.rmtree(pause_dir, ignore_errors=True)  # a paused process left behind ends itself
        for run in runs:  # on an error: nothing of the command outlives the rehearsal
            if run.tree.members():
                run.kill("rehearse stopped on an error")
    echo("[4/4] evaluating the proof gates")
    gates = evaluate(root)
    resumes.append(
        Resume(f"the kill mid-write of a save (resumed from step {step_c})", step_c or 0, gates)
    )
    step_dir = root / _layout.StepNaming(_template(root)).name(saved)
    return Rehearsal(gates, saved, cost(step_dir), log, kills, resumes)


def _template(root: Path) -> str:
    """The step directory template the run used, read back from its newest manifest."""
    for path in sorted(root.iterdir(), reverse=True):
        if path.is_dir() and not path.is_symlink() and (path / _layout.MANIFEST_NAME).exists():
            with contextlib.suppress(CheckpointError):  # the manifest reader bounds and checks it
                return _manifest.read(path).dir_template or "step_{step:08d}"
    return "step_{step:08d}"


def _count(pids: list[int]) -> str:
    return f"{len(pids)} process{'' if len(pids) == 1 else 'es'}"
