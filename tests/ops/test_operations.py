"""Operating a long run: one writer per root (lease), chain identity, transfer, cost per step."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import time

import pytest
import torch

import ckptguard as cg
from ckptguard._disk import layout as _layout
from ckptguard._disk.lease import LEASE_NAME

HOLDER = """
import sys, time, torch, ckptguard as cg
cg.CheckpointManager(sys.argv[1]).save(1, {"w": torch.ones(2)})
print("ready", flush=True)
time.sleep(120)
"""


def _state(v: float = 1.0) -> dict:
    return {"w": torch.full((2,), v)}


def test_a_second_writer_is_refused_naming_the_owner(tmp_path, caplog):
    root = tmp_path / "ck"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(root)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(cg.LeaseHeldError, match=f"pid {holder.pid} on host"):
            cg.CheckpointManager(root).save(2, _state())
        assert _layout.read_tracker(root) == 1
        caplog.set_level(logging.WARNING, logger="ckptguard")
        cg.CheckpointManager(root).save(2, _state(), break_lease=True)
        assert f"broke the lease of pid {holder.pid}" in caplog.text
    finally:
        holder.kill()
        holder.wait()
    # The owner is gone now: a relaunch on the same host takes over without any flag.
    (root / LEASE_NAME).write_text(
        json.dumps(
            {
                "host": _host(),
                "pid": holder.pid,
                "start": "1",
                "acquired_unix": time.time(),
                "renewed_unix": time.time(),
            }
        )
    )
    caplog.clear()
    cg.CheckpointManager(root).save(3, _state())
    assert "took over the lease of dead" in caplog.text


def _host() -> str:
    import socket

    return socket.gethostname()


def test_another_hosts_lease_is_refused_until_it_expires(tmp_path):
    root = tmp_path / "ck"
    cg.CheckpointManager(root).save(1, _state())
    lease = {
        "host": "node-b",
        "pid": 4242,
        "start": "9",
        "acquired_unix": time.time(),
        "renewed_unix": time.time(),
    }
    (root / LEASE_NAME).write_text(json.dumps(lease))
    with pytest.raises(cg.LeaseHeldError, match="pid 4242 on host node-b"):
        cg.CheckpointManager(root).save(2, _state())
    lease["renewed_unix"] = time.time() - 7 * 3600
    (root / LEASE_NAME).write_text(json.dumps(lease))
    cg.CheckpointManager(root).save(2, _state())
    assert json.loads((root / LEASE_NAME).read_text())["host"] == _host()


def test_a_checkpoint_of_another_chain_needs_adoption(tmp_path):
    arm_a, arm_b = tmp_path / "arm_a", tmp_path / "arm_b"
    cg.CheckpointManager(arm_a).save(5, _state(5.0))
    cg.CheckpointManager(arm_b).save(3, _state(3.0))
    mgr = cg.CheckpointManager(arm_b)
    target = _state(0.0)
    with pytest.raises(cg.ChainMismatchError, match="adopt it"):
        mgr.restore(target, path=arm_a / "step_00000005")
    # A step directory copied in from the other arm is refused too, even through the tracker.
    shutil.copytree(arm_a / "step_00000005", arm_b / "step_00000005")
    _layout.write_tracker(arm_b, 5)
    with pytest.raises(cg.ChainMismatchError):
        mgr.restore(target)
    phase = mgr.adopt(
        arm_a / "step_00000005", "continue arm B from arm A's step 5 for the ablation"
    )
    assert json.loads(phase.read_text())["adopted_chains"]
    assert mgr.restore(target) == 5 and target["w"].tolist() == [5.0, 5.0]
    # A brand-new root adopting a checkpoint for evaluation.
    fresh = cg.CheckpointManager(tmp_path / "eval")
    with pytest.raises(cg.ChainMismatchError, match="not a run root yet"):
        fresh.restore(_state(0.0), path=arm_a / "step_00000005")
    fresh.adopt(arm_a / "step_00000005", "evaluation copy")
    assert fresh.restore(_state(0.0), path=arm_a / "step_00000005") == 5


KILL_MID_TRANSFER = """
import os, signal, sys
from ckptguard import _faults
from ckptguard.ops.transfer import transfer
_faults.set_hook("transfer.file_copied", lambda: os.kill(os.getpid(), signal.SIGKILL))
transfer(sys.argv[1], sys.argv[2])
"""


def test_transfer_publishes_like_a_save_and_resumes(tmp_path):
    from click.testing import CliRunner

    from ckptguard.cli import main
    from ckptguard.demo.toyjob import build_job, fingerprint, train_step

    src = tmp_path / "node1"
    job = build_job()
    train_step(job)
    mgr = cg.CheckpointManager(src)
    time.sleep(0.05)
    mgr.save(1, job.state())
    train_step(job)
    mgr.save(2, job.state())
    # A transfer killed midway leaves no tracker at the destination.
    killed = subprocess.run(
        [
            sys.executable,
            "-c",
            KILL_MID_TRANSFER,
            str(src / "step_00000002"),
            str(tmp_path / "node2_killed"),
        ]
    )
    assert killed.returncode == -9
    assert _layout.read_tracker(tmp_path / "node2_killed") is None
    assert not (tmp_path / "node2_killed" / "step_00000002").exists()
    # A complete transfer: record, tracker last, and the resume passes verify and preflight.
    dest = tmp_path / "node2"
    out = CliRunner().invoke(main, ["transfer", str(src / "step_00000002"), str(dest)])
    assert out.exit_code == 0, out.output
    record = json.loads(next((dest / "transfers").glob("*.json")).read_text())
    assert record["step"] == 2 and record["tracker_set_to"] == 2 and len(record["files"]) >= 3
    assert CliRunner().invoke(main, ["verify", str(dest), "--deep"]).exit_code == 0
    assert CliRunner().invoke(main, ["preflight", str(dest), "--expect-step", "2"]).exit_code == 0
    fresh = build_job(seed=4)
    assert cg.CheckpointManager(dest).restore(fresh.state()) == 2
    assert fingerprint(fresh) == fingerprint(job)
    # Run again, it finds its own complete copy and only confirms it; a different directory
    # of that name is never replaced.
    again = CliRunner().invoke(main, ["transfer", str(src / "step_00000002"), str(dest), "--json"])
    assert again.exit_code == 0 and json.loads(again.output)["resumed"] is True, again.output
    (dest / "step_00000002" / "rank_00000.pt").write_bytes(b"another run's file")
    clash = CliRunner().invoke(main, ["transfer", str(src / "step_00000002"), str(dest)])
    assert clash.exit_code == 1 and "already exists and is not a complete copy" in clash.output


def test_manifest_records_size_and_save_time_per_step(tmp_path):
    mgr = cg.CheckpointManager(tmp_path / "ck")
    began = {}
    for step in (1, 2, 3):
        time.sleep(0.1)
        began[step] = time.monotonic()
        mgr.save(step, _state(step))
    cost = json.loads((tmp_path / "ck/step_00000003/manifest.json").read_text())["cost"]
    assert cost["bytes"] > 0 and cost["save_seconds"] > 0
    # The step time is the time between two saves (at least the 0.1 s slept, at most what this
    # loop took from save 2 to save 3); the fraction is the save's time over it, above 1 where a
    # loaded machine's save outlasted the sleep (fresh 11: 0.112 s over 0.108 s).
    assert 0.1 <= cost["step_seconds"] <= began[3] - began[2] + time.monotonic() - began[3]
    # The seconds are rounded to 1 ms and the fraction to 1e-4: compared within their rounding.
    frac = cost["save_fraction_of_step"]
    slack = 5e-4 * (1 + frac) + 5e-5 * cost["step_seconds"] + 1e-6
    assert frac > 0 and abs(frac * cost["step_seconds"] - cost["save_seconds"]) <= slack
    from click.testing import CliRunner

    from ckptguard.cli import main

    out = CliRunner().invoke(main, ["verify", str(tmp_path / "ck")])
    assert "cost    step_00000003:" in out.output and "% of a" in out.output


def _phase(kind: str, rank: int, pid: int, ago_s: float, **extra) -> dict:
    import socket

    return {
        "v": 1,
        "kind": kind,
        "mono_ns": time.monotonic_ns() - int(ago_s * 1e9),
        "wall_time": time.time() - ago_s,
        "node": socket.gethostname(),
        "rank": rank,
        "pid": pid,
        "phase": "save",
        "step": 40,
        **extra,
    }


def test_status_tells_a_stalled_rank_from_a_busy_one(tmp_path):
    from click.testing import CliRunner

    from ckptguard.cli import main

    stalled = subprocess.Popen(["sleep", "60"])
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        records = []
        for rank, pid in ((0, stalled.pid), (1, busy.pid)):
            records += [
                _phase("phase_start", rank, pid, 30),
                _phase("phase_end", rank, pid, 29, duration_s=1.0),
                _phase("phase_start", rank, pid, 12),
            ]
        path = tmp_path / "phases.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        out = CliRunner().invoke(main, ["status", str(path), "--sample", "0.5"])
        assert out.exit_code == 1, out.output  # a stalled rank: a watchdog acts on the exit status
        lines = out.output.splitlines()
        assert "STALLED" in lines[0] and "'save'" in lines[0] and "typical 1.0 s" in lines[0]
        assert "SLOW, not hung" in lines[1] and "CPU" in lines[1]
    finally:
        for proc in (stalled, busy):
            proc.kill()
            proc.wait()
    out = CliRunner().invoke(main, ["status", str(path), "--json"])
    assert all("EXITED inside phase 'save'" in r["verdict"] for r in json.loads(out.output))


@pytest.mark.parametrize(("extra", "code"), [((), 0), (("--no-rng-restore",), 1)])
def test_rehearse_passes_and_fails_on_the_right_gate(tmp_path, extra, code):
    root = tmp_path / "ck"
    cmd = [
        sys.executable,
        "-m",
        "ckptguard.cli",
        "rehearse",
        "--root",
        str(root),
        "--timeout",
        "150",
        "--",
        sys.executable,
        "-m",
        "ckptguard.demo",
        "--root",
        str(root),
        "--steps",
        "100000",
        "--save-every",
        "2",
        *extra,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert (
        "SIGKILLed the whole process tree" in proc.stdout
        and "in the middle of a save" in proc.stdout
    )
    assert (
        "committed step" in proc.stdout
        and "again" in proc.stdout
        and "checkpoint of step" in proc.stdout
    )
    fails = [line.split("  ")[0] for line in proc.stdout.splitlines() if "  FAIL  " in line]
    if code == 0:
        assert not fails and proc.stdout.rstrip().endswith("rehearsal PASSED")
        assert proc.stdout.count(": PROVEN") == 2  # both resumes
    else:
        # the RNG streams were not put back: the files are fine, the restored state and the
        # trajectory are not
        assert fails[0] == "digests equal, item by item" and "['rng']" in proc.stdout
        assert (
            "data order identical" in fails
            and "rehearsal FAILED: resume NOT proven: digests equal" in proc.stdout
        )


def test_gc_refuses_while_a_live_run_holds_the_lease(tmp_path):
    from click.testing import CliRunner

    from ckptguard.cli import main

    root = tmp_path / "ck"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(root)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "ready"
        shutil.copytree(
            root / "step_00000001", root / "step_00000099"
        )  # an orphan, or a commit in flight
        refused = CliRunner().invoke(main, ["gc", str(root), "--orphans"])
        assert refused.exit_code == 1 and f"pid {holder.pid}" in refused.output
        assert (root / "step_00000099").exists()
        forced = CliRunner().invoke(main, ["gc", str(root), "--orphans", "--force"])
        assert forced.exit_code == 0 and not (root / "step_00000099").exists()
    finally:
        holder.kill()
        holder.wait()
