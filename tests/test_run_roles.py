"""RunCheckpoint: an actor on ranks {0,1}, a critic on {0,1} and a driver on rank 0, committed as
one step over 2 real gloo processes.

A SIGKILL after the actor's part and before the critic's leaves the previous step as the resume
target; the relaunch restores every role exactly and commits the step again. A step with a role's
files deleted is refused naming the role (AUTO and an explicit path), counted as incomplete by
verify and retention (never deleted), and left alone by gc. Restore restores every role or none.
"""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptguard as cg
from ckptguard import ProofPlan
from ckptguard._disk.layout import StepNaming
from ckptguard._records import retention
from ckptguard._records.checks import verify_step
from ckptguard.ops import gc as _gc
from ckptguard.testing import run_ranks, set_fault_hook, values

NAMING = StepNaming("step_{step:08d}")


def _roles() -> list[cg.Role]:
    return [
        cg.Role("actor", ranks=(0, 1)),
        cg.Role("critic", ranks=(0, 1)),
        cg.Role("driver", ranks=(0,)),
    ]


def _config() -> cg.CheckpointConfig:
    return cg.CheckpointConfig(timeout_s=30.0, proof=ProofPlan(record=False), retention=None)


class _Job:
    """One rank's part of the run: the actor (model, optimizer, a per-rank counter), the critic,
    and on rank 0 the driver (a rollout ledger and a counter)."""

    def __init__(self, rank: int, seed: int) -> None:
        torch.manual_seed(seed)
        self.rank = rank
        self.actor = torch.nn.Linear(4, 4)
        self.optim = torch.optim.Adam(self.actor.parameters(), lr=0.1)
        self.critic = torch.nn.Linear(4, 1)
        self.ledger = cg.RolloutLedger(range(100))
        self.seen = cg.PerRank(0)
        self.driver_step = 0

    def train(self, step: int) -> None:
        torch.manual_seed(
            step
        )  # the same update on both ranks: the actor and critic are replicated
        x = torch.randn(8, 4)
        loss = self.actor(x).pow(2).mean() + self.critic(x).mean()
        loss.backward()
        self.optim.step()
        self.optim.zero_grad()
        with torch.no_grad():
            self.critic.bias.add_(step)
        self.seen.value += 10 * (self.rank + 1)
        if self.rank == 0:
            pid = self.ledger.next_prompt()
            self.ledger.completed(pid, f"rollouts/{pid}.pt")
            self.ledger.trained([pid], step)
            self.driver_step = step

    def states(self) -> dict:
        out = {
            "actor": {"model": self.actor, "optim": self.optim, "seen": self.seen},
            "critic": {"model": self.critic},
        }
        if self.rank == 0:
            out["driver"] = {"ledger": self.ledger, "step": self.driver_step}
        return out

    def fingerprint(self, states: dict) -> dict:
        out = {
            "actor": [p.detach().clone() for p in self.actor.parameters()],
            "adam": {k: v.clone() for k, v in self.optim.state[self.actor.weight].items()},
            "critic": [p.detach().clone() for p in self.critic.parameters()],
            "seen": self.seen.value,
        }
        if self.rank == 0:
            out["trained"] = sorted(self.ledger.trained_ids)
            out["driver_step"] = states["driver"]["step"]
        return out


def _same(a: dict, b: dict) -> bool:
    def eq(x, y):
        if isinstance(x, torch.Tensor):
            return torch.equal(x, y)
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(eq(x[k], y[k]) for k in x)
        if isinstance(x, list):
            return len(x) == len(y) and all(eq(u, v) for u, v in zip(x, y, strict=True))
        return x == y

    return eq(a, b)


def _kill_after_first_role() -> None:
    """SIGKILL this rank the first time a role's part is confirmed: after the actor's, before the
    critic's."""
    set_fault_hook("run.role_written", lambda: os.kill(os.getpid(), signal.SIGKILL))


def _save_worker(rank: int, world: int, root: str, steps: int, kill_at: int) -> dict:
    run = cg.RunCheckpoint(root, _roles(), config=_config())
    job = _Job(rank, seed=0)
    assert run.my_roles == (["actor", "critic", "driver"] if rank == 0 else ["actor", "critic"])
    assert run.restore(job.states()) == 0
    for step in range(1, steps + 1):
        job.train(step)
        if step == kill_at:
            _kill_after_first_role()
        run.save(step, job.states())
    return run.committed_steps()  # not reached: the save of step kill_at dies


