"""save_async host staging on a GPU (marked gpu; skipped without CUDA): a parameter changed right
after save_async is saved with its old value (optimizer step, staged()), the pool is pinned at
exact size and reused, and a state larger than the budget is read live and still exact."""

from __future__ import annotations

import json

import pytest
import torch

import ckptguard as cg
from ckptguard import AsyncOptions

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _job(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    # 4 x 64 MiB weights: the D2H copies take milliseconds, a mutation racing them would win.
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(4)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    return model, opt


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.ones(16, 4096, device="cuda")).square().mean().backward()
    opt.step()


def _state(model, opt):
    return {"model": model, "optim": opt}


def _snapshot(model, opt):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, {
        (i, k): v.detach().clone()
        for i, s in opt.state_dict()["state"].items()
        for k, v in s.items()
    }


def _same(model, opt, want) -> bool:
    params, moments = want
    got_p, got_m = _snapshot(model, opt)
    return all(torch.equal(params[k], got_p[k]) for k in params) and all(
        torch.equal(moments[k], got_m[k]) for k in moments
    )


def test_a_step_right_after_save_async_is_saved_with_the_old_values(tmp_path):
    model, opt = _job()
    _train(model, opt)
    want = _snapshot(model, opt)
    mgr = cg.CheckpointManager(tmp_path / "ck")
    pending = mgr.save_async(1, _state(model, opt))
    _train(model, opt)  # queued at once: the step pre-hook orders it after the copies, on the GPU
    assert mgr.staged() == 0.0  # the fence has passed already
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    path = pending.wait()
    assert not _same(model, opt, want)
    fresh, fresh_opt = _job(seed=5)
    _train(fresh, fresh_opt)
    assert mgr.restore(_state(fresh, fresh_opt)) == 1
    assert _same(fresh, fresh_opt, want)
    cost = json.loads((path / "manifest.json").read_text())["cost"]
    # Exact size: the staged bytes plus at most 63 B of alignment per tensor (each of the 4 layers
    # saves a weight and a bias, each with 2 moments and a step: 20 tensors).
    staged, held = cost["staged_host_bytes"], cost["host_pool_bytes"]
    assert cost["live_bytes"] == 0 and 0 < staged <= held <= staged + 64 * 40
    pool = mgr._staging.pool
    assert pool is not None and all(r.pinned for r in pool._regions)
    mgr.close()
    assert pool.held_bytes == 0


def test_staged_orders_a_manual_mutation_after_the_copies(tmp_path):
    model, opt = _job()
    _train(model, opt)
    want = _snapshot(model, opt)
    mgr = cg.CheckpointManager(tmp_path / "ck")
    pending = mgr.save_async(1, _state(model, opt))
    mgr.staged()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-3.0)  # no optimizer: only staged() orders this after the D2H copies
    pending.wait()
    fresh, fresh_opt = _job(seed=5)
    _train(fresh, fresh_opt)
    mgr.restore(_state(fresh, fresh_opt))
    assert _same(fresh, fresh_opt, want)
    mgr.close()


def test_the_pool_is_reused_and_a_state_over_the_budget_is_read_live(tmp_path):
    model, opt = _job()
    _train(model, opt)
    mgr = cg.CheckpointManager(tmp_path / "ck")
    mgr.save_async(1, _state(model, opt)).wait()
    pool = mgr._staging.pool
    ptrs = [r.tensor.data_ptr() for r in pool._regions]
    _train(model, opt)
    mgr.save_async(2, _state(model, opt)).wait()
    assert [r.tensor.data_ptr() for r in pool._regions] == ptrs  # no new pinned memory per save
    mgr.close()

    config = cg.CheckpointConfig(async_save=AsyncOptions(host_bytes=200 << 20))
    small = cg.CheckpointManager(tmp_path / "small", config=config)
    _train(model, opt)
    want = _snapshot(model, opt)
    pending = small.save_async(1, _state(model, opt))
    _train(model, opt)  # waits on the host until the writer read what did not fit
    path = pending.wait()
    assert pending.mutation_wait_seconds > 0
    cost = json.loads((path / "manifest.json").read_text())["cost"]
    assert cost["live_bytes"] > 0 and cost["staged_host_bytes"] <= 200 << 20
    fresh, fresh_opt = _job(seed=5)
    _train(fresh, fresh_opt)
    small.restore(_state(fresh, fresh_opt))
    assert _same(fresh, fresh_opt, want)
    small.close()
