"""TieredCheckpoint: a fast tier and a persistent tier, restore from the newest step every rank can
load.

Two fake nodes of two gloo ranks each: every rank gets its node's hostname (a private UTS
namespace) and, for node-local roots, its node's own disk at the shared path (a private mount
namespace with the node's directory bound over it); a rank asserts it cannot see the other
node's files. Needs root; skipped otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import ckptguard as cg
from ckptguard.ops.prove import evaluate
from ckptguard.testing import fake_node, run_ranks, values

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root for private UTS/mount namespaces (fake nodes)"
)

WORLD, PER_NODE = 4, 2


def become_node(base: str, rank: int, *, local_disk: bool) -> int:
    """Become a rank of node ``rank // PER_NODE`` (``ckptguard.testing.fake_node``): its node name
    and hostname, and with ``local_disk`` its own disk at ``base/disk`` (``base/node<n>`` seen
    there). Returns the node index."""
    import socket

    node = rank // PER_NODE
    shared = os.path.join(base, "disk")
    disks = {shared: os.path.join(base, f"node{node}")} if local_disk else None
    fake_node(f"node{node}", disks=disks, hostname=True)
    assert socket.gethostname() == f"node{node}"
    if local_disk:
        # The check that this node sees only its own disk is real: the other node's marker is not
        # here.
        assert Path(shared, "marker").read_text() == str(node)
    return node


def make_state(rank: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    return {
        "model": model,
        "optim": torch.optim.AdamW(model.parameters(), lr=0.1),
        "mine": cg.PerRank(0),
    }


def train_to(state: dict, rank: int, step: int) -> None:
    opt = state["optim"]
    state["model"](torch.full((2, 4), float(step))).sum().backward()
    opt.step()
    opt.zero_grad()
    state["mine"].value = rank * 1000 + step


def expected(rank: int, step: int) -> dict:
    state = make_state(rank)
    for s in range(1, step + 1):
        train_to(state, rank, s)
    return {k: v.clone() for k, v in state["model"].state_dict().items()}


def tiers(base: str, **kw) -> cg.TieredCheckpoint:
    kw = dict(kw)
    config = cg.CheckpointConfig(timeout_s=kw.pop("timeout_s", 60))
    return cg.TieredCheckpoint(
        os.path.join(base, "disk", "fast"),
        persistent=kw.pop("persistent", None),
        config=config,
        **kw,
    )


def save_run(rank: int, world: int, base: str, steps: int, local_disk: bool, kw: dict) -> list:
    become_node(base, rank, local_disk=local_disk)
    mgr = tiers(base, **kw)
    state = make_state(rank)
    saved = []
    for step in range(1, steps + 1):
        train_to(state, rank, step)
        path = mgr.save(step, state)
        assert (
            path
            == (mgr.persistent.root if cg.Tier.PERSISTENT in mgr.last_saved else mgr.fast.root)
            / path.name
        )
        saved.append(sorted(t.value for t in mgr.last_saved))
    return saved


def restore_run(rank: int, world: int, base: str, local_disk: bool, kw: dict) -> dict:
    become_node(base, rank, local_disk=local_disk)
    mgr = tiers(base, **kw)
    state = make_state(rank)
    try:
        step = mgr.restore(state)
    except cg.CheckpointError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    exact = all(
        torch.equal(v, expected(rank, step)[k]) for k, v in state["model"].state_dict().items()
    )
    return {"step": step, "exact": exact, "mine": state["mine"].value}


def restore_records(root: Path) -> list[dict]:
    out = []
    for path in sorted((root / "proof").glob("rank_*.jsonl")):
        recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        out.append([r for r in recs if r["event"] == "restore"][-1])
    return out


def test_both_fast_tiers_lost_restores_the_older_persistent_step(tmp_path):
    (tmp_path / "disk").mkdir()
    for node in (0, 1):  # node-local fast roots: each node its own disk at base/disk
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "marker").write_text(str(node))
    persistent = str(tmp_path / "persistent")
    kw = {"persistent": persistent, "fast_every": 1, "persistent_every": 2}
    saved = values(run_ranks(save_run, WORLD, str(tmp_path), 3, True, kw, timeout=240))
    assert saved[0] == [["fast"], ["fast", "persistent"], ["fast"]]
    assert sorted(p.name for p in (tmp_path / "node1" / "fast").glob("step_*")) == [
        "step_00000002",
        "step_00000003",
    ]
    for node in (0, 1):
        shutil.rmtree(tmp_path / f"node{node}" / "fast")  # every node's fast tier is gone
    out = values(run_ranks(restore_run, WORLD, str(tmp_path), True, kw, timeout=240))
    assert [o.get("step") for o in out] == [2] * WORLD, out
    assert all(o["exact"] for o in out) and [o["mine"] for o in out] == [
        r * 1000 + 2 for r in range(WORLD)
    ]
    records = restore_records(Path(persistent))
    assert [r["tier"] for r in records] == ["persistent"] * WORLD
    assert records[0]["tier_detail"] == "tier persistent: step 2"
    gate = next(g for g in evaluate(Path(persistent)) if g.name == "restored from tier")
    assert gate.status.value == "INFO" and gate.evidence.startswith(
        "step 2 from the persistent tier on 4 rank(s)"
    )


def node_files(step_dir: Path, node: int) -> list[Path]:
    """The files only ``node`` holds of a step on node-local disks: those its ranks wrote, less the
    ones the other node's ranks read too (DCP stores a replicated tensor once; each node keeps a
    copy)."""
    from ckptguard._records import manifest as _manifest
    from ckptguard._records.manifest import files_needed

    manifest = _manifest.read(step_dir)
    ranks = range(node * PER_NODE, (node + 1) * PER_NODE)
    others = set().union(
        *(files_needed(step_dir, manifest, r) for r in range(WORLD) if r not in ranks)
    )
    return [step_dir / f.path for f in manifest.files if f.rank in ranks and f.path not in others]


def test_replicas_on_a_shared_fast_root_fill_in_lost_files_exactly(tmp_path):
    """A fast tier on storage every node shares (no per-node publish): a node's files lost from the
    step directory are filled in from the peer replicas, the directory's other files left in
    place."""
    (tmp_path / "disk").mkdir()
    kw = {"fast_every": 1, "replicas": 1}
    values(run_ranks(save_run, WORLD, str(tmp_path), 2, False, kw, timeout=180))
    fast = tmp_path / "disk" / "fast"
    held = sorted(
        p.relative_to(fast).as_posix() for p in (fast / "replicas").glob("*/rank_*/replica.json")
    )
    assert held == [
        f"replicas/step_0000000{s}/rank_0000{r}/replica.json" for s in (1, 2) for r in range(WORLD)
    ]
    lost = node_files(fast / "step_00000002", 1)
    assert lost and all(p.exists() for p in lost)
    for p in lost:
        p.unlink()
    out = values(run_ranks(restore_run, WORLD, str(tmp_path), False, kw, timeout=180))
    assert [o.get("step") for o in out] == [2] * WORLD, out
    assert all(o["exact"] for o in out) and [o["mine"] for o in out] == [
        r * 1000 + 2 for r in range(WORLD)
    ]
    assert all(p.exists() for p in lost)
    records = restore_records(fast)
    assert [r["tier"] for r in records] == ["fast"] * WORLD
    assert (
        records[0]["replica_ranks"] == [2, 3] and "from peer replicas" in records[0]["tier_detail"]
    )
    gate = next(g for g in evaluate(fast) if g.name == "restored from tier")
    assert (
        gate.evidence
        == "step 2 from the fast tier on 4 rank(s); ranks [2, 3] fetched their files from peer "
        "replicas"
    )
