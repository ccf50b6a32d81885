"""Retention's delete is off the commit's path (issue 41 item 4): the dropped step is renamed into
the trash at the commit and deleted by a background thread, so a synchronous save returns before
the old step's files are gone; a kill in the middle of that delete leaves a trash directory
that is never a step, every committed step intact, and the next rotation sweeps it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

import ckptguard as cg
from ckptguard._disk import layout as _layout
from ckptguard._records import retention
from ckptguard._records.leftovers import leftovers
from ckptguard.ops.verify import verify_root
from damage_helper import committed_on_disk, step_dir


def _state(step: int) -> dict[str, torch.Tensor]:
    return {
        "w": torch.full((4,), float(step)),
        "big": torch.arange(1 << 16, dtype=torch.float32) * step,
    }


def _trash(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if _layout.is_trash_dir(p))


def test_a_sync_save_returns_before_the_dropped_step_is_deleted(tmp_path, monkeypatch):
    root = tmp_path / "ck"
    release, entered = threading.Event(), threading.Event()
    real_delete = retention._delete

    def slow_delete(path: Path, what: str = "") -> None:
        entered.set()
        release.wait(30)  # the delete of step 1 is held until the test has seen save(2) return
        real_delete(path, what)

    monkeypatch.setattr(retention, "_delete", slow_delete)
    mgr = cg.CheckpointManager(root, config=cg.CheckpointConfig(retention=cg.KeepLast(1)))
    mgr.save(1, _state(1))
    began = time.monotonic()
    mgr.save(2, _state(2))
    took = time.monotonic() - began
    try:
        assert entered.wait(10), "the background delete never started"
        assert took < 10, f"save(2) took {took:.1f} s: it waited for the old step's delete"
        assert committed_on_disk(root) == [
            step_dir(root, 2).name
        ]  # step 1 uncommitted at the commit
        assert not step_dir(root, 1).exists()
        held = _trash(root)
        assert len(held) == 1 and not (held[0] / "manifest.json").exists(), (
            held
        )  # still there: not yet deleted
        (found,) = [x for x in leftovers(root, max_age_s=3600) if x.kind == "trash"]
        assert "by a live process" in found.detail and "interrupted" not in found.detail, found
    finally:
        release.set()
    assert retention.DELETER.wait(30)
    assert _trash(root) == []
    state = _state(0)
    assert cg.CheckpointManager(root).restore(state) == 2 and torch.equal(
        state["big"], _state(2)["big"]
    )
    mgr.close()


KILLED_MID_DELETE = r"""
import os, sys, time, torch, ckptguard as cg
from pathlib import Path
from ckptguard._records import retention
from ckptguard.ops.verify import verify_root

def partial_delete(path, what=""):
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.name != "owner.json")
    # a real delete under way: one file gone, the rest (the owner record last) still there
    files[0].unlink()
    Path(sys.argv[2]).write_text("mid-delete")
    time.sleep(120)  # killed here by the test

retention._delete = partial_delete
mgr = cg.CheckpointManager(sys.argv[1], config=cg.CheckpointConfig(retention=cg.KeepLast(1)))
for step in (1, 2):
    mgr.save(
        step,
        {
            "w": torch.full((4,), float(step)),
            "big": torch.arange(1 << 16, dtype=torch.float32) * step,
        },
    )
time.sleep(120)
"""


def test_a_kill_mid_delete_leaves_every_committed_step_whole(tmp_path):
    root, marker = tmp_path / "ck", tmp_path / "marker"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_MID_DELETE, str(root), str(marker)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 90
        while not marker.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), (
            child.communicate(timeout=5)[0] if child.poll() is not None else "no marker in 90 s"
        )
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    (leftover,) = _trash(
        root
    )  # half deleted, no step name, no manifest: never taken for a checkpoint
    assert not (leftover / "manifest.json").exists()
    (found,) = [x for x in leftovers(root, max_age_s=3600) if x.kind == "trash"]
    assert found.removable and "interrupted" in found.detail, (
        found
    )  # its deleter is dead: gc may remove it
    assert committed_on_disk(root) == [step_dir(root, 2).name]
    (root / "lease.json").unlink(
        missing_ok=True
    )  # the killed writer's lease (its pid is dead anyway)
    checked, findings = verify_root(root, _layout.StepNaming("step_{step:08d}"), deep=True)
    assert [p.name for p in checked] == [step_dir(root, 2).name]
    assert [f for f in findings if f.severity.value == "ERROR"] == [], findings
    mgr = cg.CheckpointManager(root, config=cg.CheckpointConfig(retention=cg.KeepLast(1)))
    state = _state(0)
    got = mgr.restore(state)
    assert got == 2 and torch.equal(state["big"], _state(2)["big"])
    mgr.save(3, _state(3))  # the next rotation sweeps what the kill left
    assert retention.DELETER.wait(30)
    assert _trash(root) == []  # step 2 stays too: the step this process restored is protected
    assert committed_on_disk(root) == [step_dir(root, 2).name, step_dir(root, 3).name]
    mgr.close()
