"""Files between nodes over torch.distributed (``_commit/p2p.py``, used by per-node publish and
peer replicas), and what losing a node leaves: the tracker-round message, gc on a lagging node.

A failed transfer must reach the peer at once: neither side waits a timeout, both report the same
problem (the file, the step, the sending and receiving rank, what to do), and the pair stays in step
for the next file.
"""

from __future__ import annotations

import ctypes
import json
import os
import time
from pathlib import Path

import pytest
import torch
import xxhash

import ckptguard as cg
from ckptguard._disk import layout as _layout
from ckptguard._records.entries import FileEntry
from ckptguard.testing import run_ranks, set_fault_hook, values

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for private mount namespaces")
TIMEOUT_S = 60  # per message: a transfer that waited on a failed peer would take this long
PROMPT_S = 8.0  # what "at once" allows on a loaded 2-core machine


def _mount(
    source: bytes | None, target: Path, fstype: bytes | None, flags: int, data: bytes | None = None
) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(source, str(target).encode(), fstype, flags, data) != 0:
        raise PermissionError(
            ctypes.get_errno(), f"mount {source!r} {target} ({fstype!r}, {flags:#x})"
        )


def _private_mounts() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x00020000) != 0:  # CLONE_NEWNS: mounts below stay in this process
        raise PermissionError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
    _mount(None, Path("/"), None, 0x4000 | (1 << 18))  # MS_REC | MS_PRIVATE


def _read_only(path: Path) -> None:
    """Remount the bind mount at ``path`` read-only (root ignores chmod; a read-only mount it does
    not)."""
    _mount(None, path, None, 32 | 0x1000 | 1)  # MS_REMOUNT | MS_BIND | MS_RDONLY


# ---------------------------------------------------------------- one pair, every way a file can
# fail


def _xxh(data: bytes) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def _pair_cases(rank: int, world: int, base: str) -> dict:
    from ckptguard._commit import p2p as t
    from ckptguard._commit import replica

    t.CHUNK = (
        16 << 10
    )  # several blocks per file: failures in the middle of a file, not only at its start
    base_p = Path(base)
    data = (base_p / "src.bin").read_bytes()
    good = t.FileSpec("state/__0_0.distcp", len(data), _xxh(data))
    link = t.Link(None, step=7, what="test copy", retry="try again", timeout_s=TIMEOUT_S)
    small = base_p / "small"
    if rank == 1:
        # Rank 1's target for the "full" case: a 64 KiB tmpfs, full after four of the file's 16
        # blocks.
        _private_mounts()
        _mount(b"tmpfs", small, b"tmpfs", 0, b"size=64k")
    cases = {
        "short": (
            base_p / "short.bin",
            good,
            base_p / "r1" / "short" / good.path,
        ),  # the sender's file shrank
        "absent": (
            base_p / "nope.bin",
            good,
            base_p / "r1" / "absent" / good.path,
        ),  # the sender's file is gone
        "full": (
            base_p / "src.bin",
            good,
            small / "state" / "x.distcp",
        ),  # the receiver's disk fills mid-file
        "checksum": (
            base_p / "src.bin",
            t.FileSpec(good.path, good.size, "0" * 16),
            base_p / "r1" / "sum" / "x",
        ),
        # The receiver cannot create its file: its parent is a regular file.
        "blocked": (base_p / "src.bin", good, base_p / "blocker" / "x"),
        # A path from the peer that leaves the receiver's directory: refused before anything is
        # written.
        "escape": (
            base_p / "src.bin",
            t.FileSpec("../outside.bin", good.size, good.xxh3),
            base_p / "r1" / "esc" / "../outside.bin",
        ),
    }
    out: dict = {}
    for case, (src, spec, dest) in cases.items():
        started = time.monotonic()
        problem = t.send_file(link, src, spec, 1) if rank == 0 else t.recv_file(link, dest, spec, 0)
        elapsed = time.monotonic() - started
        # The pair is still in step: the next file of the same two ranks arrives intact.
        after = base_p / "r1" / f"after-{case}.bin"
        nxt = (
            t.send_file(link, base_p / "src.bin", good, 1)
            if rank == 0
            else t.recv_file(link, after, good, 0)
        )
        out[case] = {
            "problem": None if problem is None else problem.__dict__,
            "elapsed": elapsed,
            "next": None if nxt is None else str(nxt),
            "left": sorted(p.name for p in dest.parent.iterdir())
            if rank == 1 and dest.parent.is_dir()
            else [],
            "after": rank == 1 and after.read_bytes() == data,
        }
    # Peer replicas through the same transfer: rank 1's replica folder is blocked; rank 0's is fine.
    roots = [base_p / "rep0", base_p / "rep1"]
    files = [FileEntry("state/__0_0.distcp", len(data), _xxh(data), r) for r in (0, 1)]
    started = time.monotonic()
    problems = replica.push(
        root=roots[rank],
        step=7,
        step_name="step_00000007",
        manifest_files=files,
        peer_of=[1, 0],
        rank=rank,
        group=None,
        timeout_s=TIMEOUT_S,
    )
    out["push"] = {
        "problems": problems,
        "elapsed": time.monotonic() - started,
        "held": replica.held(roots[rank], _layout.StepNaming("step_{step:08d}")),
    }
    return out