def _resume_worker(rank: int, world: int, root: str, steps: int) -> dict:
    """Restore (into objects built from another seed), check every role, then train on and save."""
    run = cg.RunCheckpoint(root, _roles(), config=_config())
    job = _Job(rank, seed=1)
    untouched = [p.detach().clone() for p in job.actor.parameters()]
    # Every role or none: a driver item missing on rank 0 is refused before any role reads a tensor.
    bad = job.states()
    if rank == 0:
        del bad["driver"]["step"]
    refused = None
    try:
        run.restore(bad)
    except cg.StateMismatchError as exc:
        refused = str(exc)
    none_loaded = all(
        torch.equal(a, b) for a, b in zip(untouched, job.actor.parameters(), strict=True)
    )
    states = job.states()
    start = run.restore(states)
    restored = job.fingerprint(states)
    if rank == 0:
        job.driver_step = states["driver"]["step"]
    for step in range(start + 1, steps + 1):
        job.train(step)
        run.save(step, job.states())
    # The oracle: the same job trained straight through in memory, never saved, killed or restored.
    straight, expected = _Job(rank, seed=0), {}
    for step in range(1, steps + 1):
        straight.train(step)
        expected[step] = straight.fingerprint(straight.states())
    return {
        "refused": refused,
        "none_loaded": none_loaded,
        "start": start,
        "restored": restored,
        "committed": run.committed_steps(),
        "last": job.fingerprint(job.states()),
        "straight": expected,
    }


def _refusal_worker(rank: int, world: int, root: str, damaged: str, older: str) -> dict:
    run = cg.RunCheckpoint(root, _roles(), config=_config())
    job = _Job(rank, seed=1)
    out = {}
    for label, path in (("auto", None), ("explicit", damaged)):
        try:
            run.restore(job.states(), path=path)
            out[label] = "restored"
        except cg.CheckpointError as exc:
            out[label] = f"{type(exc).__name__}: {exc}"
    out["older"] = run.restore(job.states(), path=older)
    return out


def test_kill_between_roles_keeps_previous_step_and_a_deleted_role_is_refused(tmp_path):
    root = tmp_path / "ckpt"
    # Steps 1 and 2 commit; the save of step 3 dies on both ranks after the actor's part.
    res = run_ranks(_save_worker, 2, str(root), 3, 3)
    assert [r.exitcode for r in res] == [-signal.SIGKILL, -signal.SIGKILL], [r.error for r in res]
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert not (root / NAMING.name(3)).exists()
    (tmp,) = root.glob(
        ".tmp-step_00000003-*"
    )  # the scene: the actor's part confirmed, the critic's never
    assert (tmp / "actor" / "manifest.json").is_file() and not (
        tmp / "critic" / "manifest.json"
    ).exists()
    assert not (tmp / "manifest.json").exists()

    # The relaunch resumes from step 2: first a refused restore (nothing loaded), then every role
    # exactly.
    out = values(run_ranks(_resume_worker, 2, str(root), 4))
    for rank, o in enumerate(out):
        straight = o["straight"]
        assert "role 'driver'" in o["refused"] and "step" in o["refused"], o["refused"]
        assert o["none_loaded"], (
            f"rank {rank}: the actor was loaded although the driver was refused"
        )
        assert o["start"] == 2
        assert _same(o["restored"], straight[2]), f"rank {rank}: restored state differs"
        assert _same(o["last"], straight[4]), f"rank {rank}: the resumed run diverged"
        assert o["committed"] == [1, 2, 3, 4]
    assert not list(
        root.glob(".tmp-*")
    )  # the dead save's temp directory was swept by the next save

    # The on-disk form: one run manifest listing every role with its ranks; each role's part is
    # plain DCP.
    step4 = root / NAMING.name(4)
    manifest = json.loads((step4 / "manifest.json").read_text())
    assert manifest["kind"] == "ckptguard-run" and manifest["step"] == 4
    assert {k: v["ranks"] for k, v in manifest["roles"].items()} == {
        "actor": [0, 1],
        "critic": [0, 1],
        "driver": [0],
    }
    assert sorted(p.name for p in step4.iterdir()) == ["actor", "critic", "driver", "manifest.json"]
    assert verify_step(step4, deep=True) == []
    weight = {"model.weight": torch.zeros(4, 4)}
    dcp.load(weight, checkpoint_id=str(step4 / "actor" / "state"), no_dist=True)
    assert torch.equal(weight["model.weight"], out[0]["straight"][4]["actor"][0])
    with pytest.raises(cg.RunStepError, match="RunCheckpoint"):
        cg.CheckpointManager(root).restore({"model": torch.nn.Linear(4, 4)}, path=step4)

    # A step with a role's files deleted is not committed: refused naming the role, never deleted.
    shutil.rmtree(step4 / "critic")
    (finding,) = [f for f in verify_step(step4) if f.severity.value == "ERROR"]
    assert finding.code == "missing-role" and "'critic'" in finding.message
    report = retention.apply(root, NAMING, cg.KeepLast(1))
    assert report.deleted == [1, 2] and report.kept == [
        3
    ]  # step 4 is not counted: the newest complete one stays
    assert step4.is_dir() and "not a complete checkpoint" in report.not_counted[step4.name]
    gc_report = _gc.gc(root, NAMING, force=True)
    assert step4 not in [p for p, _ in gc_report.removed] and step4 in [
        p for p, _ in gc_report.kept
    ]
    for o in values(
        run_ranks(_refusal_worker, 2, str(root), str(step4), str(root / NAMING.name(3)))
    ):
        assert o["auto"].startswith("ResumeError") and "missing role 'critic'" in o["auto"], o[
            "auto"
        ]
        assert (
            o["explicit"].startswith("CheckpointIncompleteError")
            and "missing role 'critic'" in o["explicit"]
        )
        assert o["older"] == 3


