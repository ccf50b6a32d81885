"""Replicas compared again at the first step after a restore, and a divergence at a later save
recorded (issue 39, item 3; the writing side), on 2 gloo ranks of a real DDP job.

Drift that appears after ``restore()`` returned (a hook, a late broadcast) passes the restore's own
replica check. The first ``record_step`` after the restore carries each rank's layout-free partials
of its replicated tensors (``replica_partials``), which ``replica_report`` turns into the differing
tensor and the ranks on each side; a ``save_async`` whose background guard then raises
``ReplicatedDivergenceError`` leaves a ``replicas`` record naming the tensor, and prove's replica
gate FAILs. An exact resume records the same digests on every rank.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

import ckptguard as cg
from ckptguard._resume.layoutcheck import describe_replicas, replica_report
from ckptguard.ops.prove import Status, evaluate
from ckptguard.testing import run_ranks, values


def _job(root: str):
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    mgr = cg.CheckpointManager(root, config=cg.CheckpointConfig(timeout_s=60))
    return net, model, opt, mgr, {"model": net, "optim": opt}


def _step(model, opt, mgr, step: int, rank: int) -> None:
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step * 10 + rank))
    loss = model(x).square().mean()
    loss.backward()  # DDP averages the gradients: replicas stay equal if they were
    opt.step()
    opt.zero_grad()
    mgr.record_step(step, sample_ids=[step * 2 + rank], loss=loss.item())


def _train_and_save(rank: int, world: int, root: str) -> None:
    _net, model, opt, mgr, state = _job(root)
    for step in (1, 2):
        _step(model, opt, mgr, step, rank)
    mgr.save(2, state)


def _resume(rank: int, world: int, root: str, drift: bool) -> str:
    net, model, opt, mgr, state = _job(root)
    step = mgr.restore(state)
    if drift and rank == 1:  # after restore() returned: what a late hook or broadcast does
        with torch.no_grad():
            net.weight.add_(1.0)
    _step(model, opt, mgr, step + 1, rank)
    mgr.save_async(step + 1, state)
    try:
        mgr.wait()
    except cg.ReplicatedDivergenceError as exc:
        return f"ReplicatedDivergenceError: {exc}"
    return "saved"


def _records(root: Path, rank: int) -> list[dict]:
    lines = (root / "proof" / f"rank_{rank:05d}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _first_step(root: Path, rank: int) -> dict:
    recs = _records(root, rank)
    restore = max(i for i, r in enumerate(recs) if r["event"] == "restore")
    return next(r for r in recs[restore:] if r["event"] == "step")


def test_drift_after_restore_is_named_at_the_first_step_and_at_the_next_save(tmp_path):
    saved = tmp_path / "saved"
    values(run_ranks(_train_and_save, 2, str(saved)))
    exact, drift = tmp_path / "exact", tmp_path / "drift"
    shutil.copytree(saved, exact)
    shutil.copytree(saved, drift)

    assert values(run_ranks(_resume, 2, str(exact), False)) == ["saved", "saved"]
    views = [_first_step(exact, r)["replica_partials"] for r in (0, 1)]
    assert views[0] and views[0] == views[1]  # the same chunks with the same bytes on both ranks
    report = replica_report(views)
    assert report["checked"] == len(views[0]) and report["differing"] == 0, report
    assert not any(r["event"] == "replicas" for rank in (0, 1) for r in _records(exact, rank))

    out = values(run_ranks(_resume, 2, str(drift), True))
    for text in out:  # the background guard refused the save on every rank
        assert (
            text.startswith("ReplicatedDivergenceError: save of step 3") and "model.weight" in text
        ), text
    first = [_first_step(drift, r) for r in (0, 1)]
    assert [f["step"] for f in first] == [3, 3]
    report = replica_report([f["replica_partials"] for f in first])
    named = describe_replicas(report)
    assert "'model.weight' (item 'model', offset (0, 0)): ranks [0] vs ranks [1]" in named, named
    assert (
        "model.bias" not in named
    )  # only the tensor that drifted (its Adam moments follow it later)
    for rank in (0, 1):
        later = [r for r in _records(drift, rank) if r["event"] == "replicas"]
        assert len(later) == 1 and later[0]["step"] == 3 and later[0]["ok"] is False, later
        assert "model.weight" in later[0]["error"], later[0]
    gate = {g.name: g for g in evaluate(drift)}["replicas equal after load"]
    assert gate.status is Status.FAIL and "model.weight" in gate.evidence, gate


def test_an_fsdp1_model_is_not_read_at_a_step_its_optimizer_state_dict_is_collective():
    from torch.distributed.fsdp import FullyShardedDataParallel

    from ckptguard._records.proofwriter import read_alone

    fsdp1 = torch.nn.Module.__new__(
        FullyShardedDataParallel
    )  # the type is what counts; no process group needed
    torch.nn.Module.__init__(fsdp1)
    assert read_alone({"model": torch.nn.Linear(2, 2), "step": 3})
    assert not read_alone({"model": torch.nn.Sequential(fsdp1), "step": 3})


def test_one_rank_records_no_replica_digests_it_has_no_replicas_to_compare(tmp_path):
    root = tmp_path / "ck"
    net = torch.nn.Linear(4, 3)
    cg.CheckpointManager(root).save(1, {"model": net})
    mgr = cg.CheckpointManager(root)
    assert mgr.restore({"model": net}) == 1
    mgr.record_step(2, sample_ids=[2], loss=0.5)
    recs = _records(root, 0)
    assert recs[-2]["event"] == "restore" and recs[-2]["replicas"]["checked"] == 0
    assert (
        recs[-1]["event"] == "step" and "replica_partials" not in recs[-1]
    )  # nothing hashed at the step
