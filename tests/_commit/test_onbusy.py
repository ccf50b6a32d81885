"""A save_async requested while a commit is in flight, per CheckpointConfig.on_busy, on real gloo
ranks: COALESCE queues the newest request (snapshotted then, restored bitwise) and starts it only
where every rank agrees; FAST_TIER writes it beside a TieredCheckpoint's persistent commit, to the
fast tier alone; the front doors refuse the policies they cannot follow."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import ckptguard as cg
from ckptguard._records.proofreader import read_records
from ckptguard.cli import main
from ckptguard.testing import run_ranks, set_fault_hook, values

pytestmark = pytest.mark.timeout(300)


def _state(rank: int) -> dict[str, Any]:
    return {"w": cg.PerRank(torch.zeros(64)), "shared": torch.zeros(32)}


def _bump(state: dict[str, Any], rank: int, step: int) -> dict[str, torch.Tensor]:
    """The training step ``step`` in place; returns a copy of what a save requested now must
    hold."""
    state["w"].value.fill_(100.0 * rank + step)
    state["shared"].fill_(float(step))
    return {"w": state["w"].value.clone(), "shared": state["shared"].clone()}


def _cost(root: Path, step: int) -> dict[str, Any]:
    return json.loads((root / f"step_{step:08d}" / "manifest.json").read_text())["cost"]


def _events(root: Path, rank: int, event: str) -> list[int]:
    return [r["step"] for r in read_records(root)[rank] if r["event"] == event]


def _restored(root: Path, rank: int) -> tuple[int, dict[str, torch.Tensor]]:
    fresh = _state(rank)
    step = cg.CheckpointManager(root).restore(fresh)
    w = fresh["w"].value if isinstance(fresh["w"], cg.PerRank) else fresh["w"]
    return step, {"w": w, "shared": fresh["shared"]}


def _coalescing(rank: int, world: int, root: str) -> dict[str, Any]:
    gate = threading.Event()
    set_fault_hook("commit.before_tracker", gate.wait)  # step 1's commit held on both ranks
    mgr = cg.CheckpointManager(
        root,
        config=cg.CheckpointConfig(
            timeout_s=60, async_save=cg.AsyncOptions(on_busy=cg.OnBusy.COALESCE, host_bytes=1 << 20)
        ),
    )
    state = _state(rank)
    assert mgr.prepare_async(state).result(timeout=60) > 0  # both staging sets, off this thread
    _bump(state, rank, 1)
    first = mgr.save_async(1, state)
    out: dict[str, Any] = {"queued": []}
    wanted = {}
    for step in (2, 3):
        wanted[step] = _bump(state, rank, step)
        out["queued"].append((mgr.save_async(step, state), mgr.queue.queued_step))
    _bump(state, rank, 4)  # after the request: the queue holds step 3's values, never these
    out["poll_busy"] = mgr.poll()
    gate.set()
    set_fault_hook("commit.before_tracker", None)
    first.wait()
    started = mgr.poll()  # every rank's commit ended: the queued step starts, on every rank
    out["started"] = started.step if started is not None else None
    out["waited"] = str(mgr.wait())
    out["steps"] = mgr.committed_steps()
    out["counts"] = (mgr.busy.coalesced_total, mgr.busy.skipped_total)
    out["events"] = {
        e: _events(Path(root), rank, e) for e in ("busy_queue", "busy_coalesced", "busy_skip")
    }
    mgr.close()
    step, got = _restored(Path(root), rank)
    out["restored"] = step
    out["bitwise"] = all(torch.equal(got[k], wanted[3][k]) for k in ("w", "shared"))
    return out


def test_coalesce_queues_the_newest_request_and_restores_it_bitwise(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    out = values(run_ranks(_coalescing, 2, str(root), timeout=240))
    for o in out:
        assert (
            o["queued"] == [(None, 2), (None, 3)] and o["poll_busy"] is None and o["started"] == 3
        ), o
        assert (
            o["waited"].endswith("step_00000003") and o["steps"] == [1, 3] and o["counts"] == (1, 0)
        ), o
        assert o["events"] == {"busy_queue": [2, 3], "busy_coalesced": [2], "busy_skip": []}, o
        assert o["restored"] == 3 and o["bitwise"], o
    cost = _cost(root, 3)
    assert (
        cost["on_busy"] == "coalesce" and cost["coalesced_steps"] == [2] and cost["live_bytes"] == 0
    )
    assert cost["queued_s"] > 0 and cost["skipped_saves"] == 0
    shown = CliRunner().invoke(main, ["verify", str(root / "step_00000003")])
    assert shown.exit_code == 0 and "1 save(s) coalesced before it" in shown.output, shown.output


def _uneven(rank: int, world: int, root: str) -> dict[str, Any]:
    """Rank 1's commit of step 1 ends long before rank 0's (held in its bookkeeping after every
    agreement): rank 1 is idle with step 2 queued while rank 0 replaces... nothing: both replace it
    together, later."""
    mgr = cg.CheckpointManager(
        root,
        config=cg.CheckpointConfig(
            timeout_s=60, async_save=cg.AsyncOptions(on_busy=cg.OnBusy.COALESCE, host_bytes=1 << 20)
        ),
    )
    release = threading.Event()
    if rank == 0:
        trust = mgr.core.trust_committed

        def slow(step: int) -> None:
            assert release.wait(60)
            trust(step)

        mgr.core.trust_committed = slow  # type: ignore[method-assign]
    state = _state(rank)
    mgr.prepare_async(state).result(timeout=60)
    _bump(state, rank, 1)
    first = mgr.save_async(1, state)
    _bump(state, rank, 2)
    out: dict[str, Any] = {"second": mgr.save_async(2, state), "queued_2": mgr.queue.queued_step}
    if rank == 1:
        first.wait()  # this rank's commit ended; rank 0's has not
    out["idle_here"] = not first.busy()
    out["poll_1"] = mgr.poll()  # busy on rank 0: nobody starts step 2, rank 1 neither
    wanted = _bump(state, rank, 3)
    out["third"] = mgr.save_async(3, state)
    out["queued_3"] = mgr.queue.queued_step
    if rank == 0:
        release.set()
        first.wait()
    started = mgr.poll()
    out["started"] = started.step if started is not None else None
    mgr.wait()
    out["steps"] = mgr.committed_steps()
    out["dirs"] = sorted(
        p.name for p in Path(root).iterdir() if p.name.startswith((".tmp", "step_"))
    )
    out["coalesced"] = _events(Path(root), rank, "busy_coalesced")
    mgr.close()
    step, got = _restored(Path(root), rank)
    out["bitwise"] = step == 3 and all(torch.equal(got[k], wanted[k]) for k in ("w", "shared"))
    return out


def test_no_rank_starts_a_queued_save_that_another_rank_replaced(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    out = values(run_ranks(_uneven, 2, str(root), timeout=240))
    assert [o["idle_here"] for o in out] == [False, True]  # the local views differ
    for o in out:  # the decisions do not: step 2 never started anywhere, step 3 on both
        assert o["second"] is None and o["queued_2"] == 2 and o["poll_1"] is None, o
        assert o["third"] is None and o["queued_3"] == 3 and o["started"] == 3, o
        assert o["steps"] == [1, 3] and o["dirs"] == ["step_00000001", "step_00000003"], o
        assert o["coalesced"] == [2] and o["bitwise"], o


def _cannot_hold(rank: int, world: int, root: str) -> dict[str, Any]:
    # Rank 1's host staging budget holds one snapshot's tensors (128 B) but not a second: a queued
    # one would read live.
    budget = 1 << 20 if rank == 0 else 200
    gate = threading.Event()
    set_fault_hook("commit.before_tracker", gate.wait)
    mgr = cg.CheckpointManager(
        root,
        config=cg.CheckpointConfig(
            timeout_s=60, async_save=cg.AsyncOptions(on_busy=cg.OnBusy.COALESCE, host_bytes=budget)
        ),
    )
    state = _state(rank)
    mgr.prepare_async(state).result(timeout=60)
    first = mgr.save_async(1, state)
    _bump(state, rank, 2)
    out: dict[str, Any] = {"second": mgr.save_async(2, state), "queued": mgr.queue.queued_step}
    gate.set()
    set_fault_hook("commit.before_tracker", None)
    first.wait()
    out["skipped"] = mgr.busy.skipped_total
    out["reason"] = [
        r["reason"] for r in read_records(Path(root))[rank] if r["event"] == "busy_skip"
    ]
    _bump(state, rank, 3)
    mgr.save_async(3, state)
    mgr.wait()
    out["steps"] = mgr.committed_steps()
    mgr.close()
    return out


def test_a_request_one_rank_cannot_hold_whole_is_skipped_on_every_rank(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    out = values(run_ranks(_cannot_hold, 2, str(root), timeout=240))
    for o in out:
        assert (
            o["second"] is None
            and o["queued"] is None
            and o["skipped"] == 1
            and o["steps"] == [1, 3]
        ), o
        (reason,) = o["reason"]
        assert "not queued: rank 1 cannot hold the snapshot whole in host memory" in reason, reason
        assert "it needs 128 B of host staging beside the commit's" in reason, reason
    assert _cost(root, 3)["skipped_steps"] == [2]


def _redirecting(rank: int, world: int, base: str) -> dict[str, Any]:
    tiers = cg.TieredCheckpoint(
        Path(base) / "fast",
        persistent=Path(base) / "pers",
        fast_every=1,
        persistent_every=2,
        config=cg.CheckpointConfig(
            timeout_s=60,
            async_save=cg.AsyncOptions(on_busy=cg.OnBusy.FAST_TIER, host_bytes=1 << 20),
        ),
    )
    fast_gate, pers_gate = threading.Event(), threading.Event()
    if (
        rank == 0
        # rank 0's commits end late: its fast one when fast_gate is set, its persistent one on
        # pers_gate
    ):
        for mgr, gate in ((tiers.fast, fast_gate), (tiers.persistent, pers_gate)):

            def slow(
                step: int, trust: Any = mgr.core.trust_committed, gate: threading.Event = gate
            ) -> None:
                assert gate.wait(60)
                trust(step)

            mgr.core.trust_committed = slow  # type: ignore[method-assign]
    state = _state(rank)
    tiers.prepare_async(state).result(
        timeout=60
    )  # staged whole: changes below never reach a commit
    _bump(state, rank, 2)
    first = tiers.save_async(2, state)
    tiers.staged()
    _bump(state, rank, 3)
    out: dict[str, Any] = {
        "third": tiers.save_async(3, state)
    }  # rank 0's fast commit still runs: skipped
    fast_gate.set()
    assert first.fast_committed.wait(
        60
    )  # the fast part ended here; rank 0's persistent commit still runs
    tiers.staged()
    wanted = _bump(state, rank, 4)
    fourth = tiers.save_async(4, state)
    out["fourth"] = [t.value for t in fourth.tiers] if fourth is not None else None
    assert fourth is None or fourth.fast_committed.wait(60)
    out["persistent_busy"] = first.busy() if rank == 0 else None  # step 4 committed beside it
    pers_gate.set()
    tiers.wait()
    out["fast"], out["persistent"] = (
        tiers.fast.committed_steps(),
        tiers.persistent.committed_steps(),
    )
    out["counts"] = (tiers.busy.skipped_total, tiers.busy.redirected_total)
    home = Path(base) / "pers"
    out["events"] = {e: _events(home, rank, e) for e in ("busy_skip", "busy_redirect")}
    tiers.close()
    again = cg.TieredCheckpoint(
        Path(base) / "fast", persistent=home, fast_every=1, persistent_every=2
    )
    fresh = _state(rank)
    out["restored"] = again.restore(fresh)
    out["bitwise"] = torch.equal(fresh["w"].value, wanted["w"]) and torch.equal(
        fresh["shared"], wanted["shared"]
    )
    again.close()
    return out


def test_fast_tier_writes_a_save_beside_the_persistent_commit_and_records_it(
    tmp_path: Path,
) -> None:
    out = values(run_ranks(_redirecting, 2, str(tmp_path), timeout=240))
    for o in out:
        assert o["third"] is None and o["fourth"] == ["fast"] and o["counts"] == (1, 1), o
        assert o["fast"] == [2, 4] and o["persistent"] == [2], o
        assert o["events"] == {"busy_skip": [3], "busy_redirect": [4]}, o
        assert o["restored"] == 4 and o["bitwise"], (
            o
        )  # the same nodes: resumed from the redirected step
    assert out[0]["persistent_busy"] is True
    cost = _cost(tmp_path / "fast", 4)
    assert (
        cost["on_busy"] == "fast_tier"
        and cost["redirected_steps"] == [4]
        and cost["skipped_steps"] == [3]
    )
    shown = CliRunner().invoke(main, ["verify", str(tmp_path / "fast" / "step_00000004")])
    assert shown.exit_code == 0 and "1 save(s) redirected to the fast tier" in shown.output, (
        shown.output
    )
    assert "1 save(s) skipped before it" in shown.output


def test_each_front_door_refuses_a_policy_it_cannot_follow(tmp_path: Path) -> None:
    fast_tier = cg.CheckpointConfig(async_save=cg.AsyncOptions(on_busy=cg.OnBusy.FAST_TIER))
    said = (
        r"CheckpointManager: CheckpointConfig\(async_save="
        r"AsyncOptions\(on_busy=OnBusy.FAST_TIER\)\)"
    )
    with pytest.raises(cg.ConfigError, match=said):
        cg.CheckpointManager(tmp_path / "m", config=fast_tier)
    with pytest.raises(
        cg.ConfigError, match=r"RunCheckpoint: .*OnBusy.COALESCE.*OnBusy.SKIP, OnBusy.WAIT"
    ):
        cg.RunCheckpoint(
            tmp_path / "r",
            [cg.Role("actor", ranks=[0])],
            config=cg.CheckpointConfig(async_save=cg.AsyncOptions(on_busy=cg.OnBusy.COALESCE)),
        )
    with pytest.raises(cg.ConfigError, match=r"TieredCheckpoint: .*OnBusy.COALESCE"):
        cg.TieredCheckpoint(
            tmp_path / "f",
            persistent=tmp_path / "p",
            config=cg.CheckpointConfig(async_save=cg.AsyncOptions(on_busy=cg.OnBusy.COALESCE)),
        )
    with pytest.raises(cg.ConfigError, match="SKIP, WAIT, COALESCE, FAST_TIER"):
        cg.AsyncOptions(on_busy="coalesce")  # type: ignore[arg-type]


def test_coalesce_stays_within_its_host_factor_or_skips_with_the_figure(tmp_path: Path) -> None:
    """Under the derived host budget, COALESCE never holds a second staging set beside a full first
    one (2.0x the state, issue 41): the request is skipped, its reason naming the figure, and
    nothing is staged."""
    root = tmp_path / "ck"
    gate = threading.Event()
    mgr = cg.CheckpointManager(
        root,
        config=cg.CheckpointConfig(
            timeout_s=60, async_save=cg.AsyncOptions(on_busy=cg.OnBusy.COALESCE)
        ),
    )
    state = {"w": torch.arange(1 << 16, dtype=torch.float32)}
    mgr.save_async(1, state).wait()  # the first set now holds the state
    set_fault_hook("commit.before_tracker", gate.wait)  # step 2's commit held
    try:
        second = mgr.save_async(2, state)
        assert second is not None
        assert mgr.save_async(3, state) is None and mgr.queue.queued_step is None
        spare = mgr.queue.spare()
        assert spare.pool is None or spare.pool.held_bytes == 0
    finally:
        gate.set()
        set_fault_hook("commit.before_tracker", None)
    second.wait()
    assert mgr.busy.skipped_total == 1 and mgr.busy.coalesced_total == 0
    (reason,) = [r["reason"] for r in read_records(root)[0] if r["event"] == "busy_skip"]
    assert "2.00x the state in host memory, over OnBusy.COALESCE's 1.05x" in reason, reason
    assert "host_bytes to 524288 B" in reason, reason
    mgr.close()
