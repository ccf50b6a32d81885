"""A save_async that finds the host staging still being prepared (``OnBusy.SKIP``) is skipped, alike
on every rank.

Reading a 6.2 GiB state live because its pinned pool was still being prepared held an H100 training
loop 2.19 s at its first fast-tier save (benchmarks/results/issue41_h100); under SKIP such a save is
skipped as one is while a commit runs (agreed in the busy round, logged, counted), past
``busy.UNREADY_LIVE_BYTES`` still to prepare on any rank. Below it, or under ``WAIT``, the save
starts and reads the rest live, as before. The preparation is held back here by a gate around
``StagingPool.grow_async`` (the real one runs once the gate opens).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptguard as cg
from ckptguard._commit import busy as _busy
from ckptguard.storage import _staging
from ckptguard.testing import run_ranks, values

pytestmark = pytest.mark.timeout(300)


def _hold_preparation(gate: threading.Event) -> None:
    real = _staging.StagingPool.grow_async

    def held_back(self: Any, sizes: Any, budget: int) -> Future[int]:
        out: Future[int] = Future()

        def run() -> None:
            gate.wait(120)
            try:
                out.set_result(real(self, sizes, budget).result())
            except BaseException as exc:
                out.set_exception(exc)

        threading.Thread(target=run, daemon=True).start()
        return out

    _staging.StagingPool.grow_async = held_back  # type: ignore[method-assign]


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {"w": torch.randn(4096), "shared": torch.arange(1000.0)}


def _one_rank_preparing(rank: int, world: int, root: str) -> dict[str, Any]:
    _busy.UNREADY_LIVE_BYTES = 0  # the state here is small: any byte still to prepare counts
    gate = threading.Event()
    if rank == 1:
        _hold_preparation(gate)  # rank 0's preparation ends at once; rank 1's waits for the gate
    messages = _Messages()
    logging.getLogger("ckptguard").addHandler(messages)
    state = _state()
    mgr = cg.CheckpointManager(root)
    prepared = mgr.prepare_async(state)
    if rank == 0:
        prepared.result(timeout=60)  # rank 0 ready, rank 1 not: the local views differ
    first = mgr.save_async(1, state)
    gate.set()
    prepared.result(timeout=60)
    second = mgr.save_async(2, state)
    path = mgr.wait()
    skipped = mgr.busy.skipped_total
    mgr.close()
    return {
        "first": first is None,
        "second": second is not None,
        "path": Path(path).name if path else None,
        "skipped": skipped,
        "said": [m for m in messages.lines if "SKIPPED" in m],
    }


def test_a_save_while_one_rank_still_prepares_its_staging_is_skipped_on_every_rank(
    tmp_path: Path,
) -> None:
    out = values(run_ranks(_one_rank_preparing, 2, str(tmp_path / "ck"), timeout=240))
    for o in out:
        assert o["first"] and o["second"] and o["path"] == "step_00000002" and o["skipped"] == 1, o
        (said,) = o["said"]
        assert (
            "save_async of step 1 SKIPPED" in said
            and "still being prepared in the background on rank 1" in said
        )


@pytest.mark.parametrize("case", ["small", "wait"])
def test_a_save_starts_while_the_staging_is_prepared_below_the_bound_or_under_wait(
    tmp_path: Path, case: str, monkeypatch
) -> None:
    gate = threading.Event()
    monkeypatch.setattr(
        _staging.StagingPool, "grow_async", _staging.StagingPool.grow_async
    )  # restored after
    _hold_preparation(gate)
    config = cg.CheckpointConfig()
    if case == "wait":
        monkeypatch.setattr(_busy, "UNREADY_LIVE_BYTES", 0)
        config = cg.CheckpointConfig(async_save=cg.AsyncOptions(on_busy=cg.OnBusy.WAIT))
    state = _state()  # 20 KB: below the 64 MiB a save may read live
    mgr = cg.CheckpointManager(tmp_path / "ck", config=config)
    try:
        prepared = mgr.prepare_async(state)
        assert mgr.queue.sets[0].unready_bytes() > 0, (
            "the preparation is held back: bytes still to prepare"
        )
        pending = mgr.save_async(1, state)
        assert pending is not None and mgr.busy.skipped_total == 0
        gate.set()
        prepared.result(timeout=60)
        assert Path(mgr.wait()).name == "step_00000001"
    finally:
        gate.set()
        mgr.close()
    restored = {"w": torch.zeros(4096), "shared": torch.zeros(1000)}
    again = cg.CheckpointManager(tmp_path / "ck")
    assert again.restore(restored) == 1 and all(
        torch.equal(restored[k], v) for k, v in _state().items()
    )
    again.close()


def test_a_preparation_past_its_patience_no_longer_skips_saves(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    """A hung preparation (a pin that never returns) must not skip every save_async for the rest of
    the run."""
    from ckptguard._commit import pending as _pending

    gate = threading.Event()
    monkeypatch.setattr(
        _staging.StagingPool, "grow_async", _staging.StagingPool.grow_async
    )  # restored after
    _hold_preparation(gate)
    monkeypatch.setattr(_busy, "UNREADY_LIVE_BYTES", 0)
    state = _state()
    mgr = cg.CheckpointManager(tmp_path / "ck")
    try:
        mgr.prepare_async(state)
        assert mgr.save_async(1, state) is None and mgr.busy.skipped_total == 1
        monkeypatch.setattr(
            _pending, "PREPARE_PATIENCE_S", -1
        )  # as if it had run past its patience
        with caplog.at_level(logging.WARNING, logger="ckptguard"):
            assert mgr.save_async(2, state) is not None, "saved, reading the rest live"
        assert "stops waiting for it and reads the rest live" in caplog.text
        assert Path(mgr.wait()).name == "step_00000002"
    finally:
        gate.set()
        mgr.close()
