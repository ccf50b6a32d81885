"""Saves that never stall the loop: the on_busy policy (agreed by every rank), the pool pinned off
the caller's thread, retention after the commit off the next save's path."""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest
import torch
from click.testing import CliRunner

import ckptguard as cg
from ckptguard import _faults
from ckptguard._disk import layout as _layout
from ckptguard._records import retention as _retention
from ckptguard._records.proofreader import read_records
from ckptguard.cli import main
from ckptguard.storage import _staging
from ckptguard.testing import run_ranks, values


def _state(value: float = 0.0) -> dict:
    return {"w": torch.full((256,), value), "step": 0}


def _cost(root, step: int) -> dict:
    return json.loads((root / f"step_{step:08d}" / "manifest.json").read_text())["cost"]


def _disagreeing_ranks(rank, world, base):
    """Rank 0 is still in its commit's bookkeeping (after every agreement) while rank 1's commit is
    done: their local views differ, the decision must not."""
    mgr = cg.CheckpointManager(base, config=cg.CheckpointConfig(timeout_s=20))
    asked = threading.Event()  # rank 0's save_async(2) returned: its commit may end now
    if rank == 0:
        trust = mgr.core.trust_committed

        def slow(step):
            asked.wait(60)  # bounded: a save_async(2) that waited for the commit ends, and fails
            trust(step)

        mgr.core.trust_committed = slow
    state = {"w": cg.PerRank(torch.full((64,), float(rank)))}
    first = mgr.save_async(1, state)
    if rank == 1:
        first.wait()  # rank 1 is idle now; rank 0 is not (held until its save_async(2) returned)
    busy_here = first.busy()
    skipped = mgr.save_async(2, state)
    asked.set()
    mgr.wait()
    third = mgr.save_async(3, state)
    path = third.wait() if third is not None else None
    recs = read_records(base)[rank]
    return {
        "busy_here": busy_here,
        "skipped": skipped is None,
        "count": mgr.busy.skipped_total,
        "third": str(path),
        "steps": mgr.committed_steps(),
        "records": [r["step"] for r in recs if r["event"] == "busy_skip"],
    }


def test_a_save_requested_during_a_commit_on_one_rank_is_skipped_on_every_rank(tmp_path):
    out = values(run_ranks(_disagreeing_ranks, 2, tmp_path / "ck", timeout=120))
    assert [o["busy_here"] for o in out] == [True, False]  # the local views differ
    for o in out:  # the decision does not: no rank snapshots step 2, no rank hangs in its commit
        assert o["skipped"] and o["count"] == 1 and o["steps"] == [1, 3] and o["records"] == [2], o
    cost = _cost(tmp_path / "ck", 3)
    assert cost["skipped_saves"] == 1 and cost["skipped_steps"] == [2] and cost["on_busy"] == "skip"


def test_skip_says_which_interval_fits_the_commit_and_wait_still_waits(tmp_path, caplog):
    gate = threading.Event()
    _faults.set_hook("commit.before_tracker", gate.wait)
    mgr = cg.CheckpointManager(tmp_path / "ck")
    try:
        first = mgr.save_async(2, _state())
        time.sleep(0.3)  # the loop's next steps while the commit is held
        safety = threading.Timer(
            60, gate.set
        )  # a request that waited for the commit ends, and fails
        safety.daemon = True
        safety.start()
        with caplog.at_level(logging.INFO, logger="ckptguard"):
            assert mgr.save_async(4, _state(1.0)) is None
            assert not gate.is_set()  # skipped while the commit is held, never waiting for it
        gate.set()
        safety.cancel()
        assert first.wait() == tmp_path / "ck" / "step_00000002"
    finally:
        _faults.set_hook("commit.before_tracker", None)
    # status on the root says what is held back: step 4, which no committed step's cost block
    # carries yet
    held = CliRunner().invoke(main, ["status", str(tmp_path / "ck")])
    assert (
        "held back by a commit in flight after step 2: 1 skipped (skipped steps [4])" in held.output
    ), held.output
    assert (
        "in all the proof records: 1 skipped" in held.output
        and "space the saves wider" in held.output
    )
    warning = next(r.getMessage() for r in caplog.records if "SKIPPED" in r.getMessage())
    assert "save_async of step 4 SKIPPED (1 so far)" in warning and "step 2's commit" in warning
    assert "steps or more fits it" in warning and "on_busy=OnBusy.WAIT" in warning
    mgr.save_async(
        6, _state(2.0)
    ).wait()  # the next committed step carries the skip; verify shows it
    assert _cost(tmp_path / "ck", 6)["skipped_steps"] == [4]
    shown = CliRunner().invoke(main, ["verify", str(tmp_path / "ck" / "step_00000006")])
    assert shown.exit_code == 0 and "1 save(s) skipped before it" in shown.output, shown.output
    held = CliRunner().invoke(
        main, ["status", str(tmp_path / "ck")]
    )  # carried by step 6 now; no phase records
    assert "after step 6: none; in all the proof records: 1 skipped" in held.output, held.output
    assert (
        held.exit_code == 0 and "no phase records" in held.output
    )  # the root's state instead (issue 42)
    assert "a resume now: resume from step 6" in held.output
    # WAIT: the request waits for the commit in flight and is saved.
    wait = cg.CheckpointConfig(async_save=cg.AsyncOptions(on_busy=cg.OnBusy.WAIT))
    waiting = cg.CheckpointManager(tmp_path / "w", config=wait)
    waiting.save_async(1, _state())
    waiting.save_async(2, _state())
    waiting.wait()
    assert waiting.committed_steps() == [1, 2] and waiting.busy.skipped_total == 0
    with pytest.raises(cg.ConfigError, match="on_busy must be an OnBusy"):
        cg.AsyncOptions(on_busy="skip")  # type: ignore[arg-type]


