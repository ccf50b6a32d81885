"""Preemption: a SIGTERM to one of two ranks becomes one commit of the same step on both, then an
exit with the documented code; a grace budget shorter than the measured save time commits nothing.

The ranks are separate processes (``preempt_job.py``) launched here, so the signal is really
delivered to one process's handler and the exit codes are the processes' own.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptguard as cg
from ckptguard.testing import free_port

JOB = str(Path(__file__).with_name("preempt_job.py"))
STEPS, SAVE_EVERY, SIGNAL_AT = 7, 2, 3


def _launch(root: Path, out: Path, **cfg) -> list[tuple[int, str]]:
    """Both ranks of the job; (exit code, stderr) per rank. A launch whose ranks never met (the free
    port was taken by another process between ``free_port`` and rank 0's bind: seen once in a loaded
    suite, both ranks timing out on the connect) is launched again on another port; nothing of the
    job ran then."""
    for _ in range(3):
        results = _launch_once(root, out, **cfg)
        if not all("DistNetworkError" in err and "trying to connect" in err for _, err in results):
            return results
    return results


def _launch_once(root: Path, out: Path, **cfg) -> list[tuple[int, str]]:
    out.mkdir(parents=True, exist_ok=True)
    config = json.dumps(
        {
            "root": str(root),
            "out": str(out),
            "steps": STEPS,
            "save_every": SAVE_EVERY,
            "grace_s": 60.0,
            **cfg,
        }
    )
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, JOB, str(r), "2", str(port), config],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    results = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        results.append((p.returncode, err))
    return results


def _fingerprints(out: Path) -> list[dict]:
    return [json.loads((out / f"rank_{r}.json").read_text()) for r in range(2)]


def _tracker(root: Path) -> int:
    return int((root / "latest_checkpointed_iteration.txt").read_text())


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> list[dict]:
    base = tmp_path_factory.mktemp("straight")
    results = _launch(base / "ckpt", base / "out")
    assert [code for code, _ in results] == [0, 0], results
    return _fingerprints(base / "out")


def test_sigterm_to_one_rank_saves_the_same_step_on_both_and_the_resume_is_exact(
    tmp_path, straight
):
    root = tmp_path / "ckpt"
    first = _launch(root, tmp_path / "out1", signal_at=SIGNAL_AT, signal_rank=1)
    assert [code for code, _ in first] == [cg.PreemptionGuard.EXIT_SAVED] * 2, first
    for rank, (_, err) in enumerate(first):
        assert "SIGTERM on rank 1" in err and f"step {SIGNAL_AT} committed" in err, (rank, err)
    # step 3 is not a save step (every 2): the guard committed it, on both ranks together
    assert _tracker(root) == SIGNAL_AT
    manifest = json.loads((root / f"step_{SIGNAL_AT:08d}" / "manifest.json").read_text())
    assert manifest["step"] == SIGNAL_AT and manifest["topology"]["world_size"] == 2
    assert not list(tmp_path.glob("out1/rank_*.json"))  # the run stopped at the boundary

    second = _launch(root, tmp_path / "out2")
    assert [code for code, _ in second] == [0, 0], second
    resumed = _fingerprints(tmp_path / "out2")
    assert [r["start"] for r in resumed] == [SIGNAL_AT, SIGNAL_AT]
    for rank in range(2):  # every parameter, optimizer moment and the LR, bit for bit
        assert resumed[rank]["fingerprint"] == straight[rank]["fingerprint"], rank


def test_a_tiered_checkpoint_is_guarded_too_and_its_preemption_save_goes_to_the_persistent_tier(
    tmp_path, straight
):
    root = tmp_path / "ckpt"
    first = _launch(root, tmp_path / "out1", signal_at=SIGNAL_AT, signal_rank=1, tiers=True)
    assert [code for code, _ in first] == [cg.PreemptionGuard.EXIT_SAVED] * 2, first
    for _, err in first:
        assert (
            "SIGTERM on rank 1" in err
            and f"step {SIGNAL_AT} committed under {root / 'persistent'}" in err
        ), err
    # step 3 is on neither tier's interval (fast every 2, persistent every 1000): the guard saved it
    # where a lost node cannot take it, the persistent tier
    assert _tracker(root / "persistent") == SIGNAL_AT and _tracker(root / "fast") == 2
    second = _launch(root, tmp_path / "out2", tiers=True)
    assert [code for code, _ in second] == [0, 0], second
    resumed = _fingerprints(tmp_path / "out2")
    assert [r["start"] for r in resumed] == [SIGNAL_AT, SIGNAL_AT]
    for rank in range(2):
        assert resumed[rank]["fingerprint"] == straight[rank]["fingerprint"], rank


def test_a_grace_budget_shorter_than_the_measured_save_time_commits_nothing_and_says_why(tmp_path):
    root = tmp_path / "ckpt"
    results = _launch(root, tmp_path / "out", signal_at=SIGNAL_AT, signal_rank=0, grace_s=0.001)
    assert [code for code, _ in results] == [cg.PreemptionGuard.EXIT_NOT_SAVED] * 2, results
    for _, err in results:
        assert f"NOT saving step {SIGNAL_AT}: the measured save time" in err, err
        assert (
            "this run's save of step 2" in err and "does not fit" in err and "grace_s=0.001" in err
        ), err
        assert "Traceback" not in err, err
    assert _tracker(root) == 2  # the save of step 2 stays the resume target
    assert not (root / f"step_{SIGNAL_AT:08d}").exists()
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]


# ---------------------------------------------------------------- one process


def test_the_guard_restores_the_previous_handlers_and_returns_without_a_signal(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    mgr = cg.CheckpointManager(tmp_path / "ck")
    state = {"w": torch.zeros(2)}
    with cg.PreemptionGuard(mgr, grace_s=10) as guard:
        assert signal.getsignal(signal.SIGTERM) == guard._on_signal
        guard.step_boundary(1, state)  # no signal: nothing happens
        assert not (tmp_path / "ck").exists()
        signal.raise_signal(signal.SIGUSR1)
        assert guard.requested
        assert guard.should_stop(2, state)
        assert (
            guard.outcome is not None
            and guard.outcome.saved
            and guard.outcome.code == cg.PreemptionGuard.EXIT_SAVED
        )
    assert signal.getsignal(signal.SIGTERM) == before
    assert mgr.committed_steps() == [2]
    with pytest.raises(cg.ConfigError, match="grace_s"):
        cg.PreemptionGuard(mgr, grace_s=0)


def test_without_a_measured_save_the_state_and_a_disk_probe_decide(tmp_path):
    # signaled at step 1 of a fresh root, before any save: nothing measured on this root yet
    root = tmp_path / "spent" / "ckpt"
    results = _launch(
        root, tmp_path / "spent" / "out", signal_at=1, signal_rank=0, grace_s=0.001, save_every=100
    )
    assert [code for code, _ in results] == [cg.PreemptionGuard.EXIT_NOT_SAVED] * 2, results
    for _, err in results:
        assert "NOT saving step 1: the estimated save time" in err and "write probe of" in err, err
        assert "on 2 rank(s)" in err and "does not fit" in err and "Traceback" not in err, err
    assert not (root / "latest_checkpointed_iteration.txt").exists()
    assert not [p for p in root.iterdir() if p.name != "proof"], list(
        root.iterdir()
    )  # the probe left nothing
    # a budget the estimate fits: saved, exit 75, and the log says the time was estimated
    root = tmp_path / "fits" / "ckpt"
    results = _launch(
        root, tmp_path / "fits" / "out", signal_at=1, signal_rank=0, grace_s=60.0, save_every=100
    )
    assert [code for code, _ in results] == [cg.PreemptionGuard.EXIT_SAVED] * 2, results
    assert all("saving step 1: the estimated save time" in err for _, err in results), results
    assert _tracker(root) == 1


def test_state_bytes_counts_every_tensor_once_per_item_and_sums_run_roles():
    from ckptguard.preempt import state_bytes

    model = torch.nn.Linear(4, 2)  # 8 + 2 floats
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    assert state_bytes({"model": model, "w": torch.zeros(3, dtype=torch.float64)}) == 10 * 4 + 3 * 8
    assert (
        state_bytes({"actor": {"model": model}, "critic": {"w": torch.zeros(2)}}) == 10 * 4 + 2 * 4
    )
    assert (
        state_bytes({"model": model, "optim": optim, "n": 3}) == 10 * 4
    )  # SGD without momentum holds nothing
