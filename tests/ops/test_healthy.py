"""Healthy steps only: an unhealthy step is never committed, committed steps become verified,
retention keeps the newest verified one and ``prefer="verified"`` resumes it.

The multi-rank scenario runs the toy job (FSDP2 over gloo) on 2 real ranks: it saves every step
and records every step's loss; at step 6 only rank 1 sees a NaN loss.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckptguard as cg
from ckptguard._records import trust as _trust
from ckptguard.cli import main
from ckptguard.demo.toyjob import build_job, train_step
from ckptguard.testing import run_ranks, values

NAN_AT = 6


def _config(**health) -> cg.CheckpointConfig:
    return cg.CheckpointConfig(
        timeout_s=60, retention=cg.KeepLast(2), health=cg.HealthPolicy(verify_after=2, **health)
    )


def _nan_run(rank: int, world: int, root: str) -> dict:
    job = build_job(rank=rank, world=world)
    mgr = cg.CheckpointManager(root, config=_config())
    assert mgr.restore(job.state()) == 0
    results = {}
    for step in range(1, NAN_AT + 1):
        loss = train_step(job)
        if step == NAN_AT and rank == 1:
            loss = math.nan  # one rank's NaN must skip the save on both
        mgr.record_step(step, loss=loss)
        path = mgr.save(step, job.state())
        results[step] = None if path is None else path.name
    assert mgr.last_health is not None
    return {"saved": results, "skip": mgr.last_health.skip, "reasons": mgr.last_health.reasons}


def _resume(rank: int, world: int, root: str, prefer: str | None) -> tuple[int, str]:
    job = build_job(rank=rank, world=world)
    mgr = cg.CheckpointManager(root, config=_config())
    res = mgr.resolve(prefer=prefer)
    return mgr.restore(job.state(), prefer=prefer), res.reason


@pytest.fixture(scope="module")
def nan_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("health") / "ckpt"
    out = values(run_ranks(_nan_run, 2, str(root)))
    for rank in out:
        assert rank["saved"][NAN_AT] is None, rank  # not committed, on both ranks
        assert all(rank["saved"][s] for s in range(1, NAN_AT)), rank
        assert rank["skip"] and list(rank["reasons"]) == ["1"], (
            rank
        )  # rank 1's reason, seen by rank 0 too
        assert "loss is nan (record_step of step 6)" in rank["reasons"]["1"][0]
    return root


def test_a_nan_loss_on_one_rank_commits_nothing_and_the_tracker_stays(nan_root):
    assert (nan_root / "latest_checkpointed_iteration.txt").read_text().strip() == str(NAN_AT - 1)
    assert not (nan_root / f"step_{NAN_AT:08d}").exists()
    assert not [p for p in nan_root.iterdir() if p.name.startswith(".tmp-")]  # nothing was written


def test_steps_become_verified_after_n_healthy_steps_and_a_nan_blocks_the_newer_ones(nan_root):
    trust = _trust.read(nan_root)
    # 3 was followed by the healthy steps 4 and 5 (N=2); 4 and 5 by the NaN step 6 first
    assert _trust.state(trust[3]) is _trust.Trust.VERIFIED and trust[3].healthy_after == (4, 5)
    for step in (4, 5):
        assert _trust.state(trust[step]) is _trust.Trust.CANDIDATE
        assert trust[step].unhealthy_after == NAN_AT
    # the sidecar is outside the step directories: committed manifests stay as written
    assert not (nan_root / "step_00000003" / _trust.TRUST_NAME).exists()


def test_retention_keeps_the_newest_verified_step(nan_root):
    kept = sorted(p.name for p in nan_root.glob("step_*"))
    # KeepLast(2) alone keeps 4 and 5; 3 is the newest verified step, 1 and 2 were rotated out
    assert kept == ["step_00000003", "step_00000004", "step_00000005"]


def test_prefer_verified_resumes_the_newest_verified_step(nan_root):
    verified = values(run_ranks(_resume, 2, str(nan_root), "verified"))
    assert [step for step, _ in verified] == [3, 3]
    assert "newest verified step" in verified[0][1] and "rollback" in verified[0][1]
    latest = values(run_ranks(_resume, 2, str(nan_root), None))
    assert [step for step, _ in latest] == [5, 5]


def test_ckptguard_list_shows_the_trust_state(nan_root):
    runner = CliRunner()
    out = runner.invoke(main, ["list", str(nan_root), "--json"])
    assert out.exit_code == 0, out.output
    trust = {e["step"]: e["trust"] for e in json.loads(out.output)["entries"]}
    assert trust[3] == "verified"
    assert trust[5].startswith("candidate (unhealthy step 6 followed it")
    text = runner.invoke(main, ["list", str(nan_root)])
    assert "step_00000003  [verified]" in text.output
    resolved = runner.invoke(main, ["resolve", str(nan_root), "--prefer", "verified", "--json"])
    assert json.loads(resolved.output)["step"] == 3


# ---------------------------------------------------------------- one process


def _state() -> dict:
    return {"w": torch.arange(4.0), "n": cg.PerRank(1)}


def test_healthy_false_a_failed_check_and_a_non_finite_argument_skip_the_save(tmp_path, caplog):
    root = tmp_path / "ck"
    mgr = cg.CheckpointManager(root, config=_config(check=lambda step, m: m.get("loss", 0.0) < 10))
    assert mgr.save(1, _state()) is not None
    with caplog.at_level(logging.ERROR, logger="ckptguard"):
        assert mgr.save(2, _state(), healthy=False) is None
        assert mgr.save(3, _state(), loss=100.0) is None
        assert mgr.save(4, _state(), grad_norm=torch.tensor(float("inf"))) is None
        assert mgr.save_async(5, _state(), loss=float("nan")) is None
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert "step 2 NOT committed" in messages[0] and "healthy=False" in messages[0]
    assert "HealthPolicy.check returned False" in messages[1] and "loss=100.0" in messages[1]
    assert (
        "grad_norm is inf (save of step 4)" in messages[2] and "tracker stays at 1" in messages[2]
    )
    assert mgr.committed_steps() == [1] and mgr.last_health is not None and mgr.last_health.skip
    # a healthy step still commits; the recorded steps count towards verification
    mgr.record_step(6, loss=0.5)
    assert mgr.save(7, _state(), loss=0.25) is not None
    assert mgr.committed_steps() == [1, 7]


def test_prefer_verified_with_nothing_verified(tmp_path):
    root = tmp_path / "ck"
    mgr = cg.CheckpointManager(root, config=_config())
    mgr.save(1, _state())
    res = mgr.resolve(prefer="verified")
    assert res.step == 1 and "no step is verified yet" in res.reason
    mgr.record_step(2, loss=float("nan"))  # step 1 was followed by an unhealthy step
    assert mgr.save(2, _state()) is None
    with pytest.raises(cg.ResumeError, match="followed by the unhealthy step 2"):
        mgr.resolve(prefer="verified")
    with pytest.raises(cg.ConfigError, match="'latest' or 'verified'"):
        mgr.resolve(prefer="newest")


def test_an_unreadable_trust_record_stops_rotation(tmp_path):
    root = tmp_path / "ck"
    mgr = cg.CheckpointManager(root, config=cg.CheckpointConfig(retention=cg.KeepLast(1)))
    mgr.save(1, _state())
    (root / _trust.TRUST_NAME).write_text("{not json")
    mgr.save(2, _state())
    mgr.save(3, _state())
    assert mgr.committed_steps() == [1, 2, 3]  # nothing deleted while the record cannot be read
    listing = json.loads(CliRunner().invoke(main, ["list", str(root), "--json"]).output)
    assert listing["entries"][0]["trust"].startswith("unknown")


def test_a_step_of_an_abandoned_trajectory_is_not_verified_by_the_new_one(tmp_path):
    root = tmp_path / "ck"
    cfg = cg.CheckpointConfig(health=cg.HealthPolicy(verify_after=1))
    first = cg.CheckpointManager(root, config=cfg)
    first.save(1, _state())
    first.save(2, _state())  # a healthy step after 1: 1 is verified, 2 a candidate
    assert _trust.state(_trust.read(root)[1]) is _trust.Trust.VERIFIED
    # a new run branches off step 1 (restore(path=...)); its steps 2 and 3 are not the old run's
    second = cg.CheckpointManager(root, config=cfg)
    assert second.restore(_state(), path=root / "step_00000001") == 1
    second.record_step(2, loss=0.5)
    second.save(3, _state(), loss=0.5)
    trust = _trust.read(root)
    assert _trust.state(trust[2]) is _trust.Trust.CANDIDATE and trust[2].healthy_after == ()
    second.save(4, _state(), loss=0.5)
    assert (
        _trust.state(_trust.read(root)[3]) is _trust.Trust.VERIFIED
    )  # its own commits are verified


def test_gc_orphans_never_removes_the_newest_verified_step(tmp_path):
    from ckptguard._disk.layout import StepNaming, write_tracker
    from ckptguard.ops.gc import gc

    root = tmp_path / "ck"
    mgr = cg.CheckpointManager(
        root, config=cg.CheckpointConfig(health=cg.HealthPolicy(verify_after=1))
    )
    mgr.save(1, _state())
    mgr.save(2, _state())  # 1 is verified
    write_tracker(root, 0)  # both steps are now newer than the tracker: orphans
    report = gc(root, StepNaming("step_{step:08d}"), orphans=True, force=True)
    assert [p.name for p, _ in report.removed if p.name.startswith("step_")] == ["step_00000002"]
    assert any("newest verified step" in why for p, why in report.kept if p.name == "step_00000001")
    assert (root / "step_00000001" / "manifest.json").exists()


def _bad_argument_on_rank_1(rank: int, world: int, root: str) -> str:
    mgr = cg.CheckpointManager(root, config=cg.CheckpointConfig(timeout_s=30))
    try:
        mgr.save(1, {"w": torch.zeros(2)}, loss=[1.0, 2.0] if rank == 1 else 0.5)
    except cg.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "saved"


def test_a_bad_health_argument_on_one_rank_fails_the_save_on_every_rank_without_a_hang(tmp_path):
    out = values(run_ranks(_bad_argument_on_rank_1, 2, str(tmp_path / "ck"), timeout=120))
    assert all(o.startswith("ConfigError") and "not a number or string" in o for o in out), out
    assert not (tmp_path / "ck").exists()  # nothing was written, not even the root


def test_a_skipped_step_stays_skipped_when_saved_again_until_a_restore_abandons_it(tmp_path):
    # A second save of the same step (a preemption save at that boundary, or a plain retry) has no
    # metrics left to judge it by; it must not commit the step the first save skipped as unhealthy.
    model = torch.nn.Linear(4, 4)
    state = {"model": model}
    mgr = cg.CheckpointManager(tmp_path / "ck", config=_config())
    assert mgr.save(1, state) is not None
    mgr.record_step(2, loss=math.nan)
    assert mgr.save(2, state) is None
    assert mgr.save(2, state) is None, "the unhealthy step 2 was committed by a second save"
    assert "earlier save of step 2 was skipped" in mgr.last_health.describe()
    assert mgr.committed_steps() == [1]
    assert mgr.restore(state) == 1  # a rollback: step 2 is replayed on a new trajectory
    assert mgr.save(2, state) is not None
    assert mgr.committed_steps() == [1, 2]