@ROOT_ONLY
def test_a_failed_transfer_reaches_both_ranks_at_once_with_the_same_problem(tmp_path):
    data = os.urandom(256 << 10)
    (tmp_path / "src.bin").write_bytes(data)
    (tmp_path / "short.bin").write_bytes(data[: 40 << 10])
    (tmp_path / "small").mkdir()
    (tmp_path / "blocker").write_text("a file where the receiver wants a folder")
    for r in (0, 1):
        (tmp_path / f"rep{r}" / "step_00000007" / "state").mkdir(parents=True)
        (tmp_path / f"rep{r}" / "step_00000007" / "state" / "__0_0.distcp").write_bytes(data)
    (tmp_path / "rep1" / "replicas").write_text("blocks rank 1's replicas")
    sender, receiver = values(run_ranks(_pair_cases, 2, str(tmp_path), timeout=120))
    expect = {
        "short": ("rank 0 cannot send it: it ends at byte 40960, its recorded size is 262144", 0),
        "absent": ("rank 0 cannot open it", 0),
        "full": ("rank 1 failed writing", 1),
        "checksum": ("have xxh3", 1),
        "blocked": ("rank 1 failed creating", 1),
    }
    for case, (cause, origin) in expect.items():
        s, r = sender[case], receiver[case]
        assert s["problem"] is not None and s["problem"] == r["problem"], (case, s, r)
        msg = s["problem"]["message"]
        assert cause in msg and s["problem"]["rank"] == origin, (case, msg)
        # What, where (file, step, both ranks) and what to do.
        assert (
            "test copy, step 7: state/__0_0.distcp (262144 bytes) from rank 0 to rank 1" in msg
        ), (case, msg)
        assert msg.endswith("then try again"), (case, msg)
        assert max(s["elapsed"], r["elapsed"]) < PROMPT_S, (case, s["elapsed"], r["elapsed"])
        assert r["left"] == [], (case, "a partial file is left where the receiver wrote", r["left"])
        assert s["next"] is None and r["next"] is None and r["after"], (
            case,
            "the pair is out of step after it",
        )
    s, r = sender["escape"], receiver["escape"]
    assert s["problem"] == r["problem"] and "rank 1 refuses the path" in s["problem"]["message"], (
        s,
        r,
    )
    assert (
        "test copy, step 7: ../outside.bin" in s["problem"]["message"]
        and s["next"] is None
        and r["after"]
    )
    assert (
        not (tmp_path / "r1" / "outside.bin").exists()
        and max(s["elapsed"], r["elapsed"]) < PROMPT_S
    )
    assert "No space left on device" in sender["full"]["problem"]["message"]
    assert sender["checksum"]["problem"]["exc_type"] == "CheckpointCorruptError"
    push0, push1 = sender["push"], receiver["push"]
    assert len(push0["problems"]) == 1 and push0["problems"] == push1["problems"], (push0, push1)
    assert "peer replica, step 7: state/__0_0.distcp" in push0["problems"][0], push0
    assert (
        "from rank 0 to rank 1" in push0["problems"][0] and "save again" in push0["problems"][0]
    ), push0
    assert max(push0["elapsed"], push1["elapsed"]) < PROMPT_S, (push0, push1)
    # The failed replica does not count; the other direction of the pair was unaffected.
    assert push1["held"] == {} and push0["held"] == {7: [1]}, (push0["held"], push1["held"])


# ---------------------------------------------------------------- per-node publish: a node that
# cannot take its copy


def _save_onto_read_only_node(rank: int, world: int, base: str) -> dict:
    from test_node_local import _own_disk

    shared = _own_disk(Path(base), rank)  # one rank per node: rank 0 on node0, rank 1 on node1
    torch.manual_seed(0)
    # Replicated values: DCP stores each once, so the node without it gets a copy (and .metadata) at
    # publish.
    state = {"model": torch.nn.Linear(32, 32), "n": cg.PerRank(rank), "table": torch.arange(2048.0)}
    mgr = cg.CheckpointManager(shared / "ck", config=cg.CheckpointConfig(timeout_s=TIMEOUT_S))
    mgr.save(1, state)
    if (
        rank == 1
    ):  # node1's disk turns read-only after its rank wrote its own files: the copies cannot land
        set_fault_hook("commit.rank_written", lambda: _read_only(shared))
    started = time.monotonic()
    try:
        mgr.save(2, state)
        out = "committed"
    except cg.CheckpointWriteError as exc:
        out = str(exc)
    return {
        "error": out,
        "elapsed": time.monotonic() - started,
        "tracker": _layout.read_tracker(shared / "ck"),
    }


