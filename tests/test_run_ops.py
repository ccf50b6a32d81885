"""RunCheckpoint against the single-manager API, on 2 real gloo ranks: an actor on ranks {0,1}, a
critic on rank 1 and a driver on rank 0.

- Healthy steps: a NaN loss on the critic's rank skips the save on every rank of every role; the
  trust record of the run promotes the older step; ``prefer="verified"`` resumes it on every role.
- Operator commands on the run root: ``prove`` (per-role gates, one run-step gate), ``preflight``
  (per-role placement, a step missing a role is NOT READY naming it), ``status``; ``--json`` too.
- Node-local roots are refused before anything is written, on every rank alike.
- PreemptionGuard on a RunCheckpoint: a SIGTERM on one rank commits every role, exit 75; a grace
  time too short for the measured save exits 76 with nothing written.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckptguard as cg
from ckptguard import ProofPlan
from ckptguard.cli import main
from ckptguard.testing import fake_node, run_ranks, values

ROLES = [
    cg.Role("actor", ranks=(0, 1)),
    cg.Role("critic", ranks=(1,)),
    cg.Role("driver", ranks=(0,)),
]


def _config(prefer: str = "latest") -> cg.CheckpointConfig:
    return cg.CheckpointConfig(
        timeout_s=30.0, retention=None, health=cg.HealthPolicy(verify_after=1, prefer=prefer)
    )


def _states(rank: int, value: float) -> dict:
    torch.manual_seed(0)
    actor, critic = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
    with torch.no_grad():
        actor.weight.fill_(value)
        critic.bias.fill_(value)
    out = {"actor": {"model": actor}}
    out.update({"critic": {"model": critic}} if rank == 1 else {"driver": {"n": value}})
    return out


def _values(rank: int, states: dict) -> dict:
    out = {"actor": float(states["actor"]["model"].weight[0, 0])}
    if rank == 1:
        out["critic"] = float(states["critic"]["model"].bias[0])
    else:
        out["driver"] = states["driver"]["n"]
    return out


def _record(run: cg.RunCheckpoint, rank: int, step: int, loss: float) -> None:
    for role in run.my_roles:  # rank 1: the actor's record first, then the critic's (finite) one
        run.record_step(
            step,
            sample_ids=[step * 10 + rank],
            loss=loss if role == "actor" else 1.0,
            grad_norm=1.0,
            role=role,
        )
        run.record_update(step, grad_norm=1.0, params_changed=True, role=role)


def _train_worker(rank: int, world: int, root: str) -> dict:
    run = cg.RunCheckpoint(root, ROLES, config=_config())
    assert run.restore(_states(rank, 0.0)) == 0
    out = {}
    for step in (1, 2, 3):
        # Step 3: the actor's loss is NaN on rank 1 only, passed to nobody's save: its record_step
        # is the evidence, and the critic's finite record of the same step on that rank must not
        # hide it.
        _record(run, rank, step, float("nan") if step == 3 and rank == 1 else 1.0)
        saved = run.save(step, _states(rank, float(step)))
        out[step] = None if saved is None else saved.name
    out["skip"] = run.last_health.skip
    out["why"] = run.last_health.describe()
    out["committed"] = run.committed_steps()
    return out


def _resume_worker(rank: int, world: int, root: str) -> dict:
    run = cg.RunCheckpoint(root, ROLES, config=_config(prefer="verified"))
    states = _states(rank, -1.0)
    start = run.restore(states)
    restored = _values(rank, states)
    _record(run, rank, start + 1, 1.0)  # the replayed step: the same ids as the killed run's step 2
    return {"start": start, "restored": restored}


def test_health_trust_prefer_and_the_operator_commands_on_a_run_root(tmp_path):
    root = tmp_path / "ckpt"
    for rank, out in enumerate(values(run_ranks(_train_worker, 2, str(root)))):
        assert out[1] == "step_00000001" and out[2] == "step_00000002"
        assert out[3] is None and out["skip"], (
            f"rank {rank}: the unhealthy step 3 was not skipped: {out}"
        )
        assert out["why"] == "rank 1: loss is nan (record_step of role 'actor', step 3)", out["why"]
        assert out["committed"] == [1, 2]
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert not (root / "step_00000003").exists() and not list(root.glob(".tmp-*"))
    trust = json.loads((root / "trust.json").read_text())["steps"]
    assert trust["1"]["state"] == "verified" and trust["2"]["state"] == "candidate"
    assert trust["2"]["unhealthy_after"] == 3
    cli = CliRunner()
    assert "[verified" in cli.invoke(main, ["list", str(root)]).output

    # prefer="verified": every role resumes step 1 (a rollback past the candidate step 2) in new
    # processes.
    for rank, out in enumerate(values(run_ranks(_resume_worker, 2, str(root)))):
        assert out["start"] == 1
        want = {"actor": 1.0, **({"critic": 1.0} if rank == 1 else {"driver": 1.0})}
        assert out["restored"] == want, f"rank {rank}: {out['restored']}"

    # prove: one run-step gate, then every role's gates, each line naming its role.
    proved = cli.invoke(main, ["prove", str(root)])
    assert proved.exit_code == 0 and "resume PROVEN" in proved.output, proved.output
    lines = proved.output.splitlines()[1:-2]
    assert all(any(r in line for r in ("actor", "critic", "driver")) for line in lines), (
        proved.output
    )
    gates = {
        g["gate"]: g
        for g in json.loads(cli.invoke(main, ["prove", str(root), "--json"]).output)["gates"]
    }
    assert gates["every role restored one run step"]["status"] == "PASS"
    for role in ("actor", "critic", "driver"):
        assert gates[f"{role}: all PIDs changed"]["status"] == "PASS"
        assert gates[f"{role}: data order identical"]["status"] == "PASS", gates[
            f"{role}: data order identical"
        ]
        assert gates[f"{role}: digests equal, item by item"]["status"] == "PASS"

    # preflight: READY with the run's placement (role by role), a world-size mismatch otherwise.
    hosts = tmp_path / "hosts"
    hosts.write_text("0 h0\n1 h1\n")
    ready = cli.invoke(main, ["preflight", str(root), "--rank-hosts", str(hosts), "--json"])
    report = json.loads(ready.output)
    assert ready.exit_code == 0 and report["ok"] and report["step"] == 2, ready.output
    assert report["roles"] == {"actor": [0, 1], "critic": [1], "driver": [0]}
    hosts.write_text("0 h0\n")
    wrong = cli.invoke(main, ["preflight", str(root), "--rank-hosts", str(hosts)])
    assert wrong.exit_code == 1 and "world-size" in wrong.output and "2 ranks" in wrong.output, (
        wrong.output
    )

    # status on the run root without phase records: the root's state (a resume would take step 2:
    # exit 0), naming the roles each rank holds; with records, each rank's line names the roles it
    # holds.
    none = cli.invoke(main, ["status", str(root), "--json"])
    assert none.exit_code == 0 and "newest committed step 2" in none.output, none.output
    assert "RunCheckpoint root of roles ['actor', 'critic', 'driver']" in none.output, none.output
    assert "1: actor, critic" in none.output, none.output
    from ckptguard.memory import PhaseKind, PhaseRecorder, RecorderConfig

    for rank in (0, 1):
        with (
            PhaseRecorder(RecorderConfig(path=root / f"phases_{rank}.jsonl", rank=rank)) as rec,
            rec.phase(PhaseKind.SAVE, step=2),
        ):
            pass
    shown = cli.invoke(main, ["status", str(root), "--sample", "0.05"])
    assert (
        "rank 0   (actor, driver)" in shown.output and "rank 1   (actor, critic)" in shown.output
    ), shown.output
    assert [
        r["roles"]
        for r in json.loads(
            cli.invoke(main, ["status", str(root), "--sample", "0.05", "--json"]).output
        )
    ] == [["actor", "driver"], ["actor", "critic"]]

    # A step missing a role: preflight NOT READY naming it; prove FAILs naming it (the restored step
    # 1).
    shutil.rmtree(root / "step_00000002" / "critic")
    shutil.rmtree(root / "step_00000001" / "critic")
    bad = cli.invoke(main, ["preflight", str(root)])
    assert (
        bad.exit_code == 1 and "NOT READY" in bad.output and "missing role 'critic'" in bad.output
    ), bad.output
    bad_json = json.loads(cli.invoke(main, ["preflight", str(root), "--json"]).output)
    assert not bad_json["ok"] and "missing role 'critic'" in bad_json["findings"][0]["message"]
    failed = json.loads(cli.invoke(main, ["prove", str(root), "--json"]).output)
    gate = next(g for g in failed["gates"] if g["gate"] == "every role restored one run step")
    assert (
        not failed["proven"]
        and gate["status"] == "FAIL"
        and "missing role 'critic'" in gate["evidence"]
    ), gate


def test_preflight_reads_a_run_root_and_names_a_missing_role(tmp_path):
    root = tmp_path / "ckpt"
    run = cg.RunCheckpoint(
        root, [cg.Role("actor"), cg.Role("driver")], config=cg.CheckpointConfig(retention=None)
    )
    run.save(1, {"actor": {"model": torch.nn.Linear(2, 2)}, "driver": {"n": 1}})
    cli = CliRunner()
    hosts = tmp_path / "hosts"
    hosts.write_text("h0\n")
    ok = cli.invoke(main, ["preflight", str(root), "--hosts", str(hosts)])
    assert ok.exit_code == 0 and "READY" in ok.output and "actor (ranks [0])" in ok.output, (
        ok.output
    )
    (root / "step_00000001" / "actor" / "rank_00000.pt").unlink()
    bad = json.loads(cli.invoke(main, ["preflight", str(root), "--json"]).output)
    assert not bad["ok"] and "missing role 'actor'" in bad["findings"][0]["message"], bad


def test_prove_on_a_run_root_without_records_is_not_run_for_every_role(tmp_path):
    root = tmp_path / "ckpt"
    run = cg.RunCheckpoint(
        root,
        [cg.Role("actor"), cg.Role("driver")],
        config=cg.CheckpointConfig(proof=ProofPlan(record=False), retention=None),
    )
    run.save(1, {"actor": {"model": torch.nn.Linear(2, 2)}, "driver": {"n": 1}})
    out = json.loads(CliRunner().invoke(main, ["prove", str(root), "--json"]).output)
    assert not out["proven"]
    gates = {g["gate"]: g["status"] for g in out["gates"]}
    assert gates["every role restored one run step"] == "MISSING"
    assert (
        gates["actor: all PIDs changed"] == "MISSING"
        and gates["driver: all PIDs changed"] == "MISSING"
    )
    assert "PASS" not in gates.values()


# ---------------------------------------------------------------- node-local roots


def _own_disk(base: Path, rank: int) -> Path:
    """This rank sees ``base/disk<rank>`` at ``base/shared`` (``fake_node``: node-local disks at one
    path, what a second node's local disk looks like)."""
    fake_node(f"node{rank}", disks={base / "shared": base / f"disk{rank}"})
    assert (base / "shared" / "marker").read_text() == str(rank)
    return base / "shared"


def _node_local_worker(rank: int, world: int, base: str) -> str:
    shared = _own_disk(Path(base), rank)
    run = cg.RunCheckpoint(shared / "ck", ROLES, config=_config())
    try:
        run.save(1, _states(rank, 1.0))
    except cg.ConfigError as exc:
        return str(exc)
    return "committed"


def test_node_local_roots_are_refused_before_anything_is_written(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root for private mount namespaces (two disks at one path)")
    for rank in (0, 1):
        (tmp_path / f"disk{rank}").mkdir()
        (tmp_path / f"disk{rank}" / "marker").write_text(str(rank))
    (tmp_path / "shared").mkdir()
    for message in values(run_ranks(_node_local_worker, 2, str(tmp_path))):
        assert (
            "ranks [1] do not see rank 0's disk" in message and "Nothing was written" in message
        ), message
    for rank in (0, 1):  # no root, tracker, contract or temp directory on either disk
        assert sorted(p.name for p in (tmp_path / f"disk{rank}").iterdir()) == ["marker"]


# ---------------------------------------------------------------- preemption


def _preempt(rank: int, root: str, grace_s: float, estimate: float | None) -> dict:
    run = cg.RunCheckpoint(root, ROLES, config=_config())
    with cg.PreemptionGuard(run, grace_s=grace_s, save_estimate_s=estimate) as guard:
        run.save(1, _states(rank, 1.0))
        for step in (2, 3, 4):
            if step == 3 and rank == 1:
                os.kill(
                    os.getpid(), signal.SIGTERM
                )  # the handler only notes it: the save is at the boundary
            if guard.should_stop(step, _states(rank, float(step))):
                return {
                    "step": step,
                    "code": guard.outcome.code,
                    "reason": guard.outcome.reason,
                    "committed": run.committed_steps(),
                }
    return {"step": None}


def _preempt_worker(rank: int, world: int, base: str) -> dict:
    # Fits: no estimate yet beyond this run's own save of step 1, 30 s of grace. Does not fit: a
    # measured save time of 5 s against a 1 s grace time.
    return {
        "fits": _preempt(rank, f"{base}/fits", 30.0, None),
        "late": _preempt(rank, f"{base}/late", 1.0, 5.0),
    }


def test_sigterm_on_one_rank_saves_every_role_or_exits_76(tmp_path):
    for o in values(run_ranks(_preempt_worker, 2, str(tmp_path))):
        fits, late = o["fits"], o["late"]
        assert fits["step"] == 3 and fits["code"] == 75 and fits["committed"] == [1, 3], fits
        assert "SIGTERM on rank 1" in fits["reason"], fits
        assert late["step"] == 3 and late["code"] == 76 and late["committed"] == [1], late
        assert "NOT saving step 3" in late["reason"], late
    assert (tmp_path / "fits" / "step_00000003" / "critic" / "manifest.json").is_file()
    assert (
        "resume from step 3" in CliRunner().invoke(main, ["resolve", str(tmp_path / "fits")]).output
    )
    assert not (tmp_path / "late" / "step_00000003").exists() and not list(
        (tmp_path / "late").glob(".tmp-*")
    )


# ---------------------------------------------------------------- save_async


def _async_worker(rank: int, world: int, root: str) -> dict:
    from ckptguard.testing import set_fault_hook

    run = cg.RunCheckpoint(root, ROLES, config=_config())
    states = _states(rank, 1.0)
    optim = torch.optim.SGD(states["actor"]["model"].parameters(), lr=1.0)
    states["actor"]["optim"] = optim
    pending = run.save_async(1, states)
    # Every saved value changes at once: the optimizer step (its pre-hook waits for the staged
    # copies), a manual change after staged(), a plain value. The commit in the background must not
    # see any of it.
    states["actor"]["model"](torch.ones(1, 3)).sum().backward()
    optim.step()
    run.staged()
    with torch.no_grad():
        if rank == 1:
            states["critic"]["model"].bias.fill_(-5.0)
        else:
            states["driver"]["n"] = 99.0
    first = pending.wait().name
    # A background commit that fails (rank 0's run manifest write) raises at wait() on every rank.
    if rank == 0:
        set_fault_hook(
            "run.before_manifest",
            lambda: (_ for _ in ()).throw(OSError(28, "No space left on device")),
        )
    run.save_async(2, _states(rank, 2.0))
    try:
        run.wait()
        failed = None
    except cg.CheckpointWriteError as exc:
        failed = str(exc)
    set_fault_hook("run.before_manifest", None)
    fresh = _states(rank, -1.0)
    fresh["actor"]["optim"] = torch.optim.SGD(fresh["actor"]["model"].parameters(), lr=1.0)
    start = run.restore(fresh)
    run.close()
    return {
        "first": first,
        "failed": failed,
        "start": start,
        "restored": _values(rank, fresh),
        "committed": run.committed_steps(),
    }


def test_save_async_commits_every_role_from_the_snapshot_and_raises_a_failure_on_every_rank(
    tmp_path,
):
    root = tmp_path / "ckpt"
    for rank, out in enumerate(values(run_ranks(_async_worker, 2, str(root)))):
        assert out["first"] == "step_00000001" and out["start"] == 1 and out["committed"] == [1], (
            out
        )
        assert out["failed"] is not None and "No space left" in out["failed"], out
        want = {"actor": 1.0, **({"critic": 1.0} if rank == 1 else {"driver": 1.0})}
        assert out["restored"] == want, (
            f"rank {rank}: the background commit saw a later change: {out['restored']}"
        )
    assert not (root / "step_00000002").exists() and not list(root.glob(".tmp-*"))
