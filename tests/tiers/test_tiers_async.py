"""TieredCheckpoint.save_async and the persistent tier's write lease, on CPU gloo ranks.

save_async: each tier saves in the background through its manager's staging; a parameter changed
right after the call is saved with its old value; a restore while a save is pending picks that
step on every rank; a fast step's peer replicas are made only after its commit (fake nodes, needs
root). The lease: a second live job on the same persistent root is refused on every rank, before
its first persistent save.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from test_tiers import PER_NODE, WORLD, become_node, expected, make_state, restore_records, train_to

import ckptguard as cg
from ckptguard._disk import lease as _lease
from ckptguard.testing import run_ranks, values

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root for private UTS namespaces (fake nodes)"
)


def _tiers(base: str, host_bytes: int = 1 << 20, **kw) -> cg.TieredCheckpoint:
    """``host_bytes=0``: nothing fits the staging pools, the writers read the live tensors and the
    next optimizer step waits until both tiers' writers have read them."""
    return cg.TieredCheckpoint(
        os.path.join(base, kw.pop("fast", "fast")),
        persistent=os.path.join(base, "pers"),
        config=cg.CheckpointConfig(
            timeout_s=60, async_save=cg.AsyncOptions(host_bytes=host_bytes, on_busy=cg.OnBusy.WAIT)
        ),
        **kw,
    )


def _exact(state: dict, rank: int, step: int) -> bool:
    want = expected(rank, step)
    return all(torch.equal(v, want[k]) for k, v in state["model"].state_dict().items())


def async_run(rank: int, world: int, base: str) -> dict:
    tiers = _tiers(
        base, fast_every=1, persistent_every=2
    )  # the state fits the pools: staged copies
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
    out = {
        "kinds": kinds,
        "step": step,
        "exact": _exact(state, rank, step),
        "mine": state["mine"].value,
    }
    # Unhealthy on one rank: skipped on every rank and every tier, nothing staged or pending.
    out["skipped"] = tiers.save_async(6, state, healthy=rank != 1) is None and tiers.wait() is None
    out.update(fast=tiers.fast.committed_steps(), persistent=tiers.persistent.committed_steps())
    tiers.close()
    return out


def test_save_async_saves_both_tiers_in_the_background_with_the_old_values(tmp_path):
    out = values(run_ranks(async_run, 2, str(tmp_path), timeout=240))
    for rank, o in enumerate(out):
        assert o["kinds"] == [["fast"], ["fast", "persistent"], ["fast"], ["fast", "persistent"]]
        assert o["step"] == 4 and o["exact"] and o["mine"] == rank * 1000 + 4 and o["skipped"], o
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
    """Fake nodes, each with its own fast disk: while a fast step is published on a node but its
    tracker not yet moved (uncommitted), the node holds no replica of it; after wait() every rank's
    part of both steps is on the other node. Nothing fits the staging pools: the optimizer steps
    after each save_async wait for the writers' reads. Then node 1 loses its fast tier and restores
    step 2 from the replicas on node 0."""
    import shutil
    import time

    import torch.distributed as dist

    from ckptguard import _faults

    become_node(base, rank, local_disk=True)
    tiers = _tiers(base, 0, fast="disk/fast", fast_every=1, persistent_every=2, replicas=1)
    fast = Path(base, "disk", "fast")
    early: list[list] = []

    def look(point: str) -> None:  # a push running alongside the commit would show here
        time.sleep(0.3)
        held = fast.glob("replicas/*/rank_*/replica.json")
        early.append([point, sorted(p.relative_to(fast).as_posix() for p in held)])

    for point in ("node.before_tracker", "commit.before_tracker"):
        _faults.set_hook(point, lambda point=point: look(point))
    state = make_state(rank)
    for step in (1, 2):
        train_to(state, rank, step)
        tiers.save_async(step, state)
    tiers.wait()
    for point in ("node.before_tracker", "commit.before_tracker"):
        _faults.set_hook(point, None)
    held = sorted(
        p.relative_to(fast).as_posix() for p in fast.glob("replicas/*/rank_*/replica.json")
    )
    dist.barrier()
    if (
        rank == PER_NODE
    ):  # node 1's fast disk is lost (the persistent tier holds step 2 too: fast wins)
        shutil.rmtree(fast)
    dist.barrier()
    train_to(state, rank, 3)
    step = tiers.restore(state)
    dist.barrier()  # every rank's restore record is written before rank 0 reads them all
    return {
        "early": early,
        "held": held,
        "step": step,
        "exact": _exact(state, rank, step),
        "tier": restore_records(Path(base, "pers"))[rank]["tier"] if rank == 0 else None,
    }


