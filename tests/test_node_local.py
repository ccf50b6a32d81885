"""Issue 22 item 1: the publish check, and per-node publish for node-local roots.

The publish check: every file a rank reported is read back by the publishing rank, with its
size and checksum, before anything is committed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptguard as cg
from ckptguard._commit import layout as _layout
from ckptguard.testing import run_ranks, set_fault_hook


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
    mgr = cg.CheckpointManager(root)
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
    assert _layout.read_tracker(root) == 1, "a save whose files changed after their write was committed"
    assert not (root / "step_00000002").exists() and not list(root.glob(".tmp-*"))
    assert mgr.restore(state) == 1


# ---------------------------------------------------------------- two fake nodes, each with its own disk

NODES = 2  # 4 ranks: ranks 0, 1 on node0 and 2, 3 on node1


def _own_disk(base: Path, node: int) -> Path:
    """This process becomes a rank of ``node``: its node identity, and a private mount namespace in
    which ``base/disk<node>`` is bound over ``base/shared`` (every node's disk at the same path)."""
    import ctypes
    import os

    os.environ["CKPTGUARD_NODE"] = f"node{node}"
    libc = ctypes.CDLL(None, use_errno=True)
    clone_newns, ms_rec, ms_private, ms_bind = 0x00020000, 0x4000, 1 << 18, 0x1000
    if libc.unshare(clone_newns) != 0:
        raise PermissionError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
    if libc.mount(None, b"/", None, ms_rec | ms_private, None) != 0:
        raise PermissionError(ctypes.get_errno(), "mount --make-rprivate /")
    shared = base / "shared"
    if libc.mount(str(base / f"disk{node}").encode(), str(shared).encode(), None, ms_bind, None) != 0:
        raise PermissionError(ctypes.get_errno(), f"mount --bind {base}/disk{node} {shared}")
    # The check that a node sees only its own disk is real: its marker, never the other node's.
    assert (shared / "marker").read_text() == str(node), "this rank does not see its own node's disk"
    assert not os.path.samefile(shared / "marker", base / f"disk{1 - node}" / "marker")
    return shared


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


def _state(rank: int) -> dict:
    torch.manual_seed(0)  # replicated: the same on every rank, so DCP stores each value once
    return {"model": torch.nn.Linear(16, 16), "n": cg.PerRank(rank * 10), "table": torch.arange(64.0)}


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
    mgr = cg.CheckpointManager(root, config=cg.CheckpointConfig(timeout_s=30))
    state = _state(rank)
    for step in (1, 2):
        state["model"].weight.data += 1.0
        mgr.save(step, state)
    fresh = _state(rank)
    restored = cg.CheckpointManager(root, config=cg.CheckpointConfig(timeout_s=30)).restore(fresh)
    naming = _layout.StepNaming("step_{step:08d}")
    report = preflight(root, naming)
    _steps, findings = verify_root(root, naming, deep=True)
    return {
        "restored": restored,
        "same": torch.equal(fresh["model"].weight, state["model"].weight) and fresh["n"].value == rank * 10,
        "listing": _listing(root),
        "tracker": _layout.read_tracker(root),
        "preflight": [f.line() for f in report.findings if f.severity.value == "ERROR"],
        "preflight_step": report.step,
        "verify": [f.line() for f in findings if f.severity.value == "ERROR"],
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
    manifest = json.loads((base / "disk0/ck/step_00000002/manifest.json").read_text())
    assert manifest["format_version"] == 2
    assert [n["ranks"] for n in manifest["nodes"]] == [[0, 1], [2, 3]]
    for node in range(NODES):
        root = base / f"disk{node}" / "ck"
        assert sorted(p.name for p in root.iterdir() if p.name.startswith(("step_", ".tmp-"))) == [
            "step_00000001", "step_00000002"
        ], f"node {node}: a temp directory or a step is missing"
        held = set(out[2 * node]["listing"]["step_00000002"])
        mine = {f["path"] for f in manifest["files"] if f["rank"] in (2 * node, 2 * node + 1)}
        copies = set(manifest["nodes"][node]["copies"])
        assert held == mine | copies | {"manifest.json", "node_manifest.json"}, (node, held)
        # Only its own ranks' extras; another node's data file only where it holds a replicated value.
        assert {p for p in held if p.startswith("rank_")} == {f"rank_{r:05d}.pt" for r in (2 * node, 2 * node + 1)}
        assert all(c.startswith("state/") for c in copies)
        node_manifest = json.loads((root / "step_00000002/node_manifest.json").read_text())
        assert {f["path"] for f in node_manifest["files"]} == mine | copies
    assert "state/.metadata" in manifest["nodes"][1]["copies"], "node1 lacks DCP's metadata (rank 0 writes it)"
    assert manifest["nodes"][0]["copies"] or manifest["nodes"][1]["copies"] != ["state/.metadata"], (
        "DCP spread no replicated value across the nodes: the test shows nothing about the copies"
    )
