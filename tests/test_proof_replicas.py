"""prove's "replicas equal after load" compares the replicas again at the first step after a restore (the
``replica_partials`` each rank's first step record carries): on 2 gloo ranks of a real DDP job, drift that
appears after ``restore()`` returned (rank 1's weight moved by a hook) and a process killed before any later
save (so no save's guard ever refused it) FAILs naming the tensor and the ranks on each side; an exact resume
PASSes saying the replicas were compared again."""

from __future__ import annotations

from pathlib import Path

import torch

import ckptguard as cg
from ckptguard.ops.prove import Status, evaluate
from ckptguard.testing import run_ranks, values


def _job(rank: int, world: int, root: str, drift: bool) -> int:
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mgr = cg.CheckpointManager(root, config=cg.CheckpointConfig(timeout_s=60))
    state = {"model": net, "optim": opt}
    start = mgr.restore(state)
    if start and drift and rank == 1:  # after restore() returned: what a late hook or broadcast does
        with torch.no_grad():
            net.weight.add_(1.0)
    for step in range(start + 1, 3 if not start else start + 2):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step * 10 + rank))
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        mgr.record_step(step, sample_ids=[step * 2 + rank], loss=loss.item())
        if step == 2:
            mgr.save(step, state)
    return start  # the resumed run ends after its first step: killed before its next save


def _gate(tmp_path: Path, drift: bool):
    root = str(tmp_path / "ck")
    torch.set_num_threads(1)
    assert values(run_ranks(_job, 2, root, drift)) == [0, 0]
    assert values(run_ranks(_job, 2, root, drift)) == [2, 2]
    return next(g for g in evaluate(Path(root)) if g.name == "replicas equal after load")


def test_drift_after_the_restore_is_named_at_the_first_step_without_a_later_save(tmp_path):
    gate = _gate(tmp_path, True)
    assert gate.status is Status.FAIL, gate.evidence
    assert "at the first step after the restore (step 3)" in gate.evidence, gate.evidence
    assert "'model.weight' (item 'model'): ranks [0] vs ranks [1]" in gate.evidence, gate.evidence
    assert "drifted after restore() returned" in gate.evidence


def test_an_exact_resume_compares_the_replicas_again_at_the_first_step(tmp_path):
    gate = _gate(tmp_path, False)
    assert gate.status is Status.PASS, gate.evidence
    assert "compared again at the first step after the restore (step 3)" in gate.evidence, gate.evidence
