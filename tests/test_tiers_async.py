"""TieredCheckpoint.save_async and the persistent tier's write lease, on CPU gloo ranks.

save_async: each tier saves in the background through its manager's staging; a parameter changed
right after the call is saved with its old value; a restore while a save is pending picks that
step on every rank; a fast step's peer replicas are made only after its commit (fake nodes, needs
root). The lease: a second live job on the same persistent root is refused on every rank, before
its first persistent save.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import ckptguard as cg
from ckptguard._commit import lease as _lease
from ckptguard.testing import run_ranks, values
from test_tiers import PER_NODE, WORLD, expected, fake_node, make_state, train_to

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for private UTS namespaces (fake nodes)")


def _tiers(base: str, host_bytes: int = 1 << 20, **kw) -> cg.TieredCheckpoint:
    """``host_bytes=0``: nothing fits the staging pools, the writers read the live tensors and the next
    optimizer step waits until both tiers' writers have read them."""
    return cg.TieredCheckpoint(fast=os.path.join(base, kw.pop("fast", "fast")), persistent=os.path.join(base, "pers"),
                               config=cg.CheckpointConfig(timeout_s=60, async_host_bytes=host_bytes), **kw)


def _exact(state: dict, rank: int, step: int) -> bool:
    want = expected(rank, step)
    return all(torch.equal(v, want[k]) for k, v in state["model"].state_dict().items())


def async_run(rank: int, world: int, base: str) -> dict:
    tiers = _tiers(base, fast_every=1, persistent_every=2)  # the state fits the pools: staged copies
    state = make_state(rank)
    blocked, kinds = [], []
    for step in range(1, 5):
        train_to(state, rank, step)  # its optimizer step waits for the previous save_async's copies
        pending = tiers.save_async(step, state)
        assert pending is not None and pending.step == step
        kinds.append([t.value for t in pending.tiers])
        blocked.append(pending.blocked_seconds)
    # Changed right after save_async, outside an optimizer step: staged() first, as documented.
    tiers.staged()
    with torch.no_grad():
        for p in state["model"].parameters():
            p.add_(100.0)
    state["mine"].value = -1
    # A restore while step 4 is pending: it ends first, and the choice is step 4 on every rank.
    step = tiers.restore(state)
    out = {"kinds": kinds, "step": step, "exact": _exact(state, rank, step), "mine": state["mine"].value,
           "fast": tiers.fast.committed_steps(), "persistent": tiers.persistent.committed_steps()}
    tiers.close()
    return out


def test_save_async_saves_both_tiers_in_the_background_with_the_old_values(tmp_path):
    out = values(run_ranks(async_run, 2, str(tmp_path), timeout=240))
    for rank, o in enumerate(out):
        assert o["kinds"] == [["fast"], ["fast", "persistent"], ["fast"], ["fast", "persistent"]]
        assert o["step"] == 4 and o["exact"] and o["mine"] == rank * 1000 + 4, o
        assert o["fast"] == [3, 4] and o["persistent"] == [2, 4]
    # A fresh job restores the persistent tier alone, exactly, once the fast tier is gone.
    for p in (tmp_path / "fast").iterdir():
        if p.name.startswith("step_"):
            import shutil

            shutil.rmtree(p)
    assert values(run_ranks(restore_run, 2, str(tmp_path), timeout=240)) == [(4, True), (4, True)]


def restore_run(rank: int, world: int, base: str) -> tuple[int, bool]:
    tiers = _tiers(base)
    state = make_state(rank)
    step = tiers.restore(state)
    return step, _exact(state, rank, step)