@ROOT_ONLY
def test_a_copy_that_cannot_land_on_its_node_fails_the_save_on_both_nodes_at_once(tmp_path):
    from test_node_local import _bases

    (base,) = _bases(tmp_path, ["run"])
    out = values(run_ranks(_save_onto_read_only_node, 2, str(base), timeout=120))
    for rank, o in enumerate(out):
        msg = o["error"]
        # Before, rank 0 sent into a receiver that had given up and waited the whole timeout.
        assert o["elapsed"] < PROMPT_S, (
            rank,
            o["elapsed"],
            f"waited about the {TIMEOUT_S} s timeout",
        )
        assert msg.startswith("save of step 2 under") and "node confirm" in msg, (rank, msg)
        assert "copy of a replicated DCP file to a node that reads it, step 2: state/" in msg, (
            rank,
            msg,
        )
        assert (
            "from rank 0 to rank 1: rank 1 failed creating" in msg
            and "Read-only file system" in msg
        ), (rank, msg)
        assert "then save again" in msg, (rank, msg)
        assert o["tracker"] == 1, (rank, o["tracker"])


# ---------------------------------------------------------------- per-node publish: a failed
# node-tracker round


def _read_write(path: Path) -> None:
    _mount(None, path, None, 32 | 0x1000)  # MS_REMOUNT | MS_BIND: writable again


def _trackers_apart(rank: int, world: int, base: str) -> dict:
    """Per-node saves whose tracker round fails on node1, on both nodes, and after every tracker
    moved; after each, what a fresh restore really resumes from."""
    from test_node_local import _own_disk, _state

    shared = _own_disk(Path(base), rank)
    root = shared / "ck"
    config = cg.CheckpointConfig(timeout_s=TIMEOUT_S)
    state = _state(rank)
    weights: dict[int, torch.Tensor] = {}

    def save(step: int, fault: str | None = None, on: tuple[int, ...] = ()) -> str:
        state["model"].weight.data += 1.0
        weights[step] = state["model"].weight.detach().clone()
        if rank in on:
            if fault == "node.after_tracker":

                def hook() -> None:
                    raise OSError(5, "injected: the disk failed right after the tracker moved")
            # the node's disk turns read-only before its tracker moves: its write fails for real
            else:

                def hook() -> None:
                    _read_only(shared)

            set_fault_hook(fault, hook)
        try:
            cg.CheckpointManager(root, config=config).save(step, state)
            return "committed"
        except cg.CheckpointWriteError as exc:
            return str(exc)
        finally:
            if fault is not None:
                set_fault_hook(fault, None)
            if rank in on and fault == "node.before_tracker":
                _read_write(shared)

    def restore() -> dict:
        fresh = _state(rank)
        step = cg.CheckpointManager(root, config=config).restore(fresh)
        return {
            "step": step,
            "exact": torch.equal(fresh["model"].weight, weights[step]),
            "tracker": _layout.read_tracker(root),
        }

    out: dict = {"first": save(1)}
    out["lagging"] = {"error": save(2, "node.before_tracker", on=(1,)), "restore": restore()}
    out["after_lagging"] = {"save": save(3), "tracker": _layout.read_tracker(root)}
    out["none"] = {"error": save(4, "node.before_tracker", on=(0, 1)), "restore": restore()}
    out["after_none"] = {"save": save(5), "step4": (root / "step_00000004").exists()}
    out["all"] = {"error": save(6, "node.after_tracker", on=(0,)), "restore": restore()}
    return out


