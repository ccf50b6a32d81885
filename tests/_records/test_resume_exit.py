"""A resumed process that dies on an uncaught exception before its first step records the exception
in its ``exit`` record (``raised``), and ``prove`` says so instead of blaming an exhausted loader
(H3's finding F2 in issue 39's campaign: a loop that saved the restored step again died on
ConfigError)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ckptguard.ops.prove import Status, evaluate

REPO = Path(__file__).resolve().parents[2]
JOB = """
import sys, torch, ckptguard as cg
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
state = {"model": model}
mgr = cg.CheckpointManager(
    sys.argv[1], config=cg.CheckpointConfig(proof=cg.ProofPlan(total_steps=4))
)
start = mgr.restore(state)
if start:
    raise RuntimeError("a bad config after the restore")
for step in (1, 2):
    mgr.record_step(step, sample_ids=[step], loss=float(step))
    mgr.save(step, state)
mgr.close()
"""


def _run(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-c", JOB, str(root)], capture_output=True, text=True, env=env, timeout=300
    )


def test_the_exit_record_names_the_uncaught_exception_and_prove_says_so(tmp_path):
    root = tmp_path / "ck"
    assert _run(root).returncode == 0
    died = _run(root)
    assert (
        died.returncode == 1 and "RuntimeError: a bad config after the restore" in died.stderr
    )  # the hook chains
    exits = [
        json.loads(line)
        for line in (root / "proof" / "rank_00000.jsonl").read_text().splitlines()
        if '"exit"' in line
    ]
    assert [e.get("raised") for e in exits] == ["RuntimeError: a bad config after the restore"], (
        exits
    )
    trained = next(g for g in evaluate(root) if g.name == "resumed run trained")
    assert trained.status is Status.FAIL and "died on an uncaught exception" in trained.evidence, (
        trained.evidence
    )
    assert "exhausted loader" not in trained.evidence


SAVES_ONLY = """
import sys, torch, ckptguard as cg
model = torch.nn.Linear(4, 2)
state = {"model": model}
mgr = cg.CheckpointManager(sys.argv[1])
start = mgr.restore(state)
for step in range(start + 1, start + 3):
    mgr.save(step, state)
mgr.close()
"""


def test_a_resumed_job_that_saves_without_record_step_is_not_called_idle(tmp_path):
    """The README's Usage loop saves and never calls record_step: a resume that saved two more steps
    trained."""
    root = tmp_path / "ck"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", SAVES_ONLY, str(root)],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-2000:]
    assert "trained 0 steps" not in done.stderr, done.stderr
    exits = [
        json.loads(line)
        for line in (root / "proof" / "rank_00000.jsonl").read_text().splitlines()
        if '"exit"' in line
    ]
    assert [e["trained"] for e in exits] == [2], exits
