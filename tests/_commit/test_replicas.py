"""Peer replicas on node-local roots: two fake nodes of two gloo ranks, each node with its own disk.

A node is lost by deleting its whole disk and giving the replacement an empty one; the restore
then rebuilds its part from the surviving node's replicas (over torch.distributed, xxh3 checked
against the manifest), or without replicas falls back to the persistent tier or refuses.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from test_tiers import (
    PER_NODE,
    WORLD,
    become_node,
    make_state,
    pytestmark,
    restore_records,
    tiers,
    train_to,
)

import ckptguard as cg
from ckptguard.ops.prove import evaluate, verdict
from ckptguard.testing import run_ranks, values

__all__ = ["pytestmark"]


def disks(tmp_path: Path) -> None:
    (tmp_path / "disk").mkdir(exist_ok=True)
    for node in range(WORLD // PER_NODE):
        (tmp_path / f"node{node}").mkdir(exist_ok=True)
        (tmp_path / f"node{node}" / "marker").write_text(str(node))


def replace_node(tmp_path: Path, node: int) -> None:
    """The node is gone with its disk; its replacement starts with an empty one."""
    shutil.rmtree(tmp_path / f"node{node}")
    disks(tmp_path)


def train_recorded(mgr: cg.TieredCheckpoint, state: dict, rank: int, step: int) -> None:
    """One training step and its proof record: what it read (ids) and a value it produced."""
    train_to(state, rank, step)
    loss = float(sum(p.double().sum() for p in state["model"].parameters()))
    mgr.record_step(step, sample_ids=[rank, step], loss=loss, grad_norm=1.0 + step)


def save_local(rank: int, world: int, base: str, steps: int, kw: dict, ran_on: int = 0) -> dict:
    """Train and save ``steps`` steps, then train ``ran_on`` more without a save (then it dies)."""
    become_node(base, rank, local_disk=True)
    mgr = tiers(base, **kw)
    state = make_state(rank)
    for step in range(1, steps + ran_on + 1):
        train_recorded(mgr, state, rank, step)
        if step <= steps:
            mgr.save(step, state)
    fast = Path(base, "disk", "fast")
    return {
        "steps": sorted(p.name for p in fast.glob("step_*")),
        "replicas": sorted(
            p.relative_to(fast).as_posix() for p in fast.glob("replicas/*/rank_*/replica.json")
        ),
    }


def restore_local(rank: int, world: int, base: str, kw: dict, then_save: bool) -> dict:
    from test_tiers import expected

    from ckptguard._disk.layout import StepNaming
    from ckptguard._records.checks import Severity, verify_step
    from ckptguard.ops.preflight import preflight

    become_node(base, rank, local_disk=True)
    # What `ckptguard preflight` says of this node's fast root before the restore (which may rebuild
    # it).
    checked = preflight(Path(base, "disk", "fast"), StepNaming("step_{step:08d}"))
    ready = [f.code for f in checked.findings if f.severity is Severity.ERROR]
    mgr = tiers(base, **kw)
    state = make_state(rank)
    try:
        step = mgr.restore(state)
    except cg.CheckpointError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "preflight": ready}
    out = {
        "step": step,
        "mine": state["mine"].value,
        "exact": all(
            torch_equal(v, expected(rank, step)[k]) for k, v in state["model"].state_dict().items()
        ),
    }
    fast = Path(base, "disk", "fast")
    out["verify"] = [
        f.line()
        for f in verify_step(fast / f"step_{step:08d}", deep=True)
        if f.severity is Severity.ERROR
    ]
    if then_save:
        train_recorded(mgr, state, rank, step + 1)
        mgr.save(step + 1, state)
        out["next"] = sorted(p.name for p in fast.glob("step_*"))
    return out


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


def test_replacement_node_restores_exactly_from_peer_replicas_and_trains_on(tmp_path):
    disks(tmp_path)
    persistent = (
        tmp_path / "persistent"
    )  # shared: it holds the run's one proof log (no step saved there yet)
    kw = {"fast_every": 1, "replicas": 1, "persistent": str(persistent), "persistent_every": 100}
    saved = values(run_ranks(save_local, WORLD, str(tmp_path), 2, kw, 1, timeout=240))
    # Each node holds its own steps and the other node's ranks' replicas, never its own.
    assert saved[0]["steps"] == ["step_00000001", "step_00000002"] == saved[2]["steps"]
    assert saved[0]["replicas"] == [
        f"replicas/step_0000000{s}/rank_0000{r}/replica.json" for s in (1, 2) for r in (2, 3)
    ]
    assert saved[2]["replicas"] == [
        f"replicas/step_0000000{s}/rank_0000{r}/replica.json" for s in (1, 2) for r in (0, 1)
    ]
    replace_node(tmp_path, 1)
    out = values(run_ranks(restore_local, WORLD, str(tmp_path), kw, True, timeout=240))
    assert [o.get("step") for o in out] == [2] * WORLD, out
    assert all(o["exact"] for o in out) and [o["mine"] for o in out] == [
        r * 1000 + 2 for r in range(WORLD)
    ]
    assert [o["verify"] for o in out] == [[]] * WORLD, (
        out
    )  # the rebuilt node's part verifies, node manifest too
    assert out[2]["next"] == ["step_00000002", "step_00000003"], (
        out
    )  # the job saves on, on both nodes
    recs = restore_records(persistent)
    assert [r["tier"] for r in recs] == ["fast"] * WORLD and recs[0]["replica_ranks"] == [2, 3]
    gates = evaluate(persistent)
    tier = next(g for g in gates if g.name == "restored from tier")
    assert (
        tier.evidence
        == "step 2 from the fast tier on 4 rank(s); ranks [2, 3] fetched their files from peer "
        "replicas"
    )
    # The resume is proven like any other: digests, PIDs, data order of the replayed step 3.
    assert verdict(gates) == "resume PROVEN", [(g.name, g.status.value, g.evidence) for g in gates]


def test_lost_node_without_replicas_falls_back_to_persistent_or_is_refused(tmp_path):
    disks(tmp_path)
    persistent = str(tmp_path / "persistent")  # outside the bind mount: every node sees it
    kw = {"fast_every": 1, "persistent_every": 2, "persistent": persistent}
    values(run_ranks(save_local, WORLD, str(tmp_path), 3, kw, timeout=240))
    replace_node(tmp_path, 1)
    out = values(run_ranks(restore_local, WORLD, str(tmp_path), kw, False, timeout=240))
    assert [o.get("step") for o in out] == [2] * WORLD, out
    assert all(o["exact"] for o in out)
    detail = restore_records(Path(persistent))[0]["tier_detail"]
    assert detail.startswith(
        "tier persistent: step 2 (the fast tier's newest step 3 cannot be loaded"
    ), detail
    assert "rank 2 (host node1): missing" in detail and "rank_00002.pt" in detail, detail
    # Without a persistent tier the same loss is refused on every rank, naming the files.
    replace_node(tmp_path, 1)
    out = values(
        run_ranks(restore_local, WORLD, str(tmp_path), {"fast_every": 1}, False, timeout=240)
    )
    assert [o["preflight"] for o in out] == [[], [], ["no-root"], ["no-root"]], (
        out
    )  # the empty node is NOT READY
    for o in out:
        assert o.get("error", "").startswith("CheckpointIncompleteError"), o
        assert "rank 3 (host node1): missing" in o["error"] and "rank_00003.pt" in o["error"], o
        assert "Without replicas=1" in o["error"] and "there is no persistent tier" in o["error"], o


def test_damaged_replica_is_caught_by_checksum_and_an_older_step_restored(tmp_path):
    disks(tmp_path)
    kw = {"fast_every": 1, "replicas": 1}
    values(run_ranks(save_local, WORLD, str(tmp_path), 2, kw, timeout=240))
    replace_node(tmp_path, 1)
    held = (
        tmp_path / "node0" / "fast" / "replicas" / "step_00000002" / "rank_00002" / "rank_00002.pt"
    )
    raw = bytearray(held.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size: only the manifest's xxh3 sees it
    held.write_bytes(bytes(raw))
    out = values(run_ranks(restore_local, WORLD, str(tmp_path), kw, False, timeout=240))
    assert [o.get("step") for o in out] == [1] * WORLD, out
    assert all(o["exact"] for o in out) and [o["verify"] for o in out] == [[]] * WORLD, out
    detail = restore_records(tmp_path / "node0" / "fast")[0]["tier_detail"]
    assert detail.startswith("tier fast: step 1, ranks [2, 3] from peer replicas"), detail
    assert "step 2" in detail and "xxh3" in detail and "rank_00002.pt" in detail, detail
    node1 = tmp_path / "node1" / "fast"
    assert not list(node1.glob(".tmp-*")) and not (node1 / "step_00000002").exists()


def save_killed_mid_push(rank: int, world: int, base: str, kw: dict) -> str:
    """Step 1 commits with its replicas; in step 2's replica push rank 2 dies (SIGKILL) mid-file."""
    import signal

    import ckptguard._commit.replica as replica

    become_node(base, rank, local_disk=True)
    mgr = tiers(base, **kw)
    state = make_state(rank)
    for step in (1, 2):
        train_to(state, rank, step)
        if step == 2 and rank == 2:

            def die(
                *args, **kwargs
            ):  # fault injection: the process dies inside the transfer, nothing cleans up
                os.kill(os.getpid(), signal.SIGKILL)

            replica.send_file = die
        try:
            mgr.save(step, state)
        except cg.CheckpointError as exc:
            return f"{type(exc).__name__}: {exc}"
    return "saved"


