"""The turn gates (ops.prove_turns) on real kills of tests/agent_job.py, and their negative
controls.

The job SIGKILLs itself after a turn's environment calls took effect and before the turn is
recorded (``--die-at-seq``), is relaunched, and finishes; the gates read the turn records and
the environments' own records of effects (JSON files of tests/agent_job.FileEnv). Each negative
control FAILs its named gate: the ledger left out of the state (committed turns run again), a call
re-issued under a new call id, a restorable environment restored to the wrong revision."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckptguard.ops import prove_turns

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
JOB = REPO / "tests" / "agent_job.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
UNINTERRUPTED = [883, 744, 530]
"""The witness of the uninterrupted job (what its finished rollouts' tokens sum to, per prompt)."""


def launch(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp / "work").mkdir(exist_ok=True)
    return subprocess.run(
        [sys.executable, str(JOB), str(tmp / "root"), str(tmp / "work"), *args],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )


def campaign(tmp: Path, kills: list[int], control: str = "") -> dict:
    extra = ["--control", control] if control else []
    for seq in kills:
        run = launch(tmp, "--die-at-seq", str(seq), *extra)
        assert run.returncode == -9, run.stderr[-3000:]
    run = launch(tmp, *extra)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.split("RESULT ", 1)[1])  # type: ignore[no-any-return]


def gates(root: Path) -> dict[str, prove_turns.Row]:
    return {r.name: r for r in prove_turns.rows(root)}


def test_rollouts_killed_mid_turn_continue_or_restart_and_every_call_takes_effect_once(tmp_path):
    result = campaign(tmp_path, [9, 20, 29])
    assert result["witness"] == UNINTERRUPTED  # the trained witness is the uninterrupted run's
    got = gates(tmp_path / "root")
    assert {n: r.status for n, r in got.items()} == {
        prove_turns.GATE_ONCE: "PASS",
        prove_turns.GATE_KIND: "PASS",
        prove_turns.GATE_TOKENS: "PASS",
    }, got
    resumes = [
        json.loads(line)
        for line in (tmp_path / "root" / "proof" / "turns_rank_00000.jsonl").open()
        if '"resume"' in line
    ]
    assert any(r["continued"] for r in resumes) and any(
        r["restarted"] for r in resumes
    )  # both kinds were judged


def test_the_ledger_left_out_of_the_state_fails_the_kind_gate(tmp_path):
    result = campaign(tmp_path, [9], control="no-turns")
    row = gates(tmp_path / "root")[prove_turns.GATE_KIND]
    assert row.status == "FAIL" and "restored step 2 without a turn ledger" in row.evidence, row
    assert (
        "rollout 'p0/s1', turn 1: a committed turn was run again (call ids ['p0/s1/t1/c0'"
        in row.evidence
    )
    assert result["witness"] == UNINTERRUPTED  # the trainer's state alone does not show it


@pytest.fixture(scope="module")
def new_ids(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The root of a job killed once that re-issues a call under a new call id on its relaunch (read
    only)."""
    tmp = tmp_path_factory.mktemp("new-ids")
    campaign(tmp, [9], control="new-ids")
    return tmp / "root"


def test_a_call_reissued_under_a_new_call_id_fails_the_exactly_once_gate(new_ids):
    row = gates(new_ids)[prove_turns.GATE_ONCE]
    assert (
        row.status == "FAIL"
        and "rollout 'p0/s1', turn 3: call 0 took effect in 'idempotent' under 2 call ids"
        in row.evidence
    ), row


def test_a_restorable_environment_restored_to_the_wrong_revision_fails_the_exactly_once_gate(
    tmp_path,
):
    campaign(tmp_path, [7], control="wrong-revision")
    row = gates(tmp_path / "root")[prove_turns.GATE_ONCE]
    assert (
        row.status == "FAIL"
        and "rollout 'p0/s0', turn 2: committed call id 'p0/s0/t2/c1' has 0 standing"
        in row.evidence
    ), row


def test_ckptguard_prove_shows_the_turn_gates(new_ids):
    """``ckptguard prove`` judges the turn gates with the others (prove.evaluate adds
    ``prove_turns.rows``)."""
    from click.testing import CliRunner

    from ckptguard.cli import main

    result = CliRunner().invoke(main, ["prove", str(new_ids), "--json"])
    shown = json.loads(result.stdout)
    by_name = {g["gate"]: g for g in shown["gates"]}
    assert (
        by_name[prove_turns.GATE_ONCE]["status"] == "FAIL"
        and by_name[prove_turns.GATE_KIND]["status"] == "PASS"
    )
    assert (
        shown["verdict"].startswith("resume NOT proven")
        and not shown["proven"]
        and result.exit_code == 1
    )
