"""RolloutLedger: the prompts of an asynchronous RL loop survive SIGKILLs exactly.

The kill loop (tests/rollout_job.py): a producer thread issues prompt ids 0..N-1, a buffer of
completed rollouts, groups trained with an advancing policy version, the policy and the driver
committed together by a RunCheckpoint. 100 SIGKILLs at seeded random moments over four
parametrised cases, each relaunch resuming from the last commit: the multiset of trained
prompt ids (the policy's per-prompt counts, in its DCP state) equals the uninterrupted run's,
every prompt once. The negative control saves the dataloader's position instead of the ledger
and loses prompts. A zygote process imports torch once and forks each relaunch (an interpreter
start costs seconds on 2 cores), and the test SIGKILLs the forked job.
"""

from __future__ import annotations

import contextlib
import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptguard as cg
import rollout_job as job
from ckptguard import ProofPlan

JOB = Path(__file__).with_name("rollout_job.py")
REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- the ledger alone


def _fed(ledger: cg.RolloutLedger, ids: list[int]) -> None:
    for pid in ids:
        ledger.issued(pid)


def test_flow_counters_and_staleness_rule_at_take():
    ledger = cg.RolloutLedger(max_staleness=1)
    _fed(ledger, [0, 1, 2, 3])
    for pid in (0, 1, 2):
        ledger.completed(pid, f"rollouts/{pid}.pt")
    got = ledger.take(2)
    assert [(r.prompt_id, r.policy_version, r.ref) for r in got] == [
        (0, 0, "rollouts/0.pt"),
        (1, 0, "rollouts/1.pt"),
    ]
    ledger.trained([0, 1], step=1)
    assert ledger.policy_version == 1
    ledger.trained(
        [], step=2
    )  # the policy moved on twice: prompt 2 (version 0) is now 2 versions behind
    assert [r.prompt_id for r in ledger.take(4)] == []
    assert ledger.pending_reissue == [2]
    c = ledger.counters()
    assert (c["issued"], c["completed"], c["trained"], c["dropped_stale"], c["in_flight"]) == (
        4,
        3,
        2,
        1,
        1,
    )
    assert c["trained_staleness"] == {0: 2}
    ledger.issued(2)  # re-issued at the current version
    assert ledger.counters()["reissued"] == 1 and ledger.in_flight == {3: 0, 2: 2}


def test_misuse_is_refused_naming_the_prompt():
    ledger = cg.RolloutLedger()
    ledger.issued(7)
    with pytest.raises(cg.ConfigError, match="already in flight"):
        ledger.issued(7)
    with pytest.raises(cg.ConfigError, match=r"completed\(8\)"):
        ledger.completed(8, None)
    with pytest.raises(cg.ConfigError, match=r"\[7\] were not completed"):
        ledger.trained([7], step=1)
    ledger.completed(7, None)
    ledger.trained([7], step=1)
    with pytest.raises(cg.ConfigError, match="already trained"):
        ledger.issued(7)
    with pytest.raises(cg.ConfigError, match="int or a str"):
        ledger.issued(1.5)  # type: ignore[arg-type]


def _mid_run(ledger: cg.RolloutLedger) -> None:
    """Prompts 0-1 trained (policy at version 2), 2 and 3 buffered at versions 0 and 2, 4 and 5 in
    flight."""
    for _ in range(2):
        ledger.next_prompt()
    ledger.completed(0, "r0")
    ledger.completed(1, "r1")
    ledger.next_prompt()  # 2, issued at version 0
    ledger.trained([r.prompt_id for r in ledger.take(2)], step=2)
    ledger.completed(2, "r2")
    for _ in range(3):
        ledger.next_prompt()  # 3, 4, 5 at version 2
    ledger.completed(3, "r3")