@needs_root
def test_save_async_pushes_replicas_only_after_the_commit(tmp_path):
    (tmp_path / "disk").mkdir()
    for node in (0, 1):
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "marker").write_text(str(node))
    out = values(run_ranks(replica_run, WORLD, str(tmp_path), timeout=300))

    def markers(steps, node):  # the replicas node ``node`` holds: those of the other node's ranks
        ranks = [r for r in range(WORLD) if r // PER_NODE != node]
        return [f"replicas/step_0000000{s}/rank_0000{r}/replica.json" for s in steps for r in ranks]

    for leader, node in ((0, 0), (PER_NODE, 1)):
        # Each fast publish sees only the older steps' replicas; the persistent commit of step 2
        # (rank 0, the shared root) comes after step 2's push.
        want = [["node.before_tracker", []], ["node.before_tracker", markers([1], node)]]
        if leader == 0:
            want.append(["commit.before_tracker", markers([1, 2], node)])
        assert out[leader]["early"] == want, out[leader]["early"]
        assert out[leader]["held"] == markers([1, 2], node)
    assert [(o["step"], o["exact"]) for o in out] == [(2, True)] * WORLD, out
    assert out[0]["tier"] == "fast"


# ---------------------------------------------------------------- the persistent tier's lease


def second_job(rank: int, world: int, base: str) -> dict:
    tiers = _tiers(base, fast="fast_b", fast_every=1, persistent_every=10)
    state = make_state(rank)
    out = {}
    calls = (
        ("restore", lambda: tiers.restore(state)),
        ("save", lambda: tiers.save(1, state) and [t.value for t in tiers.last_saved]),
    )
    for what, call in calls:
        try:
            out[what] = call()
        except cg.LeaseHeldError as exc:
            out[what] = f"LeaseHeldError: {exc}"
    out["fast"] = sorted(p.name for p in Path(base, "fast_b").glob("step_*"))
    return out


def test_a_second_live_job_on_the_persistent_root_is_refused(tmp_path):
    base = str(tmp_path)
    first = _tiers(
        base, fast_every=1, persistent_every=10
    )  # this process: a live job, fast saves only so far
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
    assert [(o["restore"], o["save"], o["fast"]) for o in out] == [
        (0, ["fast"], ["step_00000001"])
    ] * 2, out


def test_a_step_on_neither_interval_touches_nothing(tmp_path):
    tiers = _tiers(str(tmp_path), fast_every=2, persistent_every=4)
    state = make_state(0)
    assert tiers.save(1, state) is None and tiers.last_saved == {}
    pending = tiers.save_async(3, state)
    assert pending is not None and pending.tiers == [] and pending.done() and pending.wait() is None
    assert (
        not (tmp_path / "pers").exists() and not (tmp_path / "fast").exists()
    )  # no root, no lease
    assert [t.value for t in tiers.save_async(4, state).tiers] == ["fast", "persistent"]
    assert tiers.wait() == tmp_path / "pers" / "step_00000004" and _lease.is_mine(tmp_path / "pers")
    assert sorted(t.value for t in tiers.last_saved) == ["fast", "persistent"]
    tiers.close()


def test_prepare_async_pins_the_tiers_one_pool_in_the_background(tmp_path):
    # One process: TieredCheckpoint.prepare_async is local (no collective); its future is the bytes
    # both tiers' pools added, and the first save_async of each tier then stages into a pool that is
    # ready.
    tiers = cg.TieredCheckpoint(
        tmp_path / "fast",
        persistent=tmp_path / "pers",
        fast_every=1,
        persistent_every=2,
        config=cg.CheckpointConfig(async_save=cg.AsyncOptions(host_bytes=1 << 22)),
    )
    state = {"model": torch.nn.Linear(64, 64)}
    nbytes = sum(p.numel() * p.element_size() for p in state["model"].parameters())
    assert (
        tiers.prepare_async(state).result(timeout=60) == nbytes
    )  # one pool for both tiers (issue 41)
    assert (
        tiers.fast._staging is tiers.persistent._staging
        and tiers.fast._staging.pool.held_bytes == nbytes
    )
    tiers.save_async(2, state)
    assert tiers.wait() == tmp_path / "pers" / "step_00000002"
    assert sorted(t.value for t in tiers.last_saved) == ["fast", "persistent"]
    for tier in ("fast", "pers"):
        cost = json.loads((tmp_path / tier / "step_00000002" / "manifest.json").read_text())["cost"]
        assert cost["live_bytes"] == 0 and cost["staged_host_bytes"] == nbytes, cost  # no live read
    tiers.close()