class _SlowPin(_staging.Buffer):
    """A region whose pinning lasts until the test opens ``gate`` (6 GiB took 1.26-1.38 s on the
    H200): a save that waited for it could only return once the gate opened, which ``_closed_gate``
    does after 60 s."""

    threads: list[str] = []
    gate = threading.Event()

    def __init__(self, size, pin):
        _SlowPin.threads.append(threading.current_thread().name)
        _SlowPin.gate.wait(60)
        super().__init__(size, pin)


def _closed_gate() -> threading.Timer:
    _SlowPin.threads = []
    _SlowPin.gate.clear()
    safety = threading.Timer(60, _SlowPin.gate.set)  # a save that waits for the pin ends, and fails
    safety.daemon = True
    safety.start()
    return safety


def _pinned_on_the_pool_thread() -> bool:
    deadline = time.monotonic() + 30
    while not _SlowPin.threads and time.monotonic() < deadline:
        time.sleep(0.01)
    return _SlowPin.threads == ["ckptguard-pin-pool"]


def test_the_first_save_async_never_pins_on_the_callers_thread(tmp_path, monkeypatch):
    monkeypatch.setattr(_staging, "Buffer", _SlowPin)
    safety = _closed_gate()
    root = tmp_path / "ck"
    mgr = cg.CheckpointManager(
        root, config=cg.CheckpointConfig(async_save=cg.AsyncOptions(host_bytes=1 << 20))
    )
    state = {"model": torch.nn.Linear(64, 64)}
    ready = mgr.prepare_async(state)
    first = mgr.save_async(1, state)
    first.wait()
    # Saved and committed while the pool is still being pinned: nothing waited for it.
    assert not _SlowPin.gate.is_set() and not ready.done()
    assert _pinned_on_the_pool_thread()
    assert (
        _cost(root, 1)["live_bytes"] > 0
    )  # read live this once (the documented wait), never a sync save
    _SlowPin.gate.set()
    safety.cancel()
    assert ready.result(timeout=30) > 0 and _SlowPin.threads == ["ckptguard-pin-pool"]
    second = mgr.save_async(2, state)
    second.wait()
    cost = _cost(root, 2)
    assert cost["live_bytes"] == 0 and cost["staged_host_bytes"] == 64 * 64 * 4 + 64 * 4
    # Without prepare_async, the first save_async starts the pool in the background too.
    safety = _closed_gate()
    other = cg.CheckpointManager(
        tmp_path / "o", config=cg.CheckpointConfig(async_save=cg.AsyncOptions(host_bytes=1 << 20))
    )
    other.save_async(1, state).wait()
    assert not _SlowPin.gate.is_set() and _pinned_on_the_pool_thread()
    _SlowPin.gate.set()
    safety.cancel()
    other.close()
    mgr.close()


