"""Missing evidence is not a difference: where a kill lands decides what can be compared, never the
verdict's kind.

Real loops (``ckptguard.demo.loops``) in segments, each a new process: a crash loop whose saving run
recorded nothing past its save, and two gloo ranks that a job-wide kill left one record apart.
Hand-written records for the gates whose reference a kill can cut off (an export, an update of a
GRPO step whose rewards were all equal).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptguard.cli import main
from ckptguard.demo import loops
from ckptguard.ops.prove import Outcome, Status, evaluate, outcome, verdict
from ckptguard.testing import run_ranks, values

SAVE_EVERY = 5


def _segment(rank: int, world: int, root: str, steps: int, stop_after: int | None) -> int:
    return int(
        loops.run(
            root, rank=rank, world=world, steps=steps, save_every=SAVE_EVERY, stop_after=stop_after
        )["start"]
    )


def _by_name(gates) -> dict:
    return {g.name: g for g in gates}


@pytest.fixture(scope="module")
def loop_root(tmp_path_factory) -> Path:
    """Saved step 5 and ended right after (nothing recorded past it); resumed from 5 and killed
    after step 7; resumed from 5 again and killed after step 8."""
    root = tmp_path_factory.mktemp("loop") / "ck"
    runs = [(5, None), (20, 7), (20, 8)]
    starts = [
        values(run_ranks(_segment, 1, str(root), steps, stop, distributed=False))[0]
        for steps, stop in runs
    ]
    assert starts == [0, 5, 5]
    return root


def test_a_crash_loop_is_judged_against_the_earliest_run_that_recorded_past_the_step(loop_root):
    gates = evaluate(loop_root, resume=2)
    data = _by_name(gates)["data order identical"]
    assert data.status is Status.PASS, data.evidence
    assert (
        "steps 6-7 replayed after the restore of step 5 (compared with an earlier resume of step 5"
        in data.evidence
    )
    assert "the run that saved it recorded nothing past it" in data.evidence
    assert outcome(gates) is Outcome.PROVEN, verdict(gates)


def test_a_resume_whose_saving_run_recorded_nothing_past_the_save_is_missing_evidence(loop_root):
    gates = evaluate(loop_root, resume=1)
    assert outcome(gates) is Outcome.EVIDENCE_MISSING and not [
        g for g in gates if g.status is Status.FAIL
    ]
    line = verdict(gates)
    assert line.startswith(
        "resume EVIDENCE MISSING (no gate found a difference; not compared: data order identical:"
    )
    assert "rank 0: no run before this resume recorded a step past step 5" in line
    assert "the run that saved step 5 (pid " in line and "recorded no step past it" in line
    shown = CliRunner().invoke(main, ["prove", str(loop_root), "--resume", "1", "--json"])
    out = json.loads(shown.output)
    assert shown.exit_code == 3 and out["outcome"] == "evidence missing" and out["exit_code"] == 3
    assert out["failed"] == [] and "data order identical" in [g["gate"] for g in out["missing"]]
    table = CliRunner().invoke(main, ["prove", str(loop_root), "--resume", "1"])
    assert (
        table.exit_code == 3
        and "data order identical" in table.output
        and " MISSING " in table.output
    )


def _cut_last_step(path: Path, count: int = 1) -> None:
    """What a job-wide SIGKILL between two ranks' appends leaves: this rank's last step record(s)
    never written."""
    lines = path.read_text().splitlines(keepends=True)
    steps = [i for i, line in enumerate(lines) if json.loads(line)["event"] == "step"]
    for i in sorted(steps[-count:], reverse=True):
        del lines[i]
    path.write_text("".join(lines))


@pytest.mark.parametrize(("cut", "expected"), [(1, Status.PASS), (2, Status.MISSING)])
def test_ranks_one_record_apart_are_judged_by_the_ranks_that_recorded(tmp_path, cut, expected):
    root = tmp_path / "ck"
    # rank 0 recorded one step past the save of step 5 (or two: then rank 1, with none, is two
    # records behind, which no kill between two appends leaves)
    stop = 6 if cut == 1 else 7
    assert values(run_ranks(_segment, 2, str(root), 20, stop)) == [0, 0]
    _cut_last_step(root / "proof" / "rank_00001.jsonl", count=cut)
    assert values(run_ranks(_segment, 2, str(root), 20, 8)) == [5, 5]
    gates = evaluate(root)
    data = _by_name(gates)["data order identical"]
    assert data.status is expected, data.evidence
    if expected is Status.PASS:
        assert "rank(s) [1]: the killed run had recorded nothing past step 5 there" in data.evidence
        assert "judged by rank(s) [0], whose replay of step 6 matched" in data.evidence
        assert outcome(gates) is Outcome.PROVEN, verdict(gates)
    else:
        assert "rank 1: no run before this resume recorded a step past step 5" in verdict(gates)
        assert outcome(gates) is Outcome.EVIDENCE_MISSING


# ---------------------------------------------------------------- hand-written records

OLD, MID, NEW = 111, 222, 333


def _write(root: Path, records: list[dict]) -> None:
    path = root / "proof" / "rank_00000.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for i, r in enumerate(
            records
        ):  # in time order: each launch is told apart by its restore's time
            f.write(
                json.dumps({"rank": 0, "host": "h", "time": float(i), "mono": float(i), **r}) + "\n"
            )


def _restore(pid: int) -> dict:
    return {
        "event": "restore",
        "pid": pid,
        "step": 6,
        "digests_match": {"model": True},
        "ok": True,
        "addresses_changed": [],
    }


def _step(pid: int, step: int, norm: float) -> dict:
    return {
        "event": "step",
        "pid": pid,
        "step": step,
        "sample_ids": f"ids{step}",
        "loss": 0.5,
        "grad_norm": norm,
    }


PLAN = {"rl": True, "deterministic": True, "replay_steps": 1}


@pytest.mark.parametrize(
    ("killed_norm", "expected", "words"),
    [
        (
            0.0,
            Status.PASS,
            "as the reference run had there",
        ),  # zero in the uninterrupted trajectory too
        (
            0.25,
            Status.FAIL,
            "where the run that saved step 6 (pid 111) had grad_norm 0.25 at the same step",
        ),
        (None, Status.MISSING, "no run before this resume recorded step 7's update"),
    ],
)
def test_a_zero_update_is_judged_against_what_the_reference_did_at_that_step(
    tmp_path, killed_norm, expected, words
):
    killed = [_step(OLD, 7, killed_norm)] if killed_norm is not None else []
    _write(
        tmp_path,
        [
            {"event": "save", "pid": OLD, "step": 6, "plan": PLAN},
            *killed,
            _restore(NEW),
            _step(NEW, 7, 0.0),
            _step(NEW, 8, 0.125),
        ],
    )
    gate = _by_name(evaluate(tmp_path))["one non-zero update"]
    assert gate.status is expected and words in gate.evidence, gate.evidence


def test_an_export_the_kill_cut_off_is_missing_evidence_and_an_earlier_resume_supplies_it(tmp_path):
    fp = {"bytes": "b6", "scales": "none"}
    saved = [
        {"event": "save", "pid": OLD, "step": 6, "plan": PLAN}
    ]  # killed right after the save: no export
    _write(
        tmp_path / "cut",
        [*saved, _restore(NEW), {"event": "export", "pid": NEW, "step": 6, "fingerprint": fp}],
    )
    gate = _by_name(evaluate(tmp_path / "cut"))["first export byte-identical"]
    assert (
        gate.status is Status.MISSING
        and "no run before this resume recorded an export of step 6" in gate.evidence
    )
    loop = [
        *saved,
        _restore(MID),
        {"event": "export", "pid": MID, "step": 6, "fingerprint": fp},
        _restore(NEW),
        {
            "event": "export",
            "pid": NEW,
            "step": 6,
            "fingerprint": {**fp, "bytes": "b6-merged-twice"},
        },
    ]
    _write(tmp_path / "loop", loop)
    gate = _by_name(evaluate(tmp_path / "loop"))["first export byte-identical"]
    assert gate.status is Status.FAIL and "an earlier resume of step 6 (pid 222)" in gate.evidence


def test_a_resumed_run_killed_with_its_ranks_one_record_apart_is_judged_by_the_rank_that_recorded(
    tmp_path,
):
    root = tmp_path / "ck"
    assert values(run_ranks(_segment, 2, str(root), 20, 7)) == [0, 0]  # saved 5, recorded 6 and 7
    assert values(run_ranks(_segment, 2, str(root), 20, 6)) == [
        5,
        5,
    ]  # resumed, replayed step 6 ...
    _cut_last_step(
        root / "proof" / "rank_00001.jsonl"
    )  # ... which the kill kept rank 1 from recording
    gates = evaluate(root)
    rows = _by_name(gates)
    for name in ("data order identical", "one non-zero update", "resumed run trained"):
        assert rows[name].status is Status.PASS, (name, rows[name].evidence)
        assert (
            "rank(s) [1] recorded nothing after the restore when the job-wide kill landed"
            in rows[name].evidence
        )
    assert outcome(gates) is Outcome.PROVEN, verdict(gates)


def test_zero_updates_matched_as_far_as_the_reference_recorded_pass(tmp_path):
    _write(
        tmp_path,
        [
            {"event": "save", "pid": OLD, "step": 6, "plan": PLAN},
            _step(OLD, 7, 0.0),
            _restore(NEW),
            _step(NEW, 7, 0.0),
            _step(NEW, 8, 0.0),
        ],
    )  # a converged GRPO policy: every advantage zero
    gate = _by_name(evaluate(tmp_path))["one non-zero update"]
    assert gate.status is Status.PASS, gate.evidence
    assert (
        "steps 7-7 were zero, as the reference run's" in gate.evidence
        and "step 8 and later" in gate.evidence
    )


def test_a_save_record_lost_with_a_kill_right_after_the_commit_still_leaves_a_reference(tmp_path):
    # the kill landed between the commit of step 6 and the append of its save record
    _write(
        tmp_path,
        [
            {"event": "restore", "pid": OLD, "step": 0, "ok": True, "plan": PLAN},
            _step(OLD, 6, 0.5),
            _restore(MID),
            _step(MID, 7, 0.25),
            _restore(NEW),
            _step(NEW, 7, 0.25),
        ],
    )
    rows = _by_name(evaluate(tmp_path))
    assert rows["all PIDs changed"].status is Status.PASS, rows["all PIDs changed"].evidence
    data = rows["data order identical"]
    assert (
        data.status is Status.PASS
        and "compared with an earlier resume of step 6 (pid 222)" in data.evidence
    )
    first = _by_name(evaluate(tmp_path, resume=1))["data order identical"]
    assert (
        first.status is Status.MISSING
        and "its save record lost with a kill right after the commit" in first.evidence
    ), first.evidence


@pytest.mark.parametrize(
    ("resumed_start", "expected"),
    [
        ("900", Status.PASS),  # a restarted container gave the PID back: a new process
        ("100", Status.FAIL),  # the very process that saved restored in place
        (None, Status.FAIL),  # records without a start time: the PID and host decide, as before
    ],
)
def test_a_relaunch_given_the_saving_process_s_pid_back_is_told_apart_by_its_start(
    tmp_path, resumed_start, expected
):
    """A restarted container numbers its processes from 1 again: the relaunch can have the PID
    and the host name of the process that saved, and was called "restored in the same process"
    (a false alarm). Each record carries its process's start time, which tells them apart."""
    saved = "100" if resumed_start else None
    _write(
        tmp_path,
        [
            {"event": "restore", "pid": OLD, "step": 0, "ok": True, "start": saved},
            {**_step(OLD, 6, 0.5), "start": saved},
            {**_restore(OLD), "start": resumed_start},
            {**_step(OLD, 7, 0.25), "start": resumed_start},
        ],
    )
    gate = _by_name(evaluate(tmp_path))["all PIDs changed"]
    assert gate.status is expected, gate.evidence
    if expected is Status.FAIL:
        assert f"restored in the same process (pid {OLD})" in gate.evidence


def test_the_plan_line_says_when_rl_gates_are_judged_under_a_plan_without_rl(tmp_path):
    plain = {"rl": False, "deterministic": True, "replay_steps": 1}
    fp = {"bytes": "b6", "scales": "none"}
    _write(
        tmp_path,
        [
            {"event": "save", "pid": OLD, "step": 6, "plan": plain},
            {"event": "export", "pid": OLD, "step": 6, "fingerprint": fp},
            _restore(NEW),
            {"event": "export", "pid": NEW, "step": 6, "fingerprint": fp},
        ],
    )
    rows = _by_name(evaluate(tmp_path))
    assert rows["proof plan"].evidence.startswith("rl=False, ")
    assert (
        "the records hold export records, so their gates are judged as under rl=True"
        in rows["proof plan"].evidence
    )
    assert rows["first export byte-identical"].status is Status.PASS
