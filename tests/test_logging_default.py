"""The lines a user must see reach stderr without any logging setup."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import logging, sys, torch
import ckptguard as cg
if sys.argv[2] == "configured":
    logging.basicConfig(level=logging.INFO, format="APP %(message)s")
state = {"w": torch.nn.Linear(2, 2)}
mgr = cg.CheckpointManager(sys.argv[1])
mgr.restore(state)
mgr.save(1, state)
cg.CheckpointManager(sys.argv[1]).restore(state)
"""


def _run(root, how, **env):
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, str(root), how],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )


def test_resume_lines_reach_stderr_by_default(tmp_path):
    out = _run(tmp_path / "a", "plain")
    assert out.returncode == 0, out.stderr
    assert "FRESH START" in out.stderr, out.stderr
    assert "committed step 1" in out.stderr
    assert "resume from step 1" in out.stderr
    assert out.stdout == ""  # library code never prints to stdout


def test_silenced_and_never_printed_twice(tmp_path):
    quiet = _run(tmp_path / "b", "plain", CKPTGUARD_QUIET="1")
    assert quiet.returncode == 0 and "committed step" not in quiet.stderr, quiet.stderr
    configured = _run(tmp_path / "c", "configured")
    assert configured.returncode == 0, configured.stderr
    assert configured.stderr.count("committed step 1") == 1, configured.stderr
    assert "APP ckptguard: committed step 1" in configured.stderr
