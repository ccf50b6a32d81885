"""Two threads of one rank agreeing through the c10d store at once must not block each other.

A c10d store client runs one request at a time: with one shared client, a background commit
waiting for a slower peer's key held up the training thread's PreemptionGuard flag (or a second
manager's commit), the peer's threads waited likewise, and every rank ended in
CollectiveTimeoutError. Each agreement now has a store connection of its own.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import torch

import ckptguard as cg
from ckptguard import AsyncOptions, _faults
from ckptguard._disk import layout as _layout
from ckptguard._records import retention
from ckptguard.testing import run_ranks, values

# The shared-client deadlock ends in a CollectiveTimeoutError after TIMEOUT_S (the old code failed
# so; about 60 s with the shared client put back), or in too few boundaries agreed during the
# commit. A correct run waits for neither: no assertion below depends on the machine's speed.
TIMEOUT_S = 60.0
GATE_S = 30.0
"""How long rank 1's commit holds at its written point for the boundaries it waits for (a bound
only: a correct run opens the gate after BOUNDARIES boundaries)."""
SLOW_S = 1.5
"""How much longer rank 1's commits write in ``_two_managers``: rank 0's wait for its keys."""
BOUNDARIES = 5


def _boundaries_file(base: str, rank: int) -> Path:
    return Path(f"{base}.rank{rank}-{BOUNDARIES}-boundaries")


def _hold_rank_one(rank: int, world: int, base: str) -> None:
    """Rank 1's commit holds at its written point (so no rank's commit can end) until every rank's
    training thread agreed BOUNDARIES step boundaries, or GATE_S passed."""
    if rank != 1:
        return
    files = [_boundaries_file(base, r) for r in range(world)]

    def held() -> None:
        deadline = time.monotonic() + GATE_S
        while not all(f.exists() for f in files) and time.monotonic() < deadline:
            time.sleep(0.01)

    _faults.set_hook("commit.rank_written", held)


def _guard_while_pending(rank, world, base):
    """The reproduction: step boundaries on the training thread while save_async commits."""
    mgr = cg.CheckpointManager(base, config=cg.CheckpointConfig(timeout_s=TIMEOUT_S))
    guard = cg.PreemptionGuard(mgr, grace_s=60)
    _hold_rank_one(rank, world, base)
    state = {"w": cg.PerRank(torch.full((1000,), float(rank)))}
    pending = mgr.save_async(1, state)
    overlapped = 0  # boundaries agreed while this rank's commit was still running
    for step in range(2, 30):
        overlapped += not pending.done()
        guard.step_boundary(step, state)
        if step - 1 == BOUNDARIES:
            _boundaries_file(base, rank).touch()  # lets rank 1's commit (and so every rank's) end
    committed = mgr.wait()
    return {"overlapped": overlapped, "committed": str(committed)}


def test_preemption_guard_agrees_while_save_async_commits(tmp_path):
    base = tmp_path / "ck"
    out = values(run_ranks(_guard_while_pending, 2, str(base), timeout=240))
    for rank, got in enumerate(out):
        # The guard really agreed during the commit: no commit ends before every rank agreed
        # BOUNDARIES boundaries, unless they were blocked behind it (the deadlock) for GATE_S.
        assert got["overlapped"] >= BOUNDARIES, (rank, got)
        assert got["committed"] == str(base / "step_00000001"), (rank, got)
    assert _layout.read_tracker(base) == 1


def _two_managers(rank, world, base_a, base_b):
    """Two managers' background commits agreeing at the same time on every rank. No rank's commits
    pass their written point before every rank has seen both in flight (a flag file each); rank 1's
    then write SLOW_S longer."""
    cfg = cg.CheckpointConfig(timeout_s=TIMEOUT_S)
    a, b = cg.CheckpointManager(base_a, config=cfg), cg.CheckpointManager(base_b, config=cfg)
    flags = [Path(f"{base_a}.rank{r}-saw-both") for r in range(world)]

    def written() -> None:
        deadline = time.monotonic() + 60
        while not all(f.exists() for f in flags) and time.monotonic() < deadline:
            time.sleep(0.01)
        if rank == 1:
            time.sleep(SLOW_S)

    _faults.set_hook("commit.rank_written", written)
    pa = a.save_async(1, {"w": cg.PerRank(torch.full((1000,), float(rank)))})
    pb = b.save_async(7, {"v": cg.PerRank(torch.full((500,), float(rank) + 1))})
    both_pending = not pa.done() and not pb.done()
    flags[rank].touch()
    return {
        "both_pending": both_pending,
        "a": str(a.wait()),
        "b": str(b.wait()),
    }


def test_two_managers_commit_in_background_at_once(tmp_path):
    base_a, base_b = tmp_path / "a", tmp_path / "b"
    # The deadlock ends in a CollectiveTimeoutError (TIMEOUT_S), which a.wait() or b.wait() raises.
    out = values(run_ranks(_two_managers, 2, str(base_a), str(base_b), timeout=240))
    for rank, got in enumerate(out):
        assert got["both_pending"], (rank, got)
        assert got["a"] == str(base_a / "step_00000001"), (rank, got)
        assert got["b"] == str(base_b / "step_00000007"), (rank, got)
    assert _layout.read_tracker(base_a) == 1 and _layout.read_tracker(base_b) == 7


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _many_saves(rank, world, base, n):
    """Store connections are per agreement, never per save or per commit thread."""
    config = cg.CheckpointConfig(timeout_s=30, async_save=AsyncOptions(on_busy=cg.OnBusy.WAIT))
    mgr = cg.CheckpointManager(base, config=config)
    guard = cg.PreemptionGuard(mgr, grace_s=60)
    state = {"w": cg.PerRank(torch.full((10,), float(rank)))}
    # Warm up first: the first save opens files and pools that stay open by design.
    mgr.save_async(1, state)
    guard.step_boundary(1, state)
    mgr.wait()
    before, threads = _fds(), threading.active_count()
    for step in range(2, n + 2):
        mgr.save_async(step, state)
        guard.step_boundary(step, state)  # agrees on its own connection while the commit runs
    mgr.wait()
    # On rank 0 the store's server closes its side of a dropped connection asynchronously;
    # retention's background delete (one thread while there is trash, gone when there is none) ends
    # on its own too.
    assert retention.DELETER.wait(30)
    deadline = time.monotonic() + 30  # a leaked connection or thread never settles
    while (_fds() > before or threading.active_count() > threads) and time.monotonic() < deadline:
        time.sleep(0.1)
    return {
        "before": before,
        "after": _fds(),
        "threads": threads,
        "threads_after": threading.active_count(),
    }


def test_many_background_saves_leak_no_store_connection(tmp_path):
    n = 50
    out = values(run_ranks(_many_saves, 2, str(tmp_path / "ck"), n, timeout=120))
    for rank, got in enumerate(out):
        assert got["after"] <= got["before"], (rank, got)
        assert got["threads_after"] <= got["threads"], (rank, got)
    assert _layout.read_tracker(tmp_path / "ck") == n + 1


def _manager_clone_dropped(rank, world, base):
    """A dropped agreement's connection closes with it (the clone is not kept anywhere)."""
    import gc

    from ckptguard._dist import StoreAgreement

    StoreAgreement(None, timeout_s=30, namespace="warmup").exchange("warm", rank)
    gc.collect()
    before = _fds()
    held = []
    for i in range(5):
        # Spaced out: a burst of new connections stalls 5 s in torch 2.13's TCPStore.
        time.sleep(0.2)
        held.append(StoreAgreement(None, timeout_s=30, namespace=f"n{i}"))
        assert held[-1].exchange("hello", rank) == [0, 1]
    opened = _fds()
    del held
    gc.collect()
    t0 = time.monotonic()
    while _fds() > before and time.monotonic() < t0 + 30:  # a leaked connection never settles
        time.sleep(0.1)
    settle = time.monotonic() - t0
    torch.distributed.barrier()
    return {"before": before, "opened": opened, "after": _fds(), "settle": settle}


def test_agreement_connections_close_when_dropped(tmp_path):
    out = values(run_ranks(_manager_clone_dropped, 2, str(tmp_path), timeout=60))
    for rank, got in enumerate(out):
        assert got["opened"] >= got["before"] + 5, (rank, got)  # one connection per agreement
        assert got["after"] <= got["before"], (rank, got)


class _NoClone:
    """A store as older torch has it: no clone()."""


class _CloneFails:
    def clone(self):
        raise RuntimeError("clone is not supported by this store")


def test_store_without_clone_keeps_the_shared_client_and_says_so_once(caplog, monkeypatch):
    from ckptguard import _dist

    monkeypatch.setattr(_dist, "_shared_logged", False)
    old, failing = _NoClone(), _CloneFails()
    with caplog.at_level(logging.DEBUG, logger="ckptguard"):
        assert _dist.own_connection(old) is old
        assert _dist.own_connection(failing) is failing
    said = [r for r in caplog.records if "shared store client" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.DEBUG
    assert "_NoClone has no clone()" in said[0].getMessage()