def replica_run(rank: int, world: int, base: str) -> dict:
    """Fake nodes on one shared fast root: while a fast step's commit is between its manifest and its
    tracker (uncommitted), no peer replica of it exists; after wait() every rank's replica does. Nothing
    fits the staging pools: the optimizer steps after each save_async wait for the writers' reads."""
    import time

    import torch.distributed as dist

    from ckptguard import _faults

    fake_node(base, rank, local_disk=False)
    tiers = _tiers(base, 0, fast="disk/fast", fast_every=1, persistent_every=2, replicas=1)
    fast = Path(base, "disk", "fast")
    early: list[list[str]] = []

    def before_tracker() -> None:  # rank 0 publishes a shared root; a concurrent push would show here
        time.sleep(0.3)
        early.append(sorted(p.as_posix() for p in fast.glob("replicas/*/rank_*/replica.json")))

    _faults.set_hook("commit.before_tracker", before_tracker)
    state = make_state(rank)
    for step in (1, 2):
        train_to(state, rank, step)
        tiers.save_async(step, state)
    tiers.wait()
    _faults.set_hook("commit.before_tracker", None)
    held = sorted(p.relative_to(fast).as_posix() for p in fast.glob("replicas/*/rank_*/replica.json"))
    dist.barrier()
    if rank == 0:  # node 1's own files of step 2 are lost; its replicas on node 0 rebuild them
        from test_tiers import node_files

        for p in node_files(fast / "step_00000002", 1):
            p.unlink()
    dist.barrier()
    train_to(state, rank, 3)
    step = tiers.restore(state)
    return {"early": early, "held": held, "step": step, "exact": _exact(state, rank, step)}


@needs_root
def test_save_async_pushes_replicas_only_after_the_commit(tmp_path):
    (tmp_path / "disk").mkdir()
    out = values(run_ranks(replica_run, WORLD, str(tmp_path), timeout=300))
    step1 = [f"{tmp_path}/disk/fast/replicas/step_00000001/rank_0000{r}/replica.json" for r in range(WORLD)]
    step2 = [f"{tmp_path}/disk/fast/replicas/step_00000002/rank_0000{r}/replica.json" for r in range(WORLD)]
    # At each fast publish only the older steps' replicas exist; the persistent commit of step 2 comes
    # after step 2's push.
    assert out[0]["early"] == [[], step1, sorted(step1 + step2)], out[0]["early"]
    assert all(o["held"] == [f"replicas/step_0000000{s}/rank_0000{r}/replica.json" for s in (1, 2)
                             for r in range(WORLD)] for o in out)
    assert [(o["step"], o["exact"]) for o in out] == [(2, True)] * WORLD, out
    assert PER_NODE == 2


# ---------------------------------------------------------------- the persistent tier's lease


def second_job(rank: int, world: int, base: str) -> dict:
    tiers = _tiers(base, fast="fast_b", fast_every=1, persistent_every=10)
    state = make_state(rank)
    out = {}
    calls = (("restore", lambda: tiers.restore(state)), ("save", lambda: [t.value for t in tiers.save(1, state)]))
    for what, call in calls:
        try:
            out[what] = call()
        except cg.LeaseHeldError as exc:
            out[what] = f"LeaseHeldError: {exc}"
    out["fast"] = sorted(p.name for p in Path(base, "fast_b").glob("step_*"))
    return out


def test_a_second_live_job_on_the_persistent_root_is_refused(tmp_path):
    base = str(tmp_path)
    first = _tiers(base, fast_every=1, persistent_every=10)  # this process: a live job, fast saves only so far
    first.save(1, make_state(0))
    pers = tmp_path / "pers"
    assert _lease.is_mine(pers) and not list(pers.glob("step_*"))
    out = values(run_ranks(second_job, 2, base, timeout=120))
    for o in out:
        assert o["restore"].startswith("LeaseHeldError") and f"pid {os.getpid()}" in o["restore"], o
        assert o["save"].startswith("LeaseHeldError") and str(pers) in o["save"], o
        assert o["fast"] == []  # refused before it wrote anything
    first.close()
    assert _lease.release(pers)  # the first job is gone: the second one starts
    out = values(run_ranks(second_job, 2, base, timeout=120))
    assert [(o["restore"], o["save"], o["fast"]) for o in out] == [(0, ["fast"], ["step_00000001"])] * 2, out