# ---------------------------------------------------------------- one process


def test_states_must_match_the_roles_of_this_rank(tmp_path):
    run = cg.RunCheckpoint(
        tmp_path / "ckpt", [cg.Role("actor"), cg.Role("driver")], config=_config()
    )
    model = torch.nn.Linear(2, 2)
    with pytest.raises(cg.ConfigError, match=r"no state for \['driver'\]"):
        run.save(1, {"actor": {"model": model}})
    with pytest.raises(cg.ConfigError, match=r"role\(s\) \['critic'\] are not held"):
        run.save(1, {"actor": {"model": model}, "driver": {"n": 1}, "critic": {"m": model}})
    assert not (tmp_path / "ckpt").exists()  # refused before anything was written
    with pytest.raises(cg.ConfigError, match="unique"):
        cg.RunCheckpoint(tmp_path / "x", [cg.Role("actor"), cg.Role("actor")])
    with pytest.raises(cg.ConfigError, match="role name"):
        cg.Role("state")
    with pytest.raises(cg.ConfigError, match="default process group has 1 ranks"):
        cg.RunCheckpoint(tmp_path / "x", [cg.Role("actor", ranks=(0, 1))])


def test_retention_keeps_what_the_policy_says_after_save_and_save_async(tmp_path):
    """The core's retention (``Root.cleanup``) deletes whole run steps, for ``save`` and after a
    ``save_async`` commit (in its thread); every role's proof log records what it deleted."""
    root = tmp_path / "ckpt"
    config = cg.CheckpointConfig(timeout_s=30.0, retention=cg.KeepLast(2))
    run = cg.RunCheckpoint(root, [cg.Role("actor"), cg.Role("critic")], config=config)
    model, critic = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    for step in (1, 2, 3):
        run.save(step, {"actor": {"model": model}, "critic": {"model": critic}})
    assert run.committed_steps() == [2, 3]
    with torch.no_grad():
        model.weight.fill_(4.0)
    pending = run.save_async(4, {"actor": {"model": model}, "critic": {"model": critic}})
    assert pending is not None and run.wait() == root / NAMING.name(4)
    assert (
        pending.cleanup_seconds is not None
    )  # retention ran after the commit, in the commit's thread
    assert run.committed_steps() == [3, 4]
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == [
        "step_00000003",
        "step_00000004",
    ]
    for role in ("actor", "critic"):
        records = [
            json.loads(line)
            for line in (root / "proof" / role / "rank_00000.jsonl").read_text().splitlines()
        ]
        assert [r["deleted"] for r in records if r["event"] == "cleanup"] == [[1], [2]], role
    assert not (
        root / "proof" / "rank_00000.jsonl"
    ).exists()  # the roles' logs, no log of the run's own
    fresh = torch.nn.Linear(2, 2)
    run.close()
    assert (
        cg.RunCheckpoint(root, [cg.Role("actor"), cg.Role("critic")], config=config).restore(
            {"actor": {"model": fresh}, "critic": {"model": torch.nn.Linear(2, 1)}}
        )
        == 4
    )
    assert torch.equal(fresh.weight, torch.full((2, 2), 4.0))


