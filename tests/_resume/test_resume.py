"""Exact resume: the resume-equivalence oracle, resolve's cases, topology, versions, strictness."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

import ckptguard as cg
from ckptguard import ReshardOptions, StateOptions, StorageOptions
from ckptguard._disk import layout as _layout
from ckptguard.demo.toyjob import build_job, fingerprint, train_step
from ckptguard.testing import run_ranks, values

K, N = 4, 9


def _train_then_die(rank: int, world: int, root: str) -> None:
    job = build_job(rank=rank, world=world)
    mgr = cg.CheckpointManager(root)
    for step in range(1, N + 1):
        train_step(job)
        if step == K:
            mgr.save(K, job.state())
        if step == K + 2:
            os.kill(os.getpid(), signal.SIGKILL)


def _resume_and_reference(rank: int, world: int, root: str) -> dict:
    out = {}
    for label, restore_rng in (("resumed", True), ("no_rng", False)):
        job = build_job(rank=rank, world=world)
        cfg = cg.CheckpointConfig(state=StateOptions(restore_rng=restore_rng))
        start = cg.CheckpointManager(root, config=cfg).restore(job.state())
        losses = [train_step(job) for _ in range(start + 1, N + 1)]
        out[label] = {"start": start, "losses": losses, "fp": fingerprint(job)}
    job = build_job(rank=rank, world=world)
    losses = [train_step(job) for _ in range(N)]
    out["straight"] = {"losses": losses[K:], "fp": fingerprint(job)}
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_resume_equivalence_oracle(tmp_path, world):
    root = str(tmp_path / "ck")
    died = run_ranks(_train_then_die, world, root, distributed=world > 1)
    assert all(r.exitcode == -signal.SIGKILL for r in died), died
    for r in values(run_ranks(_resume_and_reference, world, root, distributed=world > 1)):
        assert r["resumed"]["start"] == K
        assert r["resumed"]["losses"] == r["straight"]["losses"]  # bitwise: float equality
        assert r["resumed"]["fp"] == r["straight"]["fp"]  # every parameter and optimizer tensor
        # Negative control: without the RNG streams the same oracle fails.
        assert r["no_rng"]["losses"] != r["straight"]["losses"]
        assert r["no_rng"]["fp"] != r["straight"]["fp"]


# ---------------------------------------------------------------- resolve


def _saved(tmp_path: Path, steps=(1, 2)) -> tuple[cg.CheckpointManager, Path]:
    root = tmp_path / "ck"
    mgr = cg.CheckpointManager(root)
    job = build_job()
    for s in steps:
        train_step(job)
        mgr.save(s, job.state())
    return mgr, root


def test_resolve_modes(tmp_path):
    mgr, root = _saved(tmp_path)
    res = mgr.resolve()
    assert (res.step, res.path, res.fresh) == (2, root / "step_00000002", False)
    never = mgr.resolve(mode=cg.ResumeMode.NEVER)
    assert never.fresh and "2 step directories" in never.reason
    explicit = mgr.resolve(path=root / "step_00000001")
    assert (explicit.step, explicit.reason) == (1, "explicit path")
    with pytest.raises(cg.ConfigError, match="ResumeMode"):
        mgr.resolve(mode="auto")


def test_resolve_refuses_steps_without_tracker(tmp_path):
    mgr, root = _saved(tmp_path)
    (root / _layout.TRACKER_NAME).unlink()
    with pytest.raises(cg.ResumeError, match="no tracker"):
        mgr.resolve()


def test_resolve_refuses_tracker_pointing_at_uncommitted_step(tmp_path):
    mgr, root = _saved(tmp_path)
    (root / "step_00000002" / "manifest.json").unlink()
    with pytest.raises(cg.ResumeError, match="points at step 2"):
        mgr.resolve()
    with pytest.raises(cg.CheckpointIncompleteError, match="never committed"):
        mgr.resolve(path=root / "step_00000002")
    assert mgr.committed_steps() == [1]


def test_tracker_zero_is_declared_fresh_start(tmp_path):
    root = tmp_path / "ck"
    root.mkdir()
    _layout.write_tracker(root, 0)
    mgr = cg.CheckpointManager(root)
    assert mgr.resolve().fresh
    with pytest.raises(cg.ResumeError, match="MUST"):
        mgr.resolve(mode=cg.ResumeMode.MUST)


def test_restore_logs_one_line_with_path_and_step(tmp_path, caplog):
    mgr, root = _saved(tmp_path)
    caplog.set_level(logging.INFO, logger="ckptguard")
    caplog.clear()  # the two "committed" lines of the saves
    assert mgr.restore(build_job().state()) == 2
    lines = [r.getMessage() for r in caplog.records if r.name == "ckptguard"]
    assert len(lines) == 1 and "step 2" in lines[0] and str(root / "step_00000002") in lines[0]
    caplog.clear()
    caplog.set_level(logging.WARNING, logger="ckptguard")
    cg.CheckpointManager(tmp_path / "absent").restore(build_job().state())
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "FRESH START" in caplog.records[0].getMessage()


def _save_two_ranks(rank: int, world: int, root: str) -> dict:
    job = build_job(rank=rank, world=world)
    mgr = cg.CheckpointManager(root)
    train_step(job)
    mgr.save(1, job.state())
    train_step(job)
    mgr.save(2, job.state())
    full = {n: p.full_tensor() for n, p in job.model.named_parameters()}
    return {n: t.tolist() for n, t in full.items()}


def _disagree(rank: int, world: int, roots: list[str]) -> list[str]:
    out = []
    for root in roots:  # one "node-local" root per rank
        mgr = cg.CheckpointManager(root[rank], config=cg.CheckpointConfig(timeout_s=20))
        try:
            mgr.restore(build_job(rank=rank, world=world).state())
            out.append("restored")
        except cg.RankDisagreementError as exc:
            out.append(str(exc))
    return out


def test_ranks_that_disagree_all_raise_together(tmp_path):
    a = tmp_path / "node0"
    full = values(run_ranks(_save_two_ranks, 2, str(a)))[0]
    older = tmp_path / "node1_older"
    shutil.copytree(a, older)
    _layout.write_tracker(older, 1)
    missing = tmp_path / "node1_missing"
    shutil.copytree(a, missing)
    (missing / "step_00000002" / "rank_00001.pt").unlink()
    cases = [[str(a), str(older)], [str(a), str(missing)], [str(a), str(a)]]
    for rank_view in values(run_ranks(_disagree, 2, cases)):
        different, lacking, same = rank_view
        assert "rank 0: step 2" in different and "rank 1: step 1" in different
        assert "rank 1" in lacking and "rank_00001.pt" in lacking and "rank 0 " not in lacking
        assert same == "restored"

    # The same checkpoint on one rank: a topology change is refused, naming both...
    job = build_job()
    before = fingerprint(job)
    with pytest.raises(cg.TopologyMismatchError, match=r"'world_size': 2.*'world_size': 1"):
        cg.CheckpointManager(a).restore(job.state())
    assert fingerprint(job) == before  # refused before anything was read
    # ...unless resharding is declared: DCP reshards the FSDP2 shards into full tensors.
    rules = ReshardOptions(rule=cg.ReshardRule.BY_ITEM, rng_seed=0, replicated=("sched", "loader"))
    cfg = cg.CheckpointConfig(reshard=rules)
    assert cg.CheckpointManager(a, config=cfg).restore(job.state()) == 2
    assert {n: p.tolist() for n, p in job.model.named_parameters()} == full
    assert job.loader.cursor == 2


# ---------------------------------------------------------------- versions, strictness, contract


def test_checkpoint_from_newer_torch_is_reported_before_reading(tmp_path):
    mgr, root = _saved(tmp_path)
    path = root / "step_00000002" / "manifest.json"
    data = json.loads(path.read_text())
    data["versions"]["torch"] = "99.1.0"
    path.write_text(json.dumps(data))
    job = build_job(seed=3)
    before = fingerprint(job)
    with pytest.raises(cg.VersionMismatchError, match=r"torch 99\.1\.0"):
        mgr.restore(job.state())
    assert fingerprint(job) == before
    ok = cg.CheckpointManager(
        root, config=cg.CheckpointConfig(storage=StorageOptions(allow_newer_torch=True))
    )
    assert ok.restore(job.state()) == 2


def test_missing_and_unexpected_items_and_keys_raise(tmp_path):
    mgr, _root = _saved(tmp_path)
    job = build_job()
    with pytest.raises(
        cg.StateMismatchError, match=r"absent from the checkpoint: \['extra_optim'\]"
    ):
        mgr.restore({**job.state(), "extra_optim": torch.optim.SGD(job.model.parameters(), lr=0.1)})
    state = job.state()
    del state["optim"]
    with pytest.raises(cg.StateMismatchError, match=r"not given to restore: \['optim'\]"):
        mgr.restore(state)
    bigger = build_job()
    bigger.model.append(torch.nn.Linear(1, 1))
    with pytest.raises(cg.StateMismatchError, match=r"model.7.weight"):
        mgr.restore(
            {
                "model": bigger.model,
                "optim": torch.optim.Adam(bigger.model.parameters()),
                "sched": bigger.sched,
                "loader": bigger.loader,
            }
        )


class ForgetfulScheduler:
    """Restores its LR from a source default instead of the saved value."""

    def __init__(self) -> None:
        self.lr = 0.1

    def state_dict(self) -> dict:
        return {"lr": self.lr}

    def load_state_dict(self, sd: dict) -> None:
        self.lr = 0.1


def test_scheduler_whose_restored_value_differs_raises(tmp_path):
    mgr = cg.CheckpointManager(tmp_path / "ck")
    sched = ForgetfulScheduler()
    sched.lr = 0.025
    mgr.save(1, {"sched": sched})
    with pytest.raises(cg.StateMismatchError, match=r"'sched'.*differs after restore"):
        mgr.restore({"sched": ForgetfulScheduler()})


def test_run_contract_change_raises_until_phase_declared(tmp_path):
    root = tmp_path / "ck"
    base = cg.RunContract(code="git:abc", recipe={"lr": 1e-3, "bs": 8}, total_steps=100)
    job = build_job()
    cg.CheckpointManager(root, config=cg.CheckpointConfig(contract=base)).save(1, job.state())
    phase0 = (root / "contract/phase_0000.json").read_bytes()

    longer = cg.RunContract(code="git:abc", recipe={"lr": 2e-3, "bs": 8}, total_steps=200)
    mgr = cg.CheckpointManager(root, config=cg.CheckpointConfig(contract=longer))
    with pytest.raises(cg.ContractMismatchError) as err:
        mgr.restore(build_job().state())
    assert "recipe.lr: 0.001 -> 0.002" in str(err.value) and "total_steps: 100 -> 200" in str(
        err.value
    )
    with pytest.raises(cg.ContractMismatchError, match="save of step 2"):
        mgr.save(2, job.state())
    with pytest.raises(cg.ContractMismatchError, match="declared \\['total_steps'\\]"):
        mgr.declare_phase("train longer", ["total_steps"])
    path = mgr.declare_phase("train longer at a higher LR", ["recipe", "total_steps"])
    assert path.name == "phase_0001.json"
    assert (root / "contract/phase_0000.json").read_bytes() == phase0
    assert mgr.restore(build_job().state()) == 1
    with pytest.raises(cg.ContractMismatchError):
        cg.CheckpointManager(root, config=cg.CheckpointConfig(contract=base)).restore(
            build_job().state()
        )


def test_contract_hash_helpers(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"x" * 10)
    h1 = cg.hash_data_files([tmp_path / "a.bin"])
    (tmp_path / "a.bin").write_bytes(b"y" * 10)
    assert cg.hash_data_files([tmp_path / "a.bin"]) != h1
    assert cg.hash_recipe({"a": 1, "b": 2}) == cg.hash_recipe({"b": 2, "a": 1})
    assert cg.hash_imported_files(["ckptguard"]).startswith("sources:")
    with pytest.raises(cg.ConfigError, match="no Python source files"):
        cg.hash_imported_files(["no_such_pkg_xyz"])
    repo = Path(__file__).resolve().parents[2]
    if (repo / ".git").exists():
        assert cg.hash_git_tree(repo).startswith("git:")
    with pytest.raises(cg.ConfigError, match="not a git work tree"):
        cg.hash_git_tree(tmp_path)
