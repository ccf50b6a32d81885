"""benchmarks/bench_train_loop.py and bench_read.py at tiny sizes on the CPU: every method saves,
restores bitwise exactly, and the report carries its figures (save time against a plain disk
write, the cost block's bytes, one table row per method; correctness only, no timing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_train_loop.py"


def test_tiny_train_loop_benchmark_runs_every_method_exactly(tmp_path):
    out = tmp_path / "loop.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--out", str(out), "--dir", str(tmp_path / "ck")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    expected = {
        "cg_sync",
        "cg_async",
        "cg_async_prepared",
        "cg_async_ready",
        "cg_async_wait",
        "cg_tiers",
        "dcp_sync",
        "dcp_async",
        "torch_save",
    }
    assert set(res["summary"]) == expected | {"none_again"}
    again = res["methods"]["none_again"]
    assert again["saves"] == [] and len(again["step_s"]) == again["steps"]
    for name in expected:
        row, method = res["summary"][name], res["methods"][name]
        # Every step's time, and the steps that began while a staging pool was being prepared.
        assert len(method["step_s"]) == method["steps"], name
        assert set(method["steps_while_preparing"]) <= set(range(1, method["steps"] + 1)), name
        assert row["restore_bitwise_exact"] is True, name
        assert row["save_vs_disk_write"] > 0, name
        saves = res["methods"][name]["saves"]
        # The user's loop: the first save inside the timed loop, at the first interval, like every
        # later one.
        assert (
            saves[0]["step"] == res["methods"][name]["save_every"]
            and row["blocked_first_s"] is not None
        ), name
    for name in ("cg_async", "cg_async_wait"):
        costs = res["methods"][name]["save_costs"]
        # Every save's cost block says where its bytes went: staged or read live. Whether the tiny
        # loop's first save (milliseconds after the first step) finds the pool restore() prepares is
        # timing (a memory probe of about 1 s comes first; on a loaded machine it does not):
        # tests/storage/test_staging_first_save.py holds that.
        assert costs and all(
            c["live_bytes"] + c["staged_host_bytes"] + c["staged_gpu_bytes"] > 0 for c in costs
        ), (
            name,
            costs,
        )
    assert (
        "prepare_async_bytes" not in res["methods"]["cg_async"]
    )  # the default runs without the hint
    prepared = res["methods"]["cg_async_prepared"]
    assert prepared["prepare_async_bytes"] >= 0 and prepared["pool_held_bytes_after_close"] == 0
    skip = res["methods"]["cg_async"]
    assert (
        skip["skipped_by_manager"]
        == len(skip["skipped_steps"])
        == res["summary"]["cg_async"]["skipped_saves"]
    )
    assert res["methods"]["cg_tiers"]["save_every"] == 2
    assert (tmp_path / "loop.md").read_text().count("| cg_") == 6
    assert not any((tmp_path / "ck").glob("cg_*"))  # each method's checkpoints are removed after it


def test_tiny_read_benchmark_reads_the_files_and_restores_exactly(tmp_path):
    out = tmp_path / "read.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    script = SCRIPT.with_name("bench_read.py")
    r = subprocess.run(
        [
            sys.executable,
            str(script),
            "--tiny",
            "--out",
            str(out),
            "--dir",
            str(tmp_path / "ck"),
            "--raw",
            "probe,buffered:2:1,regions:2:1",
            "--restores",
            "1,3",
            "--rounds",
            "2",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    rows = res["raw"]
    assert {x["variant"] for x in rows} == {
        "probe",
        "buffered:2:1",
        "regions:2:1",
        "restore:1",
        "restore:3",
    }
    assert all(
        x["bytes"] == res["data_bytes"] for x in rows if not x["variant"].startswith("restore")
    )
    assert [x["bitwise_exact"] for x in rows if x["variant"].startswith("restore")] == [True] * 4
    assert res["all_restores_exact"] is True and res["median_x_probe"]["probe"] == 1.0