def test_a_deletion_runs_after_the_commit_and_never_holds_the_next_save(tmp_path, monkeypatch):
    started, armed, release, order = threading.Event(), threading.Event(), threading.Event(), []
    apply = _retention.apply

    def slow_apply(*args, **kwargs):
        started.set()
        order.append("deletion starts")
        if (
            armed.is_set()
        ):  # step 2's cleanup: held until the next save returned (one that waited fails)
            release.wait(60)
        order.append("deletion ends")
        return apply(*args, **kwargs)

    monkeypatch.setattr(_retention, "apply", slow_apply)
    root = tmp_path / "ck"
    mgr = cg.CheckpointManager(root, config=cg.CheckpointConfig(retention=cg.KeepLast(1)))
    mgr.save_async(1, _state()).wait()
    started.clear()
    order.clear()
    armed.set()
    second = mgr.save_async(2, _state(2.0))
    assert started.wait(10)  # step 2 is published; its cleanup (deleting step 1) runs now
    assert not second.busy()
    third = mgr.save_async(3, _state(3.0))
    order.append("next snapshot taken")
    assert third is not None and not release.is_set()  # not skipped, not held by the deletion
    time.sleep(0.5)  # the deletion lasts at least this: its cleanup's figure says so
    release.set()
    third.wait()
    assert order[:3] == ["deletion starts", "next snapshot taken", "deletion ends"]
    assert mgr.committed_steps() == [3] and second.cleanup_seconds >= 0.5
    cleanups = [r for r in read_records(root)[0] if r["event"] == "cleanup"]
    assert [r["deleted"] for r in cleanups] == [[1], [2]] and cleanups[0]["seconds"] >= 0.5
    assert _layout.read_tracker(root) == 3


def test_a_tiered_save_async_during_the_tiers_commit_is_skipped_and_retention_still_runs(tmp_path):
    gate = threading.Event()
    tiers = cg.TieredCheckpoint(
        tmp_path / "fast",
        persistent=tmp_path / "pers",
        fast_every=1,
        persistent_every=2,
        fast_retention=cg.KeepLast(1),
    )
    _faults.set_hook("commit.before_tracker", gate.wait)
    try:
        first = tiers.save_async(1, _state(1.0))
        assert tiers.save_async(2, _state(2.0)) is None and tiers.busy.skipped_total == 1
        gate.set()
        first.wait()
        assert set(first.outcome()) == {cg.Tier.FAST}
    finally:
        _faults.set_hook("commit.before_tracker", None)
    third = tiers.save_async(3, _state(3.0))
    fourth = tiers.save_async(
        4, _state(4.0)
    )  # requested at once: skipped unless step 3's commit ended first
    tiers.wait()
    expected = [3] if fourth is None else [4]
    assert (
        tiers.fast.committed_steps() == expected and third is not None
    )  # KeepLast(1) ran after each commit
    skips = [r["step"] for r in read_records(tmp_path / "pers")[0] if r["event"] == "busy_skip"]
    assert skips == ([2, 4] if fourth is None else [2])
    tiers.close()


def _run_busy_ranks(rank, world, base):
    """A RunCheckpoint's save_async requested while the run step before it still commits (held at
    the tracker on every rank): skipped on every rank, recorded for every role, in the next run
    step's cost."""
    gate = threading.Event()
    _faults.set_hook("commit.before_tracker", gate.wait)
    roles = [cg.Role("actor", ranks=[0, 1]), cg.Role("critic", ranks=[1])]
    run = cg.RunCheckpoint(base, roles, config=cg.CheckpointConfig(timeout_s=30))
    states = {name: {"w": cg.PerRank(torch.full((64,), float(rank)))} for name in run.my_roles}
    try:
        first = run.save_async(1, states)
        skipped = run.save_async(2, states)
    finally:
        gate.set()
        _faults.set_hook("commit.before_tracker", None)
    first.wait()
    third = run.save_async(3, states)
    path = third.wait() if third is not None else None
    recs = read_records(base)
    return {
        "skipped": skipped is None,
        "count": run.busy.skipped_total,
        "steps": run.committed_steps(),
        "third": str(path),
        "roles": run.my_roles,
        "recs": {k: [r["step"] for r in v if r["event"] == "busy_skip"] for k, v in recs.items()},
    }


def test_a_run_checkpoint_save_async_during_a_commit_is_skipped_on_every_rank(tmp_path):
    out = values(run_ranks(_run_busy_ranks, 2, tmp_path / "run", timeout=120))
    for o in out:
        assert o["skipped"] and o["count"] == 1 and o["steps"] == [1, 3], o
        assert o["third"].endswith("step_00000003")
    cost = json.loads((tmp_path / "run" / "step_00000003" / "actor" / "manifest.json").read_text())[
        "cost"
    ]
    assert cost["skipped_steps"] == [2] and cost["on_busy"] == "skip"