@pytest.mark.parametrize(
    ("kwargs", "kept", "reissue"),
    [
        ({}, [2, 3], [4, 5]),  # in flight at the save: re-issued; buffered: kept with their version
        ({"max_staleness": 1}, [3], [4, 5, 2]),  # prompt 2 is 2 versions behind: dropped, re-issued
        (
            {"keep_buffered": False},
            [],
            [4, 5, 2, 3],
        ),  # the buffer lived in memory: everything re-issued
    ],
)
def test_resume_applies_the_declared_rule(kwargs, kept, reissue):
    saving = cg.RolloutLedger(range(10), **kwargs)
    _mid_run(saving)
    state = saving.state_dict()
    torch.save(state, buf := __import__("io").BytesIO())
    buf.seek(0)
    loaded = cg.RolloutLedger(range(10), **kwargs)
    loaded.load_state_dict(
        torch.load(buf, weights_only=True)
    )  # plain values only: the safe load reads it
    assert (
        loaded.state_dict() == state
    )  # exact until resume(): the restore's digest check sees the saved state
    plan = loaded.resume()
    assert [r.prompt_id for r in plan.kept] == kept and plan.reissue == reissue
    assert plan.trained == 2 and plan.policy_version == 2
    if kept:
        assert plan.kept[0].policy_version == {2: 0, 3: 2}[kept[0]]
    # re-issues come first, then the source continues after the 6 ids it had drawn, never repeating
    # one
    drawn = [loaded.next_prompt() for _ in range(len(reissue) + 2)]
    assert drawn == [*reissue, 6, 7]


class _Cursor:
    """A resumable prompt source (what a DataCursor is): its position is saved inside the ledger."""

    def __init__(self, n: int) -> None:
        self.n, self.pos = n, 0

    def __iter__(self):
        while self.pos < self.n:
            self.pos += 1
            yield self.pos - 1

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.pos = sd["pos"]


def test_a_stateful_source_is_saved_with_the_ledger_and_resumes_itself():
    saving = cg.RolloutLedger(_Cursor(10))
    _mid_run(saving)
    state = saving.state_dict()
    assert state["source"] == {"pos": 6}
    loaded = cg.RolloutLedger(_Cursor(10))
    loaded.load_state_dict(state)
    assert [loaded.next_prompt() for _ in range(4)] == [4, 5, 6, 7]
    with pytest.raises(cg.StateMismatchError, match="same kind of source"):
        cg.RolloutLedger(range(10)).load_state_dict(state)


def test_a_data_cursor_is_a_prompt_source_saved_inside_the_ledger():
    saving = cg.RolloutLedger(cg.DataCursor(10, shuffle=False, rank=0, world_size=1))
    _mid_run(saving)  # (it names prompts 0-5: an unshuffled order)
    state = saving.state_dict()
    assert state["source"]["consumed"] == 6
    loaded = cg.RolloutLedger(cg.DataCursor(10, shuffle=False, rank=0, world_size=1))
    loaded.load_state_dict(state)
    assert [loaded.next_prompt() for _ in range(4)] == [4, 5, 6, 7]


EPOCH = 12


def _drive(ledger: cg.RolloutLedger, *, steps: int | None = None, ahead: int = 3) -> list[list]:
    """An asynchronous driver: keep ``ahead`` prompts in flight, complete the oldest, train one per
    step; ends when the source and the buffers are empty (or after ``steps`` steps)."""
    trained: list[list] = []
    while steps is None or len(trained) < steps:
        while len(ledger.in_flight) < ahead and ledger.next_prompt() is not None:
            pass
        if ledger.in_flight:
            ledger.completed(next(iter(ledger.in_flight)), "ref")
        batch = [r.prompt_id for r in ledger.take(1)]
        if not batch:
            return trained
        ledger.trained(batch, step=ledger.counters()["last_step"] + 1)
        trained.append(batch)
    return trained


def _cursor_ledger() -> cg.RolloutLedger:
    return cg.RolloutLedger(cg.DataCursor(EPOCH, seed=3, rank=0, world_size=1))


@pytest.mark.parametrize("at", range(EPOCH - 4, EPOCH + 1))
def test_a_cursor_ledger_restored_in_the_last_steps_of_its_epoch_ends_as_the_uninterrupted_run(at):
    # The driver draws 3 prompts ahead, so the cursor's epoch is drawn whole before training ends: a
    # restore then must not start the next epoch (prompts already trained) but end as the run would.
    straight = _drive(_cursor_ledger())
    assert sorted(p for b in straight for p in b) == list(range(EPOCH))
    saving = _cursor_ledger()
    first = _drive(saving, steps=at)
    state = saving.state_dict()
    assert state["source"]["consumed"] == min(
        at + 2, EPOCH
    )  # from step 10 on: the whole epoch drawn
    resumed = _cursor_ledger()
    resumed.load_state_dict(state)
    rest = _drive(resumed)
    assert sorted(p for b in first + rest for p in b) == list(range(EPOCH))  # each prompt once
    assert resumed.next_prompt() is None and resumed.take(1) == []


