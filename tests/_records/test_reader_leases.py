"""Reader leases (issue 33 item 6): a step an evaluation process is reading is never rotated away.

``ckptguard.open_step`` holds the step while its block runs; retention (``KeepLast(1)``) and gc keep
it; a reader killed mid-read frees the step at once on its host (its PID no longer runs), and a
reader on another host frees it when its ``ttl_s`` passes; ``hold --ttl`` gives a script the same,
renewed by running it again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckptguard as cg
from ckptguard._records import readers
from ckptguard.cli import main


def _mgr(root: Path) -> cg.CheckpointManager:
    return cg.CheckpointManager(root, config=cg.CheckpointConfig(retention=cg.KeepLast(1)))


def _w(step: int) -> dict:
    return {"w": torch.full((4,), float(step))}


def _steps(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("step_*"))


def test_a_step_open_for_reading_survives_rotation_and_is_freed_after(tmp_path):
    root = tmp_path / "ck"
    mgr = _mgr(root)
    mgr.save(1, _w(1))
    with cg.open_step(root) as step_dir:
        assert step_dir.name == "step_00000001"
        shard = next((step_dir / "state").glob("*.distcp")).open("rb")  # an eval job's open shard
        mgr.save(2, _w(2))
        mgr.save(3, _w(3))  # KeepLast(1): step 1 would go, but it is being read
        assert _steps(root) == ["step_00000001", "step_00000003"]
        listing = CliRunner().invoke(main, ["list", str(root)]).output
        assert "[held: read by open_step in pid" in listing, listing
        assert shard.read(1)
        shard.close()
    assert not list((root / "readers").iterdir())  # the lease went with the block
    mgr.save(4, _w(4))
    assert _steps(root) == ["step_00000004"]


def test_open_step_refuses_a_step_that_is_not_committed(tmp_path):
    root = tmp_path / "ck"
    _mgr(root).save(1, _w(1))
    with pytest.raises(cg.CheckpointError, match="step 7 is not committed"), cg.open_step(root, 7):
        pass
    assert not list((root / "readers").iterdir())


_READER = """
import sys, time, ckptguard as cg
with cg.open_step(sys.argv[1], 1, ttl_s=float(sys.argv[2])):
    print("open", flush=True)
    time.sleep(600)
"""


def test_a_killed_reader_frees_its_step_on_its_host_and_after_its_ttl_elsewhere(tmp_path):
    root = tmp_path / "ck"
    mgr = _mgr(root)
    mgr.save(1, _w(1))
    proc = subprocess.Popen(
        [sys.executable, "-c", _READER, str(root), "600"], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "open"
    mgr.save(2, _w(2))
    assert "step_00000001" in _steps(root)  # a live reader on this host: kept
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    mgr.save(3, _w(3))  # the reader died: its lease is dead at once (same host), step 1 goes
    assert _steps(root) == ["step_00000003"] and not list((root / "readers").iterdir())
    # a reader on another host: only its expiry tells it is gone
    lease = readers.acquire(root, 3, ttl_s=600, who="eval on node7")
    data = json.loads(lease.read_text())
    lease.write_text(json.dumps({**data, "host": "node7", "pid": 1}))
    assert 3 in readers.live(root)
    lease.write_text(
        json.dumps({**data, "host": "node7", "pid": 1, "expires_unix": time.time() - 1})
    )
    assert readers.live(root) == {} and not lease.exists()


def test_hold_ttl_for_scripts_renews_by_running_again_and_release_removes_it(tmp_path):
    root = tmp_path / "ck"
    mgr = _mgr(root)
    mgr.save(1, _w(1))
    run = CliRunner()
    first = json.loads(
        run.invoke(
            main, ["hold", str(root), "1", "--reason", "eval 7", "--ttl", "300", "--json"]
        ).output
    )
    again = json.loads(
        run.invoke(
            main, ["hold", str(root), "1", "--reason", "eval 7", "--ttl", "300", "--json"]
        ).output
    )
    assert first["hold"] == again["hold"] and first["ttl_s"] == 300  # the same lease, renewed
    mgr.save(2, _w(2))
    assert "step_00000001" in _steps(root)
    bad = run.invoke(main, ["hold", str(root), "1", "--reason", "x", "--ttl", "0"])
    assert bad.exit_code == 2 and "Traceback" not in bad.output
    assert run.invoke(main, ["release", str(root), "1"]).exit_code == 0
    mgr.save(3, _w(3))
    assert _steps(root) == ["step_00000003"]
