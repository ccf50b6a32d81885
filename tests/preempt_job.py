"""One rank of the preemption tests' job, as its own process (signals must really be delivered).

``python preempt_job.py RANK WORLD PORT CONFIG_JSON``: the toy job (FSDP2 over gloo) trains
``steps`` steps with a PreemptionGuard at every step boundary, saving every ``save_every``
steps; when ``signal_at`` is set, rank ``signal_rank`` sends itself SIGTERM in the middle of
that step (after its forward pass, before its update); ``tiers``: a TieredCheckpoint instead of a
manager. Its bitwise fingerprint and the step it
started from go to ``out/rank_R.json``; a preemption exits with the guard's code.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import ckptguard as cg
import jobexit
from ckptguard.demo.toyjob import build_job, fingerprint


def main() -> None:
    rank, world, port, cfg = (
        int(sys.argv[1]),
        int(sys.argv[2]),
        int(sys.argv[3]),
        json.loads(sys.argv[4]),
    )
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    job = build_job(rank=rank, world=world)
    config = cg.CheckpointConfig(timeout_s=60)
    mgr: cg.CheckpointManager | cg.TieredCheckpoint
    if cfg.get(
        "tiers"
    ):  # fast tier every save_every steps, the persistent tier only at a preemption
        root = Path(cfg["root"])
        mgr = cg.TieredCheckpoint(
            root / "fast",
            persistent=root / "persistent",
            fast_every=cfg["save_every"],
            persistent_every=1000,
            config=config,
        )
    else:
        mgr = cg.CheckpointManager(cfg["root"], config=config)
    start = mgr.restore(job.state())
    out = Path(cfg["out"]) / f"rank_{rank}.json"
    with cg.PreemptionGuard(mgr, grace_s=cfg["grace_s"]) as guard:
        for step in range(start + 1, cfg["steps"] + 1):
            x, y = job.loader.next_batch()
            loss = torch.nn.functional.mse_loss(job.model(x), y)
            if step == cfg.get("signal_at") and rank == cfg.get("signal_rank"):
                os.kill(os.getpid(), signal.SIGTERM)  # delivered mid-step; the step still completes
            job.optim.zero_grad(set_to_none=True)
            loss.backward()
            job.optim.step()
            job.sched.step()
            mgr.record_step(step, loss=float(loss.item()))
            if step % cfg["save_every"] == 0:
                mgr.save(step, job.state())
            guard.step_boundary(step, job.state())
    out.write_text(json.dumps({"start": start, "fingerprint": fingerprint(job)}))


if __name__ == "__main__":
    jobexit.freeze_at_exit()
    main()