def test_a_finished_cursor_ledger_relaunched_returns_none():
    done = _cursor_ledger()
    _drive(done)
    assert done.next_prompt() is None
    relaunched = _cursor_ledger()
    relaunched.load_state_dict(done.state_dict())
    for _ in range(3):  # every relaunch of the finished job: nothing to issue, nothing raised
        assert relaunched.next_prompt() is None
    again = _cursor_ledger()
    again.load_state_dict(relaunched.state_dict())
    assert again.next_prompt() is None and _drive(again) == []


def test_a_cursor_ledger_without_an_open_iteration_starts_the_next_epoch_as_before():
    # A state of an older ckptguard (no "source_open") or a ledger that never drew: iter() as
    # before.
    saving = _cursor_ledger()
    state = saving.state_dict()
    assert state["source_open"] is False
    state.pop("source_open")
    loaded = _cursor_ledger()
    loaded.load_state_dict(state)
    assert loaded.next_prompt() == cg.DataCursor(EPOCH, seed=3, rank=0, world_size=1).order(0)[0]


def test_work_done_after_a_restore_before_the_first_take_is_kept():
    # A driver that names its own prompts (issued/completed) before its first take() after a
    # restore: the resume rule applies first, so the new process's prompts are neither re-issued nor
    # dropped.
    saving = cg.RolloutLedger(range(10), keep_buffered=False)
    _mid_run(saving)
    loaded = cg.RolloutLedger(range(10), keep_buffered=False)
    loaded.load_state_dict(saving.state_dict())
    loaded.issued(1000)
    loaded.completed(1000, "fresh")
    assert [r.prompt_id for r in loaded.take(4)] == [1000]
    assert loaded.next_prompt() == 4  # the in-flight prompts of the killed run come back first


def test_the_ledger_is_a_state_item_restored_and_digest_checked(tmp_path):
    ledger = cg.RolloutLedger(range(10), max_staleness=3)
    _mid_run(ledger)
    mgr = cg.CheckpointManager(
        tmp_path / "ckpt", config=cg.CheckpointConfig(proof=ProofPlan(record=False))
    )
    mgr.save(2, {"ledger": ledger})
    fresh = cg.RolloutLedger(range(10), max_staleness=3)
    assert mgr.restore({"ledger": fresh}) == 2
    assert fresh.state_dict() == ledger.state_dict()
    assert fresh.trained_ids == {0, 1} and [r.prompt_id for r in fresh.buffered] == [2, 3]


