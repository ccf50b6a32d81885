"""``CheckpointConfig.timeout_s`` is the longest a rank waits at a phase of the commit: with one
rank stuck, the others raise within ``timeout_s`` of reaching ``save.written``
(``CheckpointManager``) or ``run.written`` (``RunCheckpoint``), naming the stuck rank, not after
twice that (one deadline for the phase: rank 0's gather and everyone's wait for its verdict share
it).

Two gloo ranks; rank 1 is stuck at the fault point right before the phase until rank 0 raised (3 x
timeout_s at most); rank 0 measures from the moment it reaches the phase to its raise.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

import ckptguard as cg
from ckptguard import ProofPlan
from ckptguard.testing import run_ranks, set_fault_hook, values

TIMEOUT_S = 8.0
# the measured wait may pass timeout_s by this factor (a loaded 2-core machine), not reach 2x
SLACK = 1.5


def _job(rank: int, world: int, root: str, run: bool) -> dict:
    cfg = cg.CheckpointConfig(timeout_s=TIMEOUT_S, proof=ProofPlan(record=False), retention=None)
    point = "run.role_written" if run else "commit.rank_written"
    arrived: list[float] = []
    released = Path(f"{root}.rank0-raised")

    def stuck() -> None:
        deadline = time.monotonic() + 3 * TIMEOUT_S
        while not released.exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    def arrive() -> None:
        arrived.append(time.monotonic())

    set_fault_hook(point, stuck if rank == 1 else arrive)
    if run:
        mgr = cg.RunCheckpoint(root, [cg.Role("actor")], config=cfg)
        state = {"actor": {"w": torch.zeros(4)}}
    else:
        mgr = cg.CheckpointManager(root, config=cfg)
        state = {"w": torch.zeros(4)}
    try:
        mgr.save(1, state)
    except cg.CheckpointError as exc:
        waited = time.monotonic() - arrived[-1] if arrived else None
        released.touch()
        return {"waited": waited, "error": str(exc)}
    return {"waited": None, "error": None}


def _check(results: list[dict], phase: str) -> None:
    r0 = results[0]
    print(f"{phase}: rank 0 waited {r0['waited']:.2f} s with timeout_s={TIMEOUT_S}")
    assert r0["error"] is not None and phase in r0["error"] and "[1]" in r0["error"], r0
    assert r0["waited"] is not None and r0["waited"] < TIMEOUT_S * SLACK, (
        f"rank 0 waited {r0['waited']:.1f} s at {phase} with timeout_s={TIMEOUT_S}",
        r0,
    )


def test_a_rank_waits_at_most_timeout_s_at_save_written(tmp_path):
    _check(values(run_ranks(_job, 2, str(tmp_path / "ck"), False, timeout=120)), "save.written")


def test_a_rank_waits_at_most_timeout_s_at_run_written(tmp_path):
    _check(values(run_ranks(_job, 2, str(tmp_path / "ck"), True, timeout=120)), "run.written")