def test_a_node_killed_mid_replica_push_leaves_no_replica_that_counts(tmp_path):
    disks(tmp_path)
    # The live ranks wait up to 3 timeouts for the dead rank (the transfer, then its view): 10 s
    # each is still far above the arrival skew of live ranks, and a 20 s timeout made this test a
    # minute of waiting.
    kw = {"fast_every": 1, "replicas": 1, "timeout_s": 10}
    results = run_ranks(save_killed_mid_push, WORLD, str(tmp_path), kw, timeout=240)
    assert results[2].exitcode == -9, results[2]
    for r in (0, 1, 3):  # every live rank raises, naming the rank that never arrived
        assert results[r].ok and results[r].value.startswith("CollectiveTimeoutError"), results[r]
        assert "[2]" in results[r].value, results[r].value
    held = tmp_path / "node0" / "fast" / "replicas" / "step_00000002"
    assert not (held / "rank_00002").exists()  # rank 2's replica never sealed: it does not count
    # The step itself committed on both nodes before the push; the restarted job resumes from it
    # exactly.
    out = values(
        run_ranks(
            restore_local,
            WORLD,
            str(tmp_path),
            {"fast_every": 1, "replicas": 1},
            False,
            timeout=240,
        )
    )
    assert [o.get("step") for o in out] == [2] * WORLD and all(o["exact"] for o in out), out