def test_a_failed_role_write_commits_nothing_and_names_the_role(tmp_path):
    root = tmp_path / "ckpt"
    run = cg.RunCheckpoint(root, [cg.Role("actor"), cg.Role("critic")], config=_config())
    model, critic = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    run.save(1, {"actor": {"model": model}, "critic": {"model": critic}})

    class Broken:
        def state_dict(self):
            return {"x": object()}  # not readable by a safe load: refused at the snapshot

        def load_state_dict(self, sd):
            pass

    with pytest.raises(cg.ConfigError, match="role 'critic'"):
        run.save(2, {"actor": {"model": model}, "critic": {"model": critic, "broken": Broken()}})
    set_fault_hook(
        "run.before_manifest", lambda: (_ for _ in ()).throw(OSError(28, "No space left on device"))
    )
    try:
        with pytest.raises(cg.CheckpointWriteError, match="No space left"):
            run.save(2, {"actor": {"model": model}, "critic": {"model": critic}})
    finally:
        set_fault_hook("run.before_manifest", None)
    assert run.committed_steps() == [1] and not list(root.glob(".tmp-*"))
    assert run.resolve().step == 1
    wrong = cg.RunCheckpoint(root, [cg.Role("actor")], config=_config())
    with pytest.raises(cg.ResumeError, match=r"role\(s\) \['critic'\] would not be restored"):
        wrong.restore({"actor": {"model": model}})


def test_operator_commands_read_a_run_root(tmp_path):
    from click.testing import CliRunner

    from ckptguard.cli import main

    root = tmp_path / "ckpt"
    run = cg.RunCheckpoint(root, [cg.Role("actor"), cg.Role("driver")], config=_config())
    model = torch.nn.Linear(2, 2)
    for step in (1, 2):
        run.save(step, {"actor": {"model": model}, "driver": {"n": step}})
    cli = CliRunner()
    assert "resume from step 2" in cli.invoke(main, ["resolve", str(root)]).output
    listing = cli.invoke(main, ["list", str(root)]).output
    assert listing.count("committed (run step: actor, driver)") == 2, listing
    ok = cli.invoke(main, ["verify", str(root), "--deep"])
    assert ok.exit_code == 0 and "0 finding(s)" in ok.output, ok.output
    (root / NAMING.name(2) / "driver" / "rank_00000.pt").unlink()
    bad = cli.invoke(main, ["verify", str(root)])
    assert bad.exit_code == 1 and "role 'driver'" in bad.output and "missing-file" in bad.output, (
        bad.output
    )
    refused = cli.invoke(main, ["resolve", str(root)])
    assert refused.exit_code == 1 and "missing role 'driver'" in refused.output, refused.output
    assert "NOT committed" in cli.invoke(main, ["list", str(root)]).output


@pytest.mark.parametrize(
    "point",
    ["run.role_written", "run.before_manifest", "commit.before_rename", "commit.before_tracker"],
)
def test_sigkill_at_each_run_point_keeps_the_previous_step(tmp_path, point):
    """One process (forked, so no interpreter start): SIGKILLed at ``point`` of the save of step
    2."""
    root = tmp_path / "ckpt"
    roles = [cg.Role("actor"), cg.Role("critic"), cg.Role("driver")]

    def states(value: float) -> dict:
        torch.manual_seed(0)
        model, critic = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
        with torch.no_grad():
            model.weight.fill_(value)
        return {"actor": {"model": model}, "critic": {"model": critic}, "driver": {"n": value}}

    pid = os.fork()
    if pid == 0:  # the child saves step 1, then dies in the save of step 2
        try:
            run = cg.RunCheckpoint(root, roles, config=_config())
            run.save(1, states(1.0))
            set_fault_hook(point, lambda: os.kill(os.getpid(), signal.SIGKILL))
            run.save(2, states(2.0))
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == -signal.SIGKILL
    run = cg.RunCheckpoint(root, roles, config=_config())
    target = states(0.0)
    assert run.restore(target) == 1  # the previous step, every role
    assert (
        torch.equal(target["actor"]["model"].weight, torch.ones(3, 3))
        and target["driver"]["n"] == 1.0
    )
    if (
        point == "commit.before_tracker"
    ):  # renamed but not tracked: a complete orphan, ignored and replaced
        assert (root / NAMING.name(2) / "manifest.json").is_file()
        assert (
            "orphan"
            in dict((p.name, why) for p, why in _gc.gc(root, NAMING, force=True).kept)[
                NAMING.name(2)
            ]
        )
    else:
        assert not (root / NAMING.name(2)).exists()
    run.save(
        2, states(2.0)
    )  # the relaunch commits step 2 again (the dead save's leftovers are swept or replaced)
    assert run.committed_steps() == [1, 2] and not list(root.glob(".tmp-*"))
    assert verify_step(root / NAMING.name(2), deep=True) == []
