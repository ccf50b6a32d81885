"""save_async: the caller blocks only for the snapshot, the tracker moves only on commit,
and a background failure is raised at the next call, never lost."""

from __future__ import annotations

import errno
import logging
import threading
from pathlib import Path

import pytest
import torch

import ckptguard as cg
from ckptguard import AsyncOptions, _faults
from ckptguard._disk import layout as _layout
from ckptguard.demo.toyjob import build_job, fingerprint, train_step
from ckptguard.storage.dcp import DCPStorage
from ckptguard.testing import run_ranks, values


def test_snapshot_is_independent_and_tracker_moves_only_on_commit(tmp_path):
    root = tmp_path / "ck"
    mgr = cg.CheckpointManager(root)
    job = build_job()
    train_step(job)
    mgr.save(1, job.state())
    train_step(job)
    saved = fingerprint(job)
    gate = threading.Event()
    _faults.set_hook("commit.before_tracker", gate.wait)
    try:
        pending = mgr.save_async(2, job.state())
        train_step(job)  # the live state moves on while the commit runs
        assert not pending.done() and _layout.read_tracker(root) == 1
        gate.set()
        assert pending.wait() == root / "step_00000002"
    finally:
        _faults.set_hook("commit.before_tracker", None)
    assert _layout.read_tracker(root) == 2 and pending.blocked_seconds < 5
    fresh = build_job(seed=3)
    assert mgr.restore(fresh.state()) == 2
    assert fingerprint(fresh) == saved  # the snapshot, not the state after the extra step


class _Broken(DCPStorage):
    def write(self, state_dir, tensors, ctx):
        raise OSError(errno.EIO, "Input/output error", str(state_dir / "__0_0.distcp"))


def test_background_failure_is_raised_at_the_next_call(tmp_path):
    mgr = cg.CheckpointManager(tmp_path / "ck", storage=_Broken())
    pending = mgr.save_async(1, {"w": torch.ones(3)})
    with pytest.raises(cg.CheckpointWriteError, match="errno 5"):
        mgr.save(2, {"w": torch.ones(3)})  # the next call surfaces the background error
    assert _layout.read_tracker(tmp_path / "ck") == 0
    with pytest.raises(cg.CheckpointWriteError):
        pending.wait()  # and the handle still holds it
    assert mgr.wait() is None  # nothing left pending


def test_over_budget_snapshot_is_written_in_the_background_and_reported(tmp_path, caplog):
    cfg = cg.CheckpointConfig(async_save=AsyncOptions(host_bytes=1024))
    mgr = cg.CheckpointManager(tmp_path / "ck", config=cfg)
    caplog.set_level(logging.WARNING, logger="ckptguard")
    assert (
        mgr.prepare_async({"w": torch.ones(1 << 16)}).result(timeout=30) == 0
    )  # no region it could use
    pending = mgr.save_async(1, {"w": torch.ones(1 << 16)})
    assert pending.wait() == tmp_path / "ck" / "step_00000001"
    # Never a silent synchronous save: the writer read the live tensor, and the log says so.
    assert "262144 of 262144 B are not staged (host staging budget 1024 B, pool 0 B)" in caplog.text
    with pytest.raises(cg.ConfigError, match="host_bytes"):
        cg.CheckpointConfig(async_save=AsyncOptions(host_bytes=-1))


def _async_ranks(rank: int, world: int, root: str) -> bool:
    job = build_job(rank=rank, world=world)
    mgr = cg.CheckpointManager(root)
    train_step(job)
    saved = fingerprint(job)
    pending = mgr.save_async(1, job.state())
    for _ in range(3):
        train_step(job)  # FSDP2 collectives on the default group while the commit runs
    assert pending.wait() == Path(root) / "step_00000001"
    fresh = build_job(rank=rank, world=world, seed=2)
    mgr.restore(fresh.state())
    return fingerprint(fresh) == saved


def test_async_save_under_fsdp2_on_two_ranks(tmp_path):
    assert values(run_ranks(_async_ranks, 2, str(tmp_path / "ck"))) == [True, True]


def test_plain_values_are_snapshotted_too(tmp_path):
    mgr = cg.CheckpointManager(tmp_path / "ck")
    counters = {"tokens": 100}
    state = {"counters": counters, "w": torch.ones(2)}
    gate = threading.Event()
    _faults.set_hook("commit.before_manifest", gate.wait)
    try:
        pending = mgr.save_async(1, state)
        counters["tokens"] = 999  # the trainer moves on before the commit finished
        gate.set()
        pending.wait()
    finally:
        _faults.set_hook("commit.before_manifest", None)
    target = {"counters": {}, "w": torch.zeros(2)}
    mgr.restore(target)
    assert target["counters"] == {"tokens": 100}
