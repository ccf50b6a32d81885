"""Host staging of save_async on the CPU: the ordering logic (a mutation right after save_async
waits for the copies), the state larger than the pool (read live, the next step waits), the pool
reused, reported and released, the budget from the memory contract, the digest pass overlapping
the write, and the background thread's lowered priority. The GPU half is in test_staging_gpu.py."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch

import ckptguard as cg
from ckptguard import AsyncOptions
from ckptguard._commit import pending as _pending
from ckptguard._commit import protocol as _protocol
from ckptguard._priority import lower_this_thread
from ckptguard.memory.budget import host_budget
from ckptguard.memory.host import CgroupVersion, HostSnapshot
from ckptguard.memory.ray import RayConfig
from ckptguard.storage._staging import Fence, StagingPool
from ckptguard.storage.streaming import StreamingStorage

GiB = 1 << 30


class _LazyCopier:
    """Queues the copies and runs them only when the fence is waited on: on the CPU, the order a
    side stream gives on the GPU (the copies land after save_async returned)."""

    def __init__(self) -> None:
        self.queued: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.landed = threading.Event()  # the background writer waits for "the copies landed"

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.queued.append((dst, src))

    def _run(self) -> None:
        while self.queued:
            dst, src = self.queued.pop(0)
            dst.copy_(src)

    def fence(self, *, live: bool, timeout_s: float) -> Fence:
        def host_wait() -> None:
            assert self.landed.wait(30), "the test never let the copies land"
            self._run()

        return Fence(host_wait=host_wait, device_wait=self._run, live=live, timeout_s=timeout_s)


def _job(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, opt


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.ones(8, 32)).square().sum().backward()
    opt.step()


def _restored(mgr: cg.CheckpointManager, with_optim: bool = True) -> dict[str, torch.Tensor]:
    model, opt = _job(seed=9)
    mgr.restore({"model": model, "optim": opt} if with_optim else {"model": model})
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture
def lazy(monkeypatch):
    copier = _LazyCopier()
    monkeypatch.setattr(_pending, "copier_for", lambda sources: copier)
    return copier


def test_an_optimizer_step_right_after_save_async_waits_for_the_copies(tmp_path, lazy):
    model, opt = _job()
    _train(model, opt)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    mgr = cg.CheckpointManager(tmp_path / "ck")
    mgr.prepare_async({"model": model, "optim": opt}).result(timeout=30)  # the pool, pinned ahead
    pending = mgr.save_async(1, {"model": model, "optim": opt})
    assert lazy.queued, "the copies are queued, not done, when save_async returns"
    _train(model, opt)  # the step pre-hook runs the copies before AdamW changes anything
    assert not lazy.queued
    lazy.landed.set()
    pending.wait()
    assert any(not torch.equal(saved[k], v) for k, v in model.state_dict().items())
    got = _restored(mgr)
    assert all(
        torch.equal(saved[k], got[k]) for k in saved
    )  # the value at save_async, not after the step
    assert pending.mutation_wait_seconds >= 0 and pending.fence is not None and pending.fence.passed


def test_two_managers_pending_at_once_do_not_break_the_optimizer_step(tmp_path, lazy):
    # Each save_async registers a global optimizer pre-hook; a hook that removed itself while torch
    # iterated them raised "OrderedDict mutated during iteration" inside the user's opt.step().
    model, opt = _job()
    _train(model, opt)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    actor = cg.CheckpointManager(tmp_path / "actor")
    critic = cg.CheckpointManager(tmp_path / "critic")
    for mgr in (actor, critic):
        mgr.prepare_async({"model": model}).result(timeout=30)
    first = actor.save_async(1, {"model": model})
    second = critic.save_async(1, {"model": model})
    _train(model, opt)  # both hooks run; neither may mutate torch's hook dict while it is iterated
    _train(model, opt)  # disarmed hooks stay harmless until the next save_async or close()
    lazy.landed.set()
    first.wait()
    second.wait()
    for mgr in (actor, critic):
        got = _restored(mgr, with_optim=False)
        assert all(torch.equal(saved[k], got[k]) for k in saved)
        mgr.close()


def test_staged_guards_a_mutation_outside_an_optimizer_step(tmp_path, lazy):
    model, opt = _job()
    _train(model, opt)
    saved = model[0].weight.detach().clone()
    mgr = cg.CheckpointManager(tmp_path / "ck")
    mgr.prepare_async({"model": model}).result(timeout=30)
    pending = mgr.save_async(1, {"model": model})
    assert lazy.queued
    assert mgr.staged() >= 0
    with torch.no_grad():
        model[0].weight.add_(1.0)  # a weight sync into the model, no optimizer involved
    lazy.landed.set()
    pending.wait()
    assert torch.equal(_restored(mgr, with_optim=False)["0.weight"], saved)


def _gated_storage(gate: threading.Event) -> StreamingStorage:
    class Gated(StreamingStorage):
        def write(self, state_dir, tensors, ctx):
            assert gate.wait(30), "the test never opened the gate"
            return super().write(state_dir, tensors, ctx)

    return Gated()


def test_a_state_larger_than_the_budget_is_read_live_and_the_next_step_waits(tmp_path, caplog):
    model, opt = _job()
    _train(model, opt)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    gate = threading.Event()
    # 1 KiB: the biases fit, the 4 KiB weight and its AdamW moments do not.
    mgr = cg.CheckpointManager(
        tmp_path / "ck",
        config=cg.CheckpointConfig(async_save=AsyncOptions(host_bytes=1024)),
        storage=_gated_storage(gate),
    )
    caplog.set_level("WARNING", logger="ckptguard")
    mgr.prepare_async({"model": model, "optim": opt}).result(timeout=30)  # 1 KiB pinned ahead
    pending = mgr.save_async(1, {"model": model, "optim": opt})
    assert "are not staged (host staging budget 1024 B" in caplog.text and not pending.done()
    stepped = threading.Event()

    def step() -> None:
        _train(model, opt)
        stepped.set()

    runner = threading.Thread(target=step)
    runner.start()
    assert not stepped.wait(0.5), (
        "the optimizer step changed live tensors the writer had not read yet"
    )
    gate.set()
    runner.join(30)
    assert stepped.is_set()
    path = pending.wait()
    assert (
        pending.mutation_wait_seconds > 0.3
    )  # the honest block time of a state larger than the pool
    got = _restored(mgr)
    assert all(torch.equal(saved[k], got[k]) for k in saved)
    cost = json.loads((path / "manifest.json").read_text())["cost"]
    assert (
        cost["live_bytes"] > 0
        and 0 < cost["staged_host_bytes"] <= 1024
        and cost["host_budget_bytes"] == 1024
    )


def test_the_pool_is_reused_reported_and_released(tmp_path):
    model, opt = _job()
    mgr = cg.CheckpointManager(
        tmp_path / "ck", config=cg.CheckpointConfig(async_save=AsyncOptions(pool_idle_s=None))
    )
    state = {"model": model, "optim": opt}
    _train(model, opt)
    mgr.prepare_async(state).result(timeout=30)
    first = mgr.save_async(1, state).wait()
    pool = mgr._staging.pool
    assert pool is not None
    held, region = pool.held_bytes, pool._regions[0].tensor.data_ptr()
    nbytes = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    assert (
        nbytes * 3 <= held <= nbytes * 3 + 64 * 64
    )  # exact size: params + 2 moments, 64 B alignment
    _train(model, opt)
    second = mgr.save_async(2, state).wait()
    assert (
        mgr._staging.pool is pool
        and pool._regions[0].tensor.data_ptr() == region
        and pool.held_bytes == held
    )
    for path in (first, second):
        cost = json.loads((path / "manifest.json").read_text())["cost"]
        assert (
            cost["host_pool_bytes"] == held
            and cost["live_bytes"] == 0
            and cost["staged_host_bytes"] > 0
        )
        assert (
            "Ray threshold" in cost["host_budget_why"] or "not obtained" in cost["host_budget_why"]
        )
    mgr.close()
    assert pool.held_bytes == 0 and mgr._staging.pool is None


def test_the_pool_is_released_after_the_idle_time(tmp_path):
    model, opt = _job()
    mgr = cg.CheckpointManager(
        tmp_path / "ck", config=cg.CheckpointConfig(async_save=AsyncOptions(pool_idle_s=0.05))
    )
    mgr.prepare_async({"model": model, "optim": opt}).result(timeout=30)
    mgr.save_async(1, {"model": model, "optim": opt}).wait()
    pool = mgr._staging.pool
    assert pool is not None and pool._timer is not None
    pool._timer.join(10)
    assert pool.held_bytes == 0 and pool.released_idle == 1
    mgr.save_async(
        2, {"model": model, "optim": opt}
    ).wait()  # a later save grows it again, in the background
    assert (
        pool._growing is not None and pool._growing.result(timeout=10) > 0 and pool.held_bytes > 0
    )
    mgr.close()


def test_pool_places_exactly_and_within_the_budget():
    pool = StagingPool(pin=False)
    slots = pool.place([100, 7, 1000], budget=10_000)
    # largest first, 64-byte aligned starts, no padding after the last slot
    assert all(s is not None for s in slots) and pool.held_bytes == 1024 + 128 + 7
    pool.done()
    again = pool.place(
        [100, 7, 1000, 4000], budget=4000
    )  # the new tensor does not fit the budget left
    assert again[3] is None and pool.held_bytes == 1159
    assert again[0] is not None and again[0].data_ptr() == slots[0].data_ptr()
    pool.release()
    assert pool.held_bytes == 0


def _snap(**kw):
    base = dict(
        source=CgroupVersion.V2,
        current=4 * GiB,
        limit=10 * GiB,
        active_file=GiB // 2,
        inactive_file=GiB // 2,
        mem_total=64 * GiB,
        mem_available=40 * GiB,
        mem_free=30 * GiB,
    )
    base.update(kw)
    return HostSnapshot(**base)


def test_budget_from_the_memory_contract():
    b = host_budget(_snap(), RayConfig(threshold=0.95))
    # Ray: 9.5 GiB - (4 - 1) GiB = 6.5 GiB; cgroup: 10 - 3 = 7 GiB; margin max(2 GiB, 5% of 10 GiB).
    assert b.bytes == int(9.5 * GiB) - 3 * GiB - 2 * GiB
    assert "Ray threshold" in b.why and b.total == 10 * GiB
    assert host_budget(_snap(), RayConfig(threshold=0.95), ranks_per_node=2).bytes == b.bytes // 2
    full = host_budget(
        _snap(current=10 * GiB, active_file=0, inactive_file=0), RayConfig(threshold=0.95)
    )
    assert full.bytes == 0  # a node already at its limit stages nothing (the writer reads live)
    blind = host_budget(
        HostSnapshot(source=CgroupVersion.NONE, not_obtained={"meminfo": "unreadable"})
    )
    assert blind.bytes == GiB and "not obtained" in blind.why


def test_config_accepts_none_and_refuses_bad_budgets():
    assert cg.CheckpointConfig().async_save.host_bytes is None
    with pytest.raises(cg.ConfigError, match="host_bytes"):
        cg.CheckpointConfig(async_save=AsyncOptions(host_bytes=-1))
    with pytest.raises(cg.ConfigError, match="pool_idle_s"):
        cg.CheckpointConfig(async_save=AsyncOptions(pool_idle_s=0))


def test_the_digest_pass_overlaps_the_write(tmp_path, monkeypatch):
    digesting = threading.Event()
    real = _protocol.digests_and_layout_free

    def digests(items):
        digesting.set()
        return real(items)

    class Overlapped(StreamingStorage):
        def write(self, state_dir, tensors, ctx):
            assert digesting.wait(10), "the digest pass did not start before the write finished"
            return super().write(state_dir, tensors, ctx)

    monkeypatch.setattr(_protocol, "digests_and_layout_free", digests)
    mgr = cg.CheckpointManager(tmp_path / "ck", storage=Overlapped())
    w = torch.arange(1000, dtype=torch.float32)
    mgr.save(1, {"w": {"w": w}})
    target = {"w": {"w": torch.zeros(1000)}}
    assert mgr.restore(target) == 1 and torch.equal(
        target["w"]["w"], w
    )  # and the digests still match


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="needs POSIX priorities")
def test_the_background_thread_runs_at_lower_priority(tmp_path):
    seen: dict[str, int] = {}

    def probe() -> None:
        seen["before"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        lower_this_thread()
        seen["after"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    t = threading.Thread(target=probe)
    t.start()
    t.join(10)
    assert seen["after"] > seen["before"] or seen["before"] == 19
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == os.getpriority(
        os.PRIO_PROCESS, 0
    )
    mgr = cg.CheckpointManager(tmp_path / "ck")
    pending = mgr.save_async(1, {"w": torch.ones(4)})
    pending.wait()
    assert any(p.startswith("nice") for p in pending.priority)
    assert Path(tmp_path / "ck" / "step_00000001").is_dir()


def _async_divergence_worker(rank: int, world: int, root: str) -> dict:
    mgr = cg.CheckpointManager(root, config=cg.CheckpointConfig(timeout_s=20))
    pending = mgr.save_async(
        1, {"w": torch.full((3,), float(rank))}
    )  # the guard runs in the background
    out: dict = {}
    try:
        pending.wait()
    except cg.ReplicatedDivergenceError as exc:
        out["refused"] = str(exc)
    out["committed"] = mgr.committed_steps()
    mgr.close()
    return out


def test_the_divergence_guard_of_an_async_save_runs_on_the_staged_copies(tmp_path):
    from ckptguard.testing import run_ranks, values

    for r in values(run_ranks(_async_divergence_worker, 2, str(tmp_path / "ck"))):
        assert "w (ranks grouped by content: [[0], [1]])" in r["refused"] and r["committed"] == []


def test_a_region_that_cannot_be_allocated_leaves_the_tensors_live(monkeypatch, caplog):
    from ckptguard.storage import _staging

    def refuse(size, pin):
        raise OSError(12, "cudaHostRegister of a host buffer failed")

    monkeypatch.setattr(_staging, "Buffer", refuse)
    pool = StagingPool(pin=True)
    caplog.set_level("WARNING", logger="ckptguard")
    assert pool.place([100, 200], budget=1 << 20) == [None, None] and pool.held_bytes == 0
    assert "could not allocate a 356 B staging region" in caplog.text
    pool.done()
    assert pool._busy == 0


def test_only_modules_with_persistent_buffers_hold_their_forward():
    bn = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    plain = torch.nn.Linear(2, 2)
    plain.register_buffer("cache", torch.zeros(2), persistent=False)
    assert _pending._has_saved_buffers(bn) and not _pending._has_saved_buffers(plain)


def test_a_forward_that_updates_running_statistics_waits_for_the_copies(tmp_path, lazy):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    model(torch.randn(8, 4))
    saved = model[1].running_mean.clone()
    mgr = cg.CheckpointManager(tmp_path / "ck")
    mgr.prepare_async({"model": model}).result(timeout=30)
    pending = mgr.save_async(1, {"model": model})
    model(torch.randn(8, 4) + 5.0)  # train-mode forward: running_mean changes in place
    assert not torch.equal(model[1].running_mean, saved) and not lazy.queued
    lazy.landed.set()
    pending.wait()
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    mgr.restore({"model": fresh})
    assert torch.equal(fresh[1].running_mean, saved)


def test_parallel_reads_fill_every_span_bitwise(tmp_path):
    from ckptguard.storage.base import StorageContext
    from ckptguard.storage.streaming import StreamingConfig

    ctx = StorageContext(rank=0, world_size=1, process_group=None)
    g = torch.Generator().manual_seed(0)
    big = torch.randn(300, 1000, generator=g)
    state = {
        "big": big,
        "t": big.t(),
        "small": torch.arange(7),
        "mid": torch.randn(70_000, generator=g),
    }
    StreamingStorage().write(tmp_path, state, ctx)
    cfg = StreamingConfig(pool_bytes=6 * 61 * 4096, buffer_bytes=61 * 4096, read_threads=3)
    storage = StreamingStorage(cfg)
    got = {k: torch.zeros_like(v) for k, v in state.items()}
    storage.read(tmp_path, got, ctx)
    assert all(torch.equal(got[k], v) for k, v in state.items())
    # The pool makes its buffers as the reads need them (3 threads and the copy: at least 2, never
    # past 6).
    assert 2 * 61 * 4096 <= storage.last_stats.pool_bytes <= 6 * 61 * 4096, storage.last_stats
    assert storage.last_stats.bytes >= big.numel() * 8
    with pytest.raises(cg.ConfigError, match="read_threads"):
        StreamingConfig(read_threads=0)
