"""``verify --restore`` restores every step in one new process (torch imported once), not one per
step; a child that dies fails the step it was on, and the steps after it are still checked in a new
one."""

from __future__ import annotations

import subprocess

import pytest
import torch
from click.testing import CliRunner

import ckptguard as cg
from ckptguard.cli import main
from ckptguard.ops import verify as _verify


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    ck = tmp_path_factory.mktemp("once") / "ck"
    mgr = cg.CheckpointManager(ck, config=cg.CheckpointConfig(retention=None))
    model = torch.nn.Linear(16, 16)
    for step in (1, 2, 3):
        with torch.no_grad():
            model.weight.add_(1.0)
        mgr.save(step, {"model": model, "n": step})
    return ck


def _count_children(monkeypatch) -> list[list[str]]:
    started: list[list[str]] = []
    real = subprocess.Popen

    def popen(cmd, *args, **kwargs):
        started.append(list(cmd))
        return real(cmd, *args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", popen)
    return started


def test_one_process_restores_every_step(root, monkeypatch):
    started = _count_children(monkeypatch)
    steps = sorted(root.glob("step_*"))
    seen = []
    assert _verify.restore_check(steps, progress=lambda step, event: seen.append(step.name)) == []
    assert len(started) == 1 and [a for a in started[0] if "step_" in a] == [
        str(s) for s in steps
    ], started
    assert sorted(set(seen)) == [s.name for s in steps]
    result = CliRunner().invoke(main, ["verify", str(root), "--deep", "--restore"])
    assert result.exit_code == 0, result.output
    assert (
        "OK: 3 step(s) checked with checksums and tensor digests and a real restore"
        in result.output
    )
    assert len(started) == 2, started  # the CLI's check: one more process, for all three steps


_DIES_AT_SECOND = """
import json, os, sys
steps = [a for a in sys.argv[1:] if not a.startswith("--") and not a.isdigit()]
if len(steps) == 3:  # the first process: step 1 restored, then it dies inside step 2
    print(
        json.dumps({"step_dir": steps[0], "result": {"step": 1, "ranks": {}, "failed": []}}),
        flush=True,
    )
    sys.stderr.write("Fatal Python error: Segmentation fault\\n")
    sys.stderr.flush()
    os.kill(os.getpid(), 9)
for s in steps:  # the second process, for step 3 alone
    print(json.dumps({"step_dir": s, "error": "RuntimeError: unreadable shard"}), flush=True)
"""


def test_a_child_that_dies_fails_its_step_and_the_rest_are_checked(root, monkeypatch, tmp_path):
    fake = tmp_path / "fake_offline.py"
    fake.write_text(_DIES_AT_SECOND)
    monkeypatch.setattr(_verify, "OFFLINE", [str(fake)])
    monkeypatch.setattr("ckptguard.ops._offline.compare", lambda step_dir, result: [])
    started = _count_children(monkeypatch)
    steps = sorted(root.glob("step_*"))
    found = _verify.restore_check(steps)
    assert len(started) == 2, started  # the second process starts after the step the first died in
    assert [(f.code, f.path) for f in found] == [
        ("restore-failed", str(steps[1])),
        ("restore-failed", str(steps[2])),
    ]
    assert "Segmentation fault" in found[0].message and "unreadable shard" in found[1].message
