"""The host staging pool of ``save_async`` is released after a save, measured, and the release is in
the phase records (guide, key rules: "verify per save path that the host cache is released after
save").

A real CheckpointManager stages a 16 MiB state through ``save_async`` under an open PhaseRecorder;
the pool goes at ``close()`` (and, in the second test, after ``AsyncOptions.pool_idle_s`` without a
save). The ``host_cache_release`` record names the bytes unmapped, how, the step of the save phase
it followed, and the process RSS drop measured around the unmapping (the staged pages were touched
by the copy, so they were resident and leave with the mapping).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

import ckptguard as cg
from ckptguard import AsyncOptions
from ckptguard.memory import PhaseKind, PhaseRecorder, RecorderConfig
from ckptguard.memory.records import RecordKind, of_kind, read_records

MIB = 1 << 20


def _save_async(root: Path, records: Path, idle_s: float | None) -> list[dict]:
    """One save_async of step 7 inside a save phase; returns the host_cache_release records once the
    pool went (close(), or the idle timer when ``idle_s`` is set)."""
    cfg = cg.CheckpointConfig(async_save=AsyncOptions(host_bytes=64 * MIB, pool_idle_s=idle_s))
    mgr = cg.CheckpointManager(root, config=cfg)
    state = {"w": torch.randn(4 * MIB)}  # 16 MiB of float32
    with PhaseRecorder(RecorderConfig(path=records)) as rec:
        mgr.prepare_async(state).result(
            timeout=60
        )  # the pool is mapped: this save stages, not reads live
        with rec.phase(PhaseKind.SAVE, step=7):
            pending = mgr.save_async(7, state)
        pending.wait()
        if idle_s is not None:
            deadline = time.monotonic() + 30
            while (
                not of_kind(read_records([records]), RecordKind.HOST_CACHE_RELEASE)
                and time.monotonic() < deadline
            ):
                time.sleep(0.05)
        mgr.close()
    return of_kind(read_records([records]), RecordKind.HOST_CACHE_RELEASE)


def test_close_releases_the_staging_pool_and_the_phase_records_measure_it(tmp_path):
    released = _save_async(tmp_path / "ck", tmp_path / "rank0.jsonl", None)
    assert len(released) == 1, released
    r = released[0]
    assert r["how"] == "release()" and r["step"] == 7 and r["pinned"] is False
    assert r["released_bytes"] >= 16 * MIB
    # Measured, not declared: the process gave back (nearly) the bytes the pool held.
    assert r["rss_drop"] >= 0.9 * 16 * MIB, r
    assert r["after_save_s"] >= 0 and r["rank"] == 0 and isinstance(r["host"], dict)


def test_the_idle_timer_s_release_is_recorded_too(tmp_path, monkeypatch):
    from ckptguard.storage import _staging

    # The timer of a pool prepared ahead but not yet used: 0.3 s could pass on a loaded runner
    # between prepare_async and the save, releasing the pool before step 7 (two records, or none
    # of step 7). Here the timer starts only when the save is done with the pool.
    monkeypatch.setattr(_staging.StagingPool, "idle_from_now", lambda self: None)
    released = _save_async(tmp_path / "ck", tmp_path / "rank0.jsonl", 0.3)
    assert [r["how"] for r in released] == ["idle: 0.3 s without a save_async"], released
    assert released[0]["step"] == 7 and released[0]["rss_drop"] >= 0.9 * 16 * MIB


def test_no_record_without_an_open_recorder(tmp_path):
    from ckptguard.memory.phases import host_cache_released

    assert host_cache_released(1, "release()", pinned=False, rss_before=2, rss_after=1) is False
    with PhaseRecorder(RecorderConfig(path=tmp_path / "r.jsonl")):
        assert (
            host_cache_released(1, "release()", pinned=False, rss_before=None, rss_after=1) is True
        )
    assert host_cache_released(1, "release()", pinned=False, rss_before=2, rss_after=1) is False
    (r,) = of_kind(read_records([tmp_path / "r.jsonl"]), RecordKind.HOST_CACHE_RELEASE)
    assert r["step"] is None and set(r["not_obtained"]) == {"step", "rss_drop"}


def test_status_shows_the_release_and_keeps_the_rank_s_newest_phase(tmp_path):
    from click.testing import CliRunner

    from ckptguard.cli import main
    from ckptguard.memory.phases import host_cache_released
    from ckptguard.ops.status import status

    path = tmp_path / "rank0.jsonl"
    with PhaseRecorder(RecorderConfig(path=path)) as rec:
        with rec.phase(PhaseKind.SAVE, step=7):
            pass
        with rec.phase(PhaseKind.GENERATE, step=9):
            pass
        # the idle timer's release comes after later phases: it names the save it followed (7)
        host_cache_released(
            16 * MIB,
            "idle: 600 s without a save_async",
            pinned=True,
            rss_before=100 * MIB,
            rss_after=84 * MIB,
        )
    (rank,) = status([str(path)], sample_s=0.01)
    assert rank.step == 9 and rank.host_cache is not None
    assert "16.0 MiB released" in rank.host_cache and "save of step 7" in rank.host_cache
    got = CliRunner().invoke(main, ["status", str(path)])
    assert got.exit_code == 0, got.output
    assert (
        "step 9: between phases" in got.output
        and "(idle: 600 s without a save_async; RSS -16.0 MiB)" in got.output
    )
