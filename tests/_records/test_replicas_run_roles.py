"""A RunCheckpoint role's replicas compared again at its first step after a restore, and a
divergence its save_async's guard finds recorded in the role's proof records (issue 39, item 3), on
2 gloo ranks holding one DDP actor role: as ``CheckpointManager`` does
(tests/_records/test_replicas_first_step.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

import ckptguard as cg
from ckptguard._resume.layoutcheck import describe_replicas, replica_report
from ckptguard.ops.prove import Status, evaluate
from ckptguard.testing import run_ranks, values


def _job(rank: int, world: int, root: str, drift: bool) -> str:
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = cg.RunCheckpoint(
        root, [cg.Role("actor", ranks=(0, 1))], config=cg.CheckpointConfig(timeout_s=60)
    )
    states = {"actor": {"model": net, "optim": opt}}
    start = run.restore(states)
    if (
        start and drift and rank == 1
    ):  # after restore() returned: what a late hook or broadcast does
        with torch.no_grad():
            net.weight.add_(1.0)
    step = start + 1
    loss = (
        model(torch.randn(8, 4, generator=torch.Generator().manual_seed(step * 10 + rank)))
        .square()
        .mean()
    )
    loss.backward()
    opt.step()
    opt.zero_grad()
    run.record_step(step, sample_ids=[step * 2 + rank], loss=loss.item())
    run.save_async(step, states)
    try:
        run.wait()
    except cg.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "saved"


def _records(root: Path, rank: int) -> list[dict]:
    lines = (root / "proof" / "actor" / f"rank_{rank:05d}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def test_a_roles_drift_after_restore_is_named_at_its_first_step_and_at_its_next_save(tmp_path):
    root = tmp_path / "ck"
    assert values(run_ranks(_job, 2, str(root), True)) == [
        "saved",
        "saved",
    ]  # fresh: nothing to drift
    out = values(run_ranks(_job, 2, str(root), True))
    assert all("model.weight" in text for text in out), (
        out
    )  # the save's guard refused it on every rank
    first = []
    for rank in (0, 1):
        recs = _records(root, rank)
        restore = max(i for i, r in enumerate(recs) if r["event"] == "restore")
        first.append(next(r for r in recs[restore:] if r["event"] == "step"))
        later = [r for r in recs[restore:] if r["event"] == "replicas"]
        assert (
            len(later) == 1 and later[0]["ok"] is False and "model.weight" in later[0]["error"]
        ), later
    named = describe_replicas(replica_report([f["replica_partials"] for f in first]))
    assert "'model.weight' (item 'model', offset (0, 0)): ranks [0] vs ranks [1]" in named, named
    gate = {g.name: g for g in evaluate(root)}["actor: replicas equal after load"]
    assert gate.status is Status.FAIL and "model.weight" in gate.evidence, gate
