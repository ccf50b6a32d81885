"""The publish check, and per-node publish for node-local roots.

The publish check: every file a rank reported is read back by the publishing rank, with its
size and checksum, before anything is committed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptguard as cg
from ckptguard import StorageOptions
from ckptguard._disk import layout as _layout
from ckptguard._records import manifest as _manifest
from ckptguard._records import trust as _trust
from ckptguard.testing import fake_node, run_ranks, set_fault_hook


def _damage_after_write(root: Path, how: str) -> None:
    """A fault hook: change this rank's data file between its write and the publish."""

    def hook() -> None:
        (data,) = root.glob(".tmp-*/state/__0_0.distcp")
        raw = bytearray(data.read_bytes())
        if how == "flip":
            raw[len(raw) // 2] ^= 0xFF  # same size: only a checksum sees it
        else:
            raw = raw[:-1]
        data.write_bytes(bytes(raw))

    set_fault_hook("commit.rank_written", hook)


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_publish_reads_every_reported_file_back_with_size_and_checksum(tmp_path, how):
    root = tmp_path / "ck"
    # A shared root checks sizes by default; checksums on request (node-local roots: by default).
    mgr = cg.CheckpointManager(
        root, config=cg.CheckpointConfig(storage=StorageOptions(publish_checksums=True))
    )
    state = {"w": torch.nn.Linear(8, 8)}
    mgr.save(1, state)
    _damage_after_write(root, how)
    try:
        with pytest.raises(cg.CheckpointWriteError) as info:
            mgr.save(2, state)
    finally:
        set_fault_hook("commit.rank_written", None)
    msg = str(info.value)
    assert "publish check" in msg and "__0_0.distcp" in msg, msg
    assert ("xxh3" in msg) if how == "flip" else ("bytes, reported" in msg), msg
    assert _layout.read_tracker(root) == 1, (
        "a save whose files changed after their write was committed"
    )
    assert not (root / "step_00000002").exists() and not list(root.glob(".tmp-*"))
    assert mgr.restore(state) == 1
    if how == "flip":  # a shared root by default compares only the sizes: the flip commits
        quick = cg.CheckpointManager(root)
        _damage_after_write(root, how)
        try:
            quick.save(2, state)
        finally:
            set_fault_hook("commit.rank_written", None)
        assert _layout.read_tracker(root) == 2


# ---------------------------------------------------------------- two fake nodes, each with its own
# disk

NODES = 2  # 4 ranks: ranks 0, 1 on node0 and 2, 3 on node1


def _own_disk(base: Path, node: int, *more: Path, disk: int | None = None) -> Path:
    """This process becomes a rank of ``node`` (``fake_node``): its node identity, and
    ``base/disk<node>`` (or ``base/disk<disk>``) seen at ``base/shared`` (every node's disk at the
    same path); the same for each of ``more``. Returns ``base/shared``."""
    import os

    fake_node(
        f"node{node}",
        disks={b / "shared": b / f"disk{node if disk is None else disk}" for b in (base, *more)},
    )
    for b in (base, *more):
        shared = b / "shared"
        # The check that a node sees only its own disk is real: its marker, never the other node's.
        assert (shared / "marker").read_text() == str(node), (
            "this rank does not see its own node's disk"
        )
        assert not os.path.samefile(shared / "marker", b / f"disk{1 - node}" / "marker")
    return base / "shared"


def _bases(tmp_path: Path, names: list[str]) -> list[Path]:
    import os

    if os.geteuid() != 0:
        pytest.skip("needs root for private mount namespaces (two nodes' disks at one path)")
    out = []
    for name in names:
        base = tmp_path / name
        for node in range(NODES):
            (base / f"disk{node}").mkdir(parents=True)
            (base / f"disk{node}" / "marker").write_text(str(node))
        (base / "shared").mkdir()
        out.append(base)
    return out


def _two_disks_on_node1(rank: int, world: int, base: str) -> str:
    """Rank 3 claims node1 but sees a third disk at the shared path: its files would not be where
    node1 publishes (a node whose ranks see different disks, on the second node)."""
    shared = _own_disk(Path(base), rank // 2, disk=2 if rank == 3 else None)
    try:
        cg.CheckpointManager(shared / "ck", config=cg.CheckpointConfig(timeout_s=30)).save(
            1, _state(rank)
        )
    except cg.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "committed"


def test_a_node_whose_ranks_see_different_disks_is_refused_on_every_rank(tmp_path):
    from ckptguard.testing import values

    (base,) = _bases(tmp_path, ["run"])
    (base / "disk2").mkdir()
    (base / "disk2" / "marker").write_text("1")
    for rank, out in enumerate(values(run_ranks(_two_disks_on_node1, 4, str(base), timeout=120))):
        assert out.startswith("CheckpointWriteError"), (rank, out)
        assert "rank 3 of node node1" in out and "node-local" in out, (rank, out)
    for disk in range(3):
        root = base / f"disk{disk}" / "ck"
        assert not root.exists() or (
            _layout.read_tracker(root) in (None, 0) and not list(root.glob("*step_*"))
        ), f"disk{disk} holds a step or a temp directory of the refused save"


def _state(rank: int) -> dict:
    torch.manual_seed(0)  # replicated: the same on every rank, so DCP stores each value once
    return {
        "model": torch.nn.Linear(16, 16),
        "n": cg.PerRank(rank * 10),
        "table": torch.arange(64.0),
    }


def _listing(root: Path) -> dict[str, list[str]]:
    return {
        p.name: sorted(str(f.relative_to(p)) for f in p.rglob("*") if f.is_file())
        for p in sorted(root.iterdir())
        if p.is_dir() and p.name.startswith(("step_", ".tmp-"))
    }


def _save_and_check(rank: int, world: int, base: str) -> dict:
    from ckptguard.ops.preflight import preflight
    from ckptguard.ops.verify import verify_root

    node = rank // 2
    shared = _own_disk(Path(base), node)
    root = shared / "ck"
    # KeepLast(1): every node's retention runs on its own disk, so step 1 goes from both.
    mgr = cg.CheckpointManager(
        root, config=cg.CheckpointConfig(timeout_s=30, retention=cg.KeepLast(1))
    )
    state = _state(rank)
    for step in (1, 2):
        state["model"].weight.data += 1.0
        mgr.save(step, state)
    fresh = _state(rank)
    restored = cg.CheckpointManager(root, config=cg.CheckpointConfig(timeout_s=30)).restore(fresh)
    from ckptguard.ops.transfer import transfer

    naming = _layout.StepNaming("step_{step:08d}")
    report = preflight(root, naming)
    _steps, findings = verify_root(root, naming, deep=True)
    placed = {r: f"node{r // 2}" for r in range(world)}
    moved = {**placed, 2 * (1 - node): f"node{node}"}  # one rank of the other node moves here
    checks = {
        "same": [
            f"{f.severity.value} {f.code}"
            for f in preflight(root, naming, rank_hosts=placed).findings
        ],
        "moved": [
            f.line()
            for f in preflight(root, naming, rank_hosts=moved).findings
            if f.code != "not-checked"
        ],
    }
    if rank % 2 == 0:  # each node's first rank moves its node's part to another root on its disk
        transfer(root / "step_00000002", shared / "moved")
        checks["transferred"] = [f.line() for f in preflight(shared / "moved", naming).findings]
        checks["transferred_listing"] = _listing(shared / "moved")
    checks["absent"] = [f.code for f in preflight(shared / "nope", naming).findings]
    return {
        "checks": checks,
        "restored": restored,
        "same": torch.equal(fresh["model"].weight, state["model"].weight)
        and fresh["n"].value == rank * 10,
        "listing": _listing(root),
        "tracker": _layout.read_tracker(root),
        "preflight": [f.line() for f in report.findings if f.severity.value == "ERROR"],
        "preflight_step": report.step,
        "verify": [f.line() for f in findings if f.severity.value == "ERROR"],
        "trust": sorted(_trust.read(root) or {}) if (root / _trust.TRUST_NAME).exists() else None,
    }


def test_node_local_roots_commit_on_every_node_each_holding_its_part(tmp_path):
    import json

    from ckptguard.testing import values

    (base,) = _bases(tmp_path, ["run"])
    out = values(run_ranks(_save_and_check, 4, str(base), timeout=200))
    for rank, o in enumerate(out):
        assert o["restored"] == 2 and o["same"] and o["tracker"] == 2, (rank, o)
        assert not o["preflight"] and o["preflight_step"] == 2, (rank, o["preflight"])
        assert not o["verify"], (rank, o["verify"])
        checks = o["checks"]
        other = 1 - rank // 2
        # Preflight on this node checks this disk: its own ranks pass, the other node's are not
        # checked.
        assert checks["same"] == ["WARNING not-checked"], (rank, checks["same"])
        # A rank of the other node placed here would not find its extras on this disk.
        assert (
            len(checks["moved"]) == 1
            and f"rank {2 * other} will run on node{rank // 2}" in checks["moved"][0]
        )
        assert f"rank_{2 * other:05d}.pt" in checks["moved"][0], checks["moved"]
        assert checks["absent"] == ["no-root"]
        # Every node keeps its own trust record (prefer="verified" must resolve alike on every
        # node).
        assert o["trust"] is not None and 2 in o["trust"], (rank, o["trust"])
        if rank % 2 == 0:
            assert checks["transferred"] == [], (rank, checks["transferred"])
            moved_files = set(checks["transferred_listing"]["step_00000002"])
            assert moved_files == set(o["listing"]["step_00000002"]), (rank, moved_files)
    manifest = json.loads((base / "disk0/ck/step_00000002/manifest.json").read_text())
    assert manifest["format_version"] == _manifest.FORMAT_VERSION
    assert [n["ranks"] for n in manifest["nodes"]] == [[0, 1], [2, 3]]
    for node in range(NODES):
        root = base / f"disk{node}" / "ck"
        assert sorted(
            p.name for p in root.iterdir() if p.name.startswith(("step_", ".tmp-", ".trash-"))
        ) == ["step_00000002"], (
            f"node {node}: a temp directory is left, a step is missing, or retention "
            f"did not run on this node"
        )
        held = set(out[2 * node]["listing"]["step_00000002"])
        mine = {f["path"] for f in manifest["files"] if f["rank"] in (2 * node, 2 * node + 1)}
        copies = set(manifest["nodes"][node]["copies"])
        assert held == mine | copies | {"manifest.json", "node_manifest.json"}, (node, held)
        # Only its own ranks' extras; another node's data file only where it holds a replicated
        # value.
        assert {p for p in held if p.startswith("rank_")} == {
            f"rank_{r:05d}.pt" for r in (2 * node, 2 * node + 1)
        }
        assert all(c.startswith("state/") for c in copies)
        node_manifest = json.loads((root / "step_00000002/node_manifest.json").read_text())
        assert {f["path"] for f in node_manifest["files"]} == mine | copies
    assert "state/.metadata" in manifest["nodes"][1]["copies"], (
        "node1 lacks DCP's metadata (rank 0 writes it)"
    )
    assert manifest["nodes"][0]["copies"] or manifest["nodes"][1]["copies"] != [
        "state/.metadata"
    ], "DCP spread no replicated value across the nodes: the test shows nothing about the copies"


# ---------------------------------------------------------------- SIGKILL of one node at each
# per-node point

# (point, node whose ranks are killed there, each node's tracker afterwards, the step both agree on)
CRASHES = [
    (
        "node.confirmed",
        1,
        (1, 1),
        1,
    ),  # node 1 confirmed, node 0 waits for the others: nothing published
    (
        "node.before_rename",
        1,
        (1, 1),
        1,
    ),  # node 0 may publish its directory: an orphan, the trackers stay
    (
        "node.before_tracker",
        1,
        (2, 1),
        2,
    ),  # node 0 moved its tracker; node 1 holds step 2 published
    ("node.after_tracker", 0, (2, 2), 2),  # rank 0 (and the store) gone after its tracker moved
]


# Where a node holds step 2 published above its own tracker after the kill: node 0 renamed before
# node 1 died (no tracker moved: the next save removes it); node 1 lags node 0's tracker (resumed).
PUBLISHED_NEWER = {("node.before_rename", 0), ("node.before_tracker", 1)}


def _crash_worker(rank: int, world: int, base: str, point: str, victim: int) -> dict:
    import os
    import signal
    import time

    import torch.distributed as dist

    node = rank // 2
    shared = _own_disk(Path(base), node)
    pids: list = [None] * world
    dist.all_gather_object(pids, os.getpid())
    state = _state(rank)
    state["model"].weight.data += 1.0
    cg.CheckpointManager(shared / "ck", config=cg.CheckpointConfig(timeout_s=30)).save(1, state)
    mgr = cg.CheckpointManager(
        shared / "ck",
        config=cg.CheckpointConfig(timeout_s=8),
        # survivors give up soon (a live rank's skew on 2 loaded cores stays far below it; 5 s
        # did not)
    )
    if node == victim:
        siblings = [pids[r] for r in range(world) if r // 2 == node and r != rank]

        def kill_node() -> (
            None
        ):  # reached by the node's publishing rank: the whole node dies at once
            for pid in siblings:
                os.kill(pid, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)

        set_fault_hook(point, kill_node)
    state["model"].weight.data += 1.0
    started = time.monotonic()
    try:
        mgr.save(2, state)
    except cg.CheckpointError as exc:
        return {"error": type(exc).__name__, "elapsed": time.monotonic() - started}
    return {"error": None}


def _recover_worker(rank: int, world: int, bases: list[str]) -> list[dict]:
    from ckptguard.ops.preflight import preflight

    node = rank // 2
    _own_disk(Path(bases[0]), node, *(Path(b) for b in bases[1:]))
    out = []
    for base in bases:
        root = Path(base) / "shared" / "ck"
        before = preflight(root, _layout.StepNaming("step_{step:08d}"))
        lagging = [f.code for f in before.findings if f.code == "published-newer"]
        mgr = cg.CheckpointManager(root, config=cg.CheckpointConfig(timeout_s=30))
        state = _state(rank)
        expected = state["model"].weight.detach().clone()
        step = mgr.restore(state)
        for _ in range(step):
            # as the saving run did, one addition per step (x + 1 + 1 is not x + 2 in floats)
            expected += 1.0
        exact = torch.equal(state["model"].weight, expected)
        mgr.save(
            step + 2, state
        )  # skips a step: what the killed save published on one node must go
        out.append(
            {
                "step": step,
                "exact": exact,
                "committed": mgr.committed_steps(),
                "listing": _listing(root),
                "preflight": (before.step, lagging),
            }
        )
    return out


def test_sigkill_of_one_node_at_each_point_leaves_both_nodes_agreeing(tmp_path):
    import signal

    from ckptguard.testing import values

    bases = _bases(tmp_path, [point.replace(".", "_") for point, *_ in CRASHES])
    for base, (point, victim, trackers, _agreed) in zip(bases, CRASHES, strict=True):
        results = run_ranks(_crash_worker, 4, str(base), point, victim, timeout=120)
        for r in results:
            if r.rank // 2 == victim:
                assert r.exitcode == -signal.SIGKILL, (point, r)
            # the survivors raised a ckptguard error within the timeout, never committed silently
            else:
                assert r.ok and r.value["error"] is not None and r.value["elapsed"] < 60, (point, r)
        seen = tuple(_layout.read_tracker(base / f"disk{n}" / "ck") for n in range(NODES))
        assert seen == trackers, f"{point}: trackers {seen}, expected {trackers}"
    trackers_of = {point: trackers for point, _victim, trackers, _agreed in CRASHES}
    per_rank = values(run_ranks(_recover_worker, 4, [str(b) for b in bases], timeout=200))
    for (point, _victim, _trackers, agreed), result in zip(
        CRASHES, zip(*per_rank, strict=True), strict=True
    ):
        for rank, r in enumerate(result):
            assert r["step"] == agreed and r["exact"], (
                f"{point}: rank {rank} resumed {r}, expected step {agreed}"
            )
            # Preflight on a node sees its own tracker, and is told when this node holds a newer
            # step published.
            own = trackers_of[point][rank // 2]
            newer = ["published-newer"] if (point, rank // 2) in PUBLISHED_NEWER else []
            assert r["preflight"] == (own, newer), (point, rank, r["preflight"])
            assert r["committed"][-2:] == [agreed, agreed + 2], (
                f"{point}: rank {rank}: {r['committed']}"
            )
            names = list(r["listing"])
            # Nothing of the killed save lingers (its temp directory, a step directory only one node
            # published), and the agreed step is never deleted.
            assert not [n for n in names if n.startswith(".tmp-")], (
                f"{point}: rank {rank} keeps {names}"
            )
            assert f"step_{agreed + 1:08d}" not in names, (
                f"{point}: rank {rank} keeps the unagreed step: {names}"
            )
            assert f"step_{agreed:08d}" in names and f"step_{agreed + 2:08d}" in names, (
                point,
                rank,
                names,
            )
