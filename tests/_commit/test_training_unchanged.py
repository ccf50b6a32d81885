"""ckptguard never changes the training it checkpoints: every public entry point, called where a
user calls it (before the first optimizer step too), leaves the run bitwise equal to the same run
without it: parameters, optimizer state, the four RNG streams and the data order."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ckptguard as cg
from ckptguard import BlockingBudget, CheckpointConfig, OverBudget
from ckptguard.testing import run_ranks, values

STEPS = 6
Hook = Callable[[int, dict[str, Any]], None]
"""Called with the number of updates done so far (0: before the first); saves number their step one
higher (step 0 is reserved for a fresh start)."""


def _train(hook: Hook | None) -> dict[str, Any]:
    """A small run with Dropout (the torch RNG), AdamW (its step count drives the bias correction),
    a data order drawn from torch's RNG and noise from NumPy's and Python's; ``hook(step, state)``
    after each step and once before the first (step 0, the optimizer still empty)."""
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 4)
    )
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    data = torch.randn(32, 8)
    state = {"model": model, "optim": optim}
    if hook is not None:
        hook(0, state)
    order: list[int] = []
    for step in range(1, STEPS + 1):
        idx = torch.randperm(32)[:8]
        order += idx.tolist()
        noise = float(np.random.standard_normal()) + random.random()
        loss = (model(data[idx]) * (1 + 0.01 * noise)).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        if hook is not None:
            hook(step, state)
    return {
        "params": {k: v.clone() for k, v in model.state_dict().items()},
        "optim": _optim_state(optim),
        "order": order,
        "rng": (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()),
    }


def _optim_state(optim: torch.optim.Optimizer) -> list[tuple[int, str, torch.Tensor]]:
    sd = optim.state_dict()["state"]
    return [(i, k, v.clone()) for i in sorted(sd) for k, v in sorted(sd[i].items())]


def _assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["order"] == want["order"], "the data order changed"
    for k, v in want["params"].items():
        assert torch.equal(got["params"][k], v), f"parameter {k} differs bitwise"
    assert [(i, k) for i, k, _ in got["optim"]] == [(i, k) for i, k, _ in want["optim"]]
    for (i, k, a), (_, _, b) in zip(got["optim"], want["optim"], strict=True):
        assert torch.equal(a, b), f"optimizer state {i}.{k} differs bitwise (e.g. Adam's step)"
    assert torch.equal(got["rng"][0], want["rng"][0]), "torch's RNG stream moved"
    assert np.array_equal(got["rng"][1], want["rng"][1]) and got["rng"][2] == want["rng"][2]


def _at(steps: set[int], call: Callable[[int, dict[str, Any]], None]) -> Hook:
    def hook(step: int, state: dict[str, Any]) -> None:
        if step in steps:
            call(step, state)

    return hook


def _manager_hooks(root: Path) -> dict[str, tuple[Hook, Callable[[], None]]]:
    """Per entry point: the hook a run calls, and what ends it (wait, close)."""
    out: dict[str, tuple[Hook, Callable[[], None]]] = {}

    mgr = cg.CheckpointManager(root / "save")
    out["save"] = (_at({0, 3}, lambda s, st: mgr.save(s + 1, st)), mgr.close)

    amgr = cg.CheckpointManager(root / "save_async")
    out["save_async"] = (_at({0, 2, 4}, lambda s, st: amgr.save_async(s + 1, st)), amgr.close)

    pmgr = cg.CheckpointManager(root / "prepare_async")

    def prepare(step: int, st: dict[str, Any]) -> None:
        if (
            step == 0
        ):  # the documented call after a restore, on a fresh root: the optimizer has no state yet
            assert pmgr.restore(st) == 0
            pmgr.prepare_async(st).result(timeout=60)
        elif step == 3:
            pmgr.save_async(step + 1, st)

    out["prepare_async"] = (prepare, pmgr.close)

    rmgr = cg.CheckpointManager(root / "restore")
    out["restore_fresh_root"] = (_at({0}, lambda s, st: rmgr.restore(st)), rmgr.close)

    tiers = cg.TieredCheckpoint(
        root / "fast", persistent=root / "persistent", fast_every=1, persistent_every=2
    )

    def tiered(step: int, st: dict[str, Any]) -> None:
        if step == 0:
            assert tiers.restore(st) == 0
            tiers.prepare_async(st).result(timeout=60)
        tiers.save_async(step + 1, st)

    out["tiers"] = (tiered, tiers.close)
    return out


ENTRY_POINTS = ["save", "save_async", "prepare_async", "restore_fresh_root", "tiers"]


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_run_with_ckptguard_equals_the_run_without(tmp_path, entry):
    want = _train(None)
    hook, end = _manager_hooks(tmp_path)[entry]
    try:
        got = _train(hook)
    finally:
        end()
    _assert_same(got, want)


def test_a_saved_unstepped_optimizer_restores_unstepped(tmp_path):
    """A save before the first step holds no moments (none exist); restoring it leaves a fresh
    optimizer fresh, and the run from there equals a run that never saved."""
    want = _train(None)
    mgr = cg.CheckpointManager(tmp_path / "ck")
    _train(_at({0}, lambda s, st: mgr.save(1, st)))
    got = _train(_at({0}, lambda s, st: mgr.restore(st, path=tmp_path / "ck" / "step_00000001")))
    _assert_same(got, want)


def test_a_stepped_optimizer_restores_exactly(tmp_path):
    mgr = cg.CheckpointManager(tmp_path / "ck")
    want = _train(_at({STEPS}, lambda s, st: mgr.save(s, st)))
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 4)
    )
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    assert mgr.restore({"model": model, "optim": optim}) == STEPS
    for (i, k, a), (_, _, b) in zip(_optim_state(optim), want["optim"], strict=True):
        assert torch.equal(a, b), f"{i}.{k}"


def _budget_rank(rank: int, world: int, root: str) -> bool:
    """Two ranks, a blocking budget so small that every save goes to the background
    (OverBudget.BACKGROUND)."""
    want = _train(None)
    config = CheckpointConfig(
        blocking=BlockingBudget(fraction=0.001, timeout_s=1.0, over=OverBudget.BACKGROUND)
    )
    mgr = cg.CheckpointManager(root, config=config)
    background: list[bool] = []
    got = _train(_at({0, 3}, lambda s, st: background.append(mgr.save(s + 1, st) is None)))
    mgr.close()
    _assert_same(got, want)
    return any(background)


def test_the_blocking_budget_leaves_the_run_unchanged(tmp_path):
    results = run_ranks(_budget_rank, 2, str(tmp_path / "ck"))
    assert values(results) == [
        True,
        True,
    ]  # a save went to the background, and the runs are unchanged