# ---------------------------------------------------------------- the kill loop


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    base = tmp_path_factory.mktemp("zygote")
    path = f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    with open(base / "stderr.log", "w") as err:
        proc = subprocess.Popen(
            [sys.executable, str(JOB), "zygote", str(base / "warm")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
        )
    proc.log = base / "stderr.log"  # type: ignore[attr-defined]
    try:
        assert _line(proc, 120) == "ready", proc.log.read_text()[-3000:]  # type: ignore[attr-defined]
        yield proc
    finally:
        proc.stdin.close()
        proc.wait(30)


def _line(proc: subprocess.Popen, timeout: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"the zygote said nothing in {timeout} s: {proc.log.read_text()[-3000:]}"  # type: ignore[attr-defined]
    return proc.stdout.readline().strip()


def _relaunch_until_done(
    proc, root: Path, mode: str, kills: int, rng: random.Random, delays: tuple[float, float]
) -> tuple[int, float | None]:
    """Launch the job, SIGKILL it at a random moment, relaunch (it resumes from the last commit),
    until a launch finishes before its kill, or ``kills`` kills landed and the last launch ran to
    the end. Returns the kills that landed, and the seconds of the whole run when none did (its
    one launch ran from an empty root to the end)."""
    landed = launches = 0
    while True:
        started = time.monotonic()
        proc.stdin.write(f"run {root} {mode}\n")
        proc.stdin.flush()
        pid = int(_line(proc, 60).split()[1])
        launches += 1
        assert launches < kills + 50, "the job never finished"
        if landed < kills and not select.select([proc.stdout], [], [], rng.uniform(*delays))[0]:
            # The zygote reaps it only after it died, so the pid is still this job's; it may have
            # just finished and been reaped, and then its exit line follows.
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        status = int(_line(proc, 60).split()[1])
        if status == -signal.SIGKILL:
            landed += 1
            continue
        assert status == 0, proc.log.read_text()[-3000:]
        return landed, (time.monotonic() - started if landed == 0 else None)


def _runs_with_kills(
    proc, base: Path, mode: str, kills: int, seed: int, run_seconds: float
) -> list[Path]:
    """Whole runs, each on a new root and killed until it finishes, until ``kills`` kills landed in
    all. Kills land at random moments within 90% of a whole run's length; a run that finished before
    its kill shortens that window to its own length (CI's stop 46: the straight run, measured while
    the machine was loaded, took longer than the runs that followed, and 55 of 55 roots went
    unkilled)."""
    rng, roots, landed = random.Random(seed), [], 0
    while landed < kills:
        roots.append(base / f"run{len(roots)}")
        hit, whole = _relaunch_until_done(
            proc, roots[-1], mode, kills - landed, rng, (0.0, 0.9 * run_seconds)
        )
        landed += hit
        run_seconds = min(run_seconds, whole or run_seconds)
        assert len(roots) < 2 * kills + 5, "most runs finished before their kill"
    return roots


def _trained_counts(root: Path) -> torch.Tensor:
    """The policy's per-prompt training counts in the tracker's step, read with plain DCP."""
    step = int((root / "latest_checkpointed_iteration.txt").read_text())
    counts = {"policy.counts": torch.full((job.N_PROMPTS,), -1.0)}
    dcp.load(
        counts, checkpoint_id=str(root / f"step_{step:08d}" / "policy" / "state"), no_dist=True
    )
    return counts["policy.counts"]


@pytest.fixture(scope="module")
def uninterrupted(zygote, tmp_path_factory):
    root = tmp_path_factory.mktemp("straight") / "ckpt"
    started = time.monotonic()
    assert _relaunch_until_done(zygote, root, "ledger", 0, random.Random(0), (0, 0))[0] == 0
    # Kills land at random moments within an uninterrupted run's length, measured here: a fixed
    # window would miss a fast machine's runs (they finish before the kill) and bunch up on a slow
    # one.
    _RUN_SECONDS.append(time.monotonic() - started)
    return _trained_counts(root)


_RUN_SECONDS: list[float] = []


KILLS_PER_CASE = 25


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_sigkill_at_random_moments_trains_every_prompt_exactly_once(
    zygote, uninterrupted, tmp_path, seed
):
    assert torch.equal(uninterrupted, torch.ones(job.N_PROMPTS))
    roots = _runs_with_kills(zygote, tmp_path, "ledger", KILLS_PER_CASE, seed, _RUN_SECONDS[0])
    for root in roots:
        counts = _trained_counts(root)
        lost, twice = (
            (counts == 0).nonzero().flatten().tolist(),
            (counts > 1).nonzero().flatten().tolist(),
        )
        assert (lost, twice) == ([], []), f"{root}: prompts lost {lost}, trained twice {twice}"
        assert torch.equal(counts, uninterrupted)
    ledger = cg.RolloutLedger(range(job.N_PROMPTS))
    run = cg.RunCheckpoint(roots[-1], [cg.Role("policy"), cg.Role("driver")])
    policy = torch.nn.Module()
    policy.counts = torch.nn.Parameter(torch.zeros(job.N_PROMPTS), requires_grad=False)
    run.restore({"policy": {"policy": policy}, "driver": {"ledger": ledger}})
    assert (
        ledger.trained_ids == set(range(job.N_PROMPTS))
        and not ledger.buffered
        and not ledger.in_flight
    )
    c = ledger.counters()
    assert c["trained"] == job.N_PROMPTS and c["policy_version"] == c["last_step"]


@pytest.mark.parametrize("mode", ["ledger", "position"])
def test_without_the_ledger_in_the_commit_prompts_are_lost(zygote, tmp_path, mode):
    """The negative control: killed right after its first commit (step 2: 8 prompts trained, and as
    the producer issues 3 at a time, at least 9 drawn), then relaunched. Saving the dataloader's
    position instead of the ledger skips what was buffered or in flight at the save; the ledger
    loses nothing."""
    root = tmp_path / "ckpt"
    for launch, expected in ((f"{mode}-die", -signal.SIGKILL), (mode, 0)):
        zygote.stdin.write(f"run {root} {launch}\n")
        zygote.stdin.flush()
        _line(zygote, 60)
        assert int(_line(zygote, 60).split()[1]) == expected, zygote.log.read_text()[-3000:]
    counts = _trained_counts(root)
    lost = (counts == 0).nonzero().flatten().tolist()
    assert (counts <= 1).all()
    if mode == "ledger":
        assert lost == []
    else:
        assert lost, f"the control lost nothing: counts {counts.tolist()}"
        assert 8 in lost  # drawn at step 2, not trained: the position saved was past it
