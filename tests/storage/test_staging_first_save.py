"""The first save_async costs what later ones cost: the staging pool is prepared off the caller's
thread from the moment the state is known (``restore``; a fresh optimizer after its first step),
never by touching the optimizer, and the pool's regions are packed so that the save fills them
exactly."""

from __future__ import annotations

import json
import random
import threading

import pytest
import torch

import ckptguard as cg
from ckptguard.storage import _staging
from ckptguard.storage._staging import StagingPool


def _cost(root, step):
    return json.loads((root / f"step_{step:08d}" / "manifest.json").read_text())["cost"]


def _job():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model, optim):
    model(torch.randn(4, 32)).square().mean().backward()
    optim.step()
    optim.zero_grad()


def _state_bytes(model, optim):
    params = sum(p.numel() * 4 for p in model.parameters())
    return params * 3 + sum(
        4 for _ in model.parameters()
    )  # the weights, two moments, a step counter each


def test_a_fresh_run_is_staged_whole_at_its_first_save(tmp_path):
    """restore() on a fresh root; the optimizer has no state: the pool is sized after its first
    step, in the background; the first save_async finds it and reads nothing live."""
    model, optim = _job()
    state = {"model": model, "optim": optim}
    mgr = cg.CheckpointManager(tmp_path / "ck")
    assert mgr.restore(state) == 0
    assert mgr._staging.preparing is None and not optim.state  # nothing read from the optimizer yet
    _step(model, optim)
    prepared = mgr._staging.preparing
    assert prepared is not None and prepared.result(timeout=60) > 0
    for _ in range(3):
        _step(model, optim)
    pending = mgr.save_async(4, state)
    pending.wait()
    cost = _cost(tmp_path / "ck", 4)
    assert cost["live_bytes"] == 0 and cost["staged_host_bytes"] == _state_bytes(model, optim)
    assert cost["host_pool_bytes"] <= 1.05 * cost["staged_host_bytes"]
    assert mgr._staging.pool is not None and mgr._staging.pool.grown_on == ["ckptguard-pin-pool"]
    mgr.close()
    assert mgr._staging.pool is None


def test_a_resumed_run_is_prepared_after_the_restore_s_read(tmp_path):
    model, optim = _job()
    state = {"model": model, "optim": optim}
    _step(model, optim)
    first = cg.CheckpointManager(tmp_path / "ck")
    first.save(1, state)
    first.close()
    model2, optim2 = _job()
    again = {"model": model2, "optim": optim2}
    mgr = cg.CheckpointManager(tmp_path / "ck")
    assert mgr.restore(again) == 1
    # Prepared after the restore's read (834227a), from the loaded state: the optimizer's moments
    # are there, so the pool is sized as the first save needs it, and the read itself never competed
    # with the pinning.
    assert mgr._staging.preparing is not None and mgr._staging.preparing.result(timeout=60) > 0
    _step(model2, optim2)
    mgr.save_async(2, again).wait()
    assert _cost(tmp_path / "ck", 2)["live_bytes"] == 0
    mgr.close()


def test_an_unused_prepared_pool_goes_after_the_idle_time(tmp_path):
    model, optim = _job()
    state = {"model": model, "optim": optim}
    _step(model, optim)
    cfg = cg.CheckpointConfig(async_save=cg.AsyncOptions(pool_idle_s=0.2))
    mgr = cg.CheckpointManager(tmp_path / "ck", config=cfg)
    mgr.restore(state)
    assert mgr._staging.preparing is not None and mgr._staging.preparing.result(timeout=60) > 0
    pool = mgr._staging.pool
    assert pool is not None
    released = threading.Event()
    deadline = threading.Timer(30, released.set)
    deadline.start()
    while pool.released_idle == 0 and not released.is_set():
        released.wait(0.05)
    deadline.cancel()
    assert pool.released_idle == 1 and pool.held_bytes == 0
    mgr.close()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_packed_regions_are_filled_exactly_by_the_next_place(monkeypatch, seed):
    monkeypatch.setattr(_staging, "CHUNK", 4096)
    rng = random.Random(seed)
    sizes = [rng.choice([1, 7, 100, 1000, 3000, 5000, 9000]) for _ in range(40)]
    pool = StagingPool(pin=False)
    added = pool.grow_async(sizes, budget=1 << 30).result(timeout=30)
    assert added == pool.held_bytes == pool.missing([]) + pool.held_bytes
    assert all(r.size <= 4096 or r.size in sizes for r in pool._regions)
    slots = pool.place(sizes, budget=pool.held_bytes, grow=0)
    assert all(s is not None for s in slots)
    assert pool.held_bytes <= sum(sizes) + 64 * len(sizes)
    assert len({s.data_ptr() for s in slots if s is not None}) == len(sizes)
    pool.done()
    pool.release()


def test_a_grow_asked_for_while_one_runs_follows_it(monkeypatch):
    """prepare_async for a fresh model, then the optimizer's state after its first step: the second
    grow is not dropped while the first still pins."""
    gate = threading.Event()
    real = _staging.Buffer

    def slow(size, pin):
        gate.wait(30)
        return real(size, pin)

    monkeypatch.setattr(_staging, "Buffer", slow)
    pool = StagingPool(pin=False)
    model = [4096, 4096]
    first = pool.grow_async(model, budget=1 << 30)
    both = pool.grow_async([*model, 8192, 8192], budget=1 << 30)
    gate.set()
    assert first.result(timeout=30) > 0 and both.result(timeout=30) >= first.result()
    slots = pool.place([*model, 8192, 8192], budget=pool.held_bytes, grow=0)
    assert all(s is not None for s in slots)
    pool.done()
    pool.release()