@ROOT_ONLY
def test_a_failed_tracker_round_says_which_nodes_moved_and_what_a_restore_takes(tmp_path):
    from test_node_local import _bases

    (base,) = _bases(tmp_path, ["run"])
    out = values(run_ranks(_trackers_apart, 2, str(base), timeout=180))
    for rank, o in enumerate(out):
        assert o["first"] == "committed", (rank, o["first"])
        # node0's tracker moved to step 2, node1's did not: the step IS the resume target
        # everywhere.
        msg = o["lagging"]["error"]
        assert "failed at node tracker" in msg and "Read-only file system" in msg, (rank, msg)
        assert (
            "the trackers of node0 (ranks 0) moved to step 2; those of node1 "
            "(ranks 1) at step 1 did not" in msg
        ), (rank, msg)
        assert "A restore (prefer='latest', the default) agrees on step 2 on every node" in msg, (
            rank,
            msg,
        )
        assert "previous committed step stays the resume target" not in msg, (rank, msg)
        assert o["lagging"]["restore"] == {"step": 2, "exact": True, "tracker": 2 - rank}, (
            rank,
            o["lagging"],
        )
        assert o["after_lagging"] == {"save": "committed", "tracker": 3}, (rank, o["after_lagging"])
        # No node's tracker moved: the previous step stays, and the next save removes the published
        # step 4.
        msg = o["none"]["error"]
        assert (
            "no node's tracker moved (node0 (ranks 0) at step 3, node1 (ranks 1) at step 3)" in msg
        ), (rank, msg)
        assert "the next save removes them" in msg, (rank, msg)
        assert o["none"]["restore"] == {"step": 3, "exact": True, "tracker": 3}, (rank, o["none"])
        assert o["after_none"] == {"save": "committed", "step4": False}, (rank, o["after_none"])
        # Every tracker moved and a failure came after: the step is committed, and said so.
        msg = o["all"]["error"]
        assert (
            "every node's tracker moved to step 6 (node0 (ranks 0), node1 (ranks "
            "1)), so step 6 is committed" in (msg)
        ), (rank, msg)
        assert "injected" in msg, (rank, msg)
        assert o["all"]["restore"] == {"step": 6, "exact": True, "tracker": 6}, (rank, o["all"])


# ---------------------------------------------------------------- gc --orphans on a node whose
# tracker lags


def _gc_on_the_lagging_node(rank: int, world: int, base: str) -> dict:
    import socket
    import subprocess

    from test_node_local import _own_disk, _state

    from ckptguard.ops.gc import adopt_step, gc

    shared = _own_disk(Path(base), rank)
    root = shared / "ck"
    config = cg.CheckpointConfig(timeout_s=TIMEOUT_S)
    naming = _layout.StepNaming("step_{step:08d}")
    state = _state(rank)
    cg.CheckpointManager(root, config=config).save(1, state)
    state["model"].weight.data += 1.0
    saved = state["model"].weight.detach().clone()
    if (
        rank == 1
    ):  # node1's tracker cannot move: node0's does, the global commit of step 2 is done there
        set_fault_hook("node.before_tracker", lambda: _read_only(shared))
    try:
        cg.CheckpointManager(root, config=config).save(2, state)
    except cg.CheckpointWriteError:
        pass
    finally:
        set_fault_hook("node.before_tracker", None)
    out: dict = {"tracker": _layout.read_tracker(root)}
    if rank == 1:
        _read_write(shared)
        # A true orphan next to it: the temp directory of a save whose process is gone.
        dead = subprocess.Popen(["true"])
        dead.wait()
        tmp = root / _layout.temp_dir_name(naming.name(3), "0123456789ab")
        (tmp / _layout.STATE_DIR).mkdir(parents=True)
        (tmp / _layout.OWNER_NAME).write_text(
            json.dumps({"host": socket.gethostname(), "pid": dead.pid})
        )
        report = gc(root, naming, orphans=True, force=True)
        out["removed"] = [p.name for p, _what in report.removed]
        out["kept"] = {p.name: why for p, why in report.kept}
        out["step2"] = (root / "step_00000002" / "manifest.json").exists()
    from torch.distributed import barrier

    barrier()  # node1's gc has run before any rank restores
    fresh = _state(rank)
    out["restored"] = cg.CheckpointManager(root, config=config).restore(fresh)
    out["exact"] = torch.equal(fresh["model"].weight, saved)
    if rank == 1:  # what the hint says: adopt moves the lagging tracker to the agreed step
        out["adopt"] = adopt_step(root, naming, 2)
        out["adopted"] = _layout.read_tracker(root)
    return out


@ROOT_ONLY
def test_gc_orphans_on_a_lagging_node_keeps_the_agreed_step_and_removes_true_orphans(tmp_path):
    from test_node_local import _bases

    (base,) = _bases(tmp_path, ["run"])
    node0, node1 = values(run_ranks(_gc_on_the_lagging_node, 2, str(base), timeout=120))
    assert node0["tracker"] == 2 and node1["tracker"] == 1, (node0, node1)
    # Before, --orphans took step 2 as an orphan of node1 (newer than its own tracker) and deleted
    # it.
    assert node1["step2"], ("gc --orphans deleted the agreed step on the lagging node", node1)
    assert "step_00000002" not in node1["removed"], node1["removed"]
    why = node1["kept"]["step_00000002"]
    assert "per-node save" in why and "tracker is at 1" in why and "never removes it" in why, why
    assert node1["removed"] == [".tmp-step_00000003-0123456789ab"], node1["removed"]
    for o in (node0, node1):
        assert o["restored"] == 2 and o["exact"], o
    assert node1["adopted"] == 2 and "now points at step 2" in node1["adopt"], node1
