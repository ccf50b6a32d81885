"""prove's "replicas equal after load" compares the replicas again at the first step after a restore
(the ``replica_partials`` each rank's first step record carries), on 2 gloo ranks of a real DDP job.
Replicas that differ there (rank 1's weight moved after ``restore()`` returned) are judged by the
resumed run's later saves: some jobs keep replicas equal only at save points (local SGD averages
there), so a process killed before any later save leaves them MISSING naming the tensor and the
ranks on each side, and a later save that found them equal again (the job averaged them) PASSes
saying so. A save that refuses them FAILs (tests/ops/test_proof_naming.py). An exact resume PASSes
saying the replicas were compared again."""

from __future__ import annotations

from pathlib import Path

import torch

import ckptguard as cg
from ckptguard.ops.prove import Status, evaluate
from ckptguard.testing import run_ranks, values


def _job(rank: int, world: int, root: str, mode: str | None) -> int:
    import torch.distributed as dist

    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mgr = cg.CheckpointManager(root, config=cg.CheckpointConfig(timeout_s=60))
    state = {"model": net, "optim": opt}
    start = mgr.restore(state)
    if (
        start and mode and rank == 1
    ):  # after restore() returned: a late hook, or local SGD's own replica
        with torch.no_grad():
            net.weight.add_(1.0)
    last = 2 if not start else start + (2 if mode == "local" else 1)
    for step in range(start + 1, last + 1):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step * 10 + rank))
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        mgr.record_step(step, sample_ids=[step * 2 + rank], loss=loss.item())
        if step == 2 or (start and mode == "local" and step == last):
            with torch.no_grad():  # local SGD: the replicas averaged at the save point
                for p in net.parameters():
                    dist.all_reduce(p)
                    p /= world
            mgr.save(step, state)
    return (
        start  # "drift" and the exact run end after the first step: killed before their next save
    )


def _gate(tmp_path: Path, mode: str | None):
    root = str(tmp_path / "ck")
    torch.set_num_threads(1)
    assert values(run_ranks(_job, 2, root, mode)) == [0, 0]
    assert values(run_ranks(_job, 2, root, mode)) == [2, 2]
    return next(g for g in evaluate(Path(root)) if g.name == "replicas equal after load")


def test_replicas_that_differ_at_the_first_step_without_a_later_save_are_missing_naming_the_tensor(
    tmp_path,
):
    gate = _gate(tmp_path, "drift")
    assert gate.status is Status.MISSING, gate.evidence
    assert "at the first step after the restore (step 3)" in gate.evidence, gate.evidence
    assert "'model.weight' (item 'model'): ranks [0] vs ranks [1]" in gate.evidence, gate.evidence
    assert "no save of the resumed run compared them afterwards" in gate.evidence


def test_replicas_equal_again_at_a_later_save_pass_as_a_job_that_syncs_at_save_points(tmp_path):
    gate = _gate(tmp_path, "local")
    assert gate.status is Status.PASS, gate.evidence
    assert "'model.weight' (item 'model'): ranks [0] vs ranks [1]" in gate.evidence, gate.evidence
    assert (
        "the save of step 4 found them equal again: this job keeps its replicas "
        "equal at save points only" in gate.evidence
    )


def test_an_exact_resume_compares_the_replicas_again_at_the_first_step(tmp_path):
    gate = _gate(tmp_path, None)
    assert gate.status is Status.PASS, gate.evidence
    assert "compared again at the first step after the restore (step 3)" in gate.evidence, (
        gate.evidence
    )
