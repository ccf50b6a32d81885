"""PROVEN means exact: numerics compared by default, zero-step resumes refused, any resume judged,
hints that fit.

Each scenario runs a loop of ``ckptguard.demo.loops`` in segments, each a new process (a spawned
rank for the in-process cases, a real interpreter where the exit hook must run): the first stops
right after recording a step past its last save (what a SIGKILL there leaves), the next resumes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import ckptguard as cg
from ckptguard.cli import main
from ckptguard.demo import loops
from ckptguard.ops.prove import Outcome, Status, evaluate, outcome, passed, verdict
from ckptguard.testing import run_ranks, values

SAVE_EVERY, STOP_AFTER, END = 5, 8, 8  # the resumed segment replays 6-8 and saves nothing

SCENARIOS = {
    "noise_default": {"noise": True},
    "noise_declared": {"noise": True, "deterministic": False},
    "naive": {"sampler": "random", "prefetch": "before_restore"},
    "exact": {},
}


def _segments(rank: int, world: int, base: str, scenarios: dict, second: bool) -> dict:
    end = {"steps": END} if second else {"steps": END, "stop_after": STOP_AFTER}
    return {
        name: loops.run(
            f"{base}/{name}", rank=rank, world=world, save_every=SAVE_EVERY, **end, **kw
        )["start"]
        for name, kw in scenarios.items()
    }


def _by_name(gates) -> dict:
    return {g.name: g for g in gates}


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    base = tmp_path_factory.mktemp("replayed")
    first = values(run_ranks(_segments, 1, str(base), SCENARIOS, False, distributed=False))[0]
    second = values(run_ranks(_segments, 1, str(base), SCENARIOS, True, distributed=False))[0]
    assert set(first.values()) == {0} and set(second.values()) == {SAVE_EVERY}
    return base


def test_the_default_plan_compares_numerics_and_names_the_likely_cause(replayed):
    gates = evaluate(replayed / "noise_default")
    rows = _by_name(gates)
    assert "deterministic=True" in rows["proof plan"].evidence
    assert (
        rows["data order identical"].status is Status.PASS
    )  # the data was the same: only the numbers moved
    numbers = rows["replayed steps identical"]
    assert numbers.status is Status.FAIL and numbers.required
    assert numbers.evidence.startswith("rank 0, step 6: loss ")
    assert (
        "Likely causes, in order: (1) a generator used inside the step and not in the state"
        in numbers.evidence
    )
    assert (
        numbers.evidence.index("(1)")
        < numbers.evidence.index("(2) a different thread count")
        < numbers.evidence.index("(3) a changed batch composition")
    )
    assert "ProofPlan(deterministic=False)" in numbers.evidence
    assert verdict(gates) == "resume NOT proven: replayed steps identical (FAIL)"
    exact = evaluate(replayed / "exact")
    assert verdict(exact) == "resume PROVEN", [(g.name, g.status, g.evidence) for g in exact]


def test_declared_non_deterministic_steps_are_proven_with_the_declaration_in_the_verdict(replayed):
    gates = evaluate(replayed / "noise_declared")
    rows = _by_name(gates)
    plan = rows["proof plan"].evidence
    assert "deterministic=False" in plan and "recorded with the save" in plan
    assert rows["replayed steps identical"].status is Status.INFO
    assert "largest difference" in rows["replayed steps identical"].evidence
    assert verdict(gates) == (
        "resume PROVEN (replayed numerics not compared: the plan declares non-deterministic steps)"
    )
    shown = CliRunner().invoke(main, ["prove", str(replayed / "noise_declared"), "--json"])
    out = json.loads(shown.output)
    assert (
        shown.exit_code == 0
        and out["proven"]
        and out["verdict"].endswith("non-deterministic steps)")
    )


def test_an_rl_plan_implies_non_deterministic_steps_unless_it_says_otherwise():
    assert cg.ProofPlan().deterministic is True
    assert cg.ProofPlan(rl=True).deterministic is False
    assert cg.ProofPlan(rl=True, deterministic=True).deterministic is True
    assert cg.ProofPlan(deterministic=False).as_dict() == {
        "rl": False,
        "deterministic": False,
        "replay_steps": 1,
    }
    assert cg.ProofPlan(total_steps=200).as_dict()["total_steps"] == 200
    with pytest.raises(cg.ConfigError, match="total_steps"):
        cg.ProofPlan(total_steps=0)


def test_a_batch_drawn_before_restore_gets_its_own_hint(replayed):
    data = _by_name(evaluate(replayed / "naive"))["data order identical"]
    assert data.status is Status.FAIL
    assert "step 6 (first replayed step 6)" in data.evidence
    assert "what a freshly started process consumed at its first step (step 1)" in data.evidence
    assert "step 7 matches the killed run's again" in data.evidence
    assert "drawn before restore()" in data.evidence and "GeneratorState" not in data.evidence


def test_coverage_counts_the_replayed_steps_and_says_no_epoch_was_crossed(replayed):
    rows = _by_name(evaluate(replayed / "exact"))
    cover = rows["replay coverage"]
    assert cover.status is Status.INFO and not cover.required
    assert cover.evidence.startswith(
        "3 replayed step(s) compared on each of 1 rank(s); epoch boundary: not seen"
    )
    assert "a sampler's torch.Generator left out of the state" in cover.evidence


# ---------------------------------------------------------------- any resume judged: a crash loop


def _crash_loop(rank: int, world: int, root: str, stop_after: int) -> int:
    return int(
        loops.run(
            root, rank=rank, world=world, steps=20, save_every=SAVE_EVERY, stop_after=stop_after
        )["start"]
    )


@pytest.fixture(scope="module")
def crash_loop(tmp_path_factory):
    """A fresh run killed after step 8, then three relaunches: resume 5 (killed after 12), resume 10
    (killed after 13), resume 10 again (killed before its first step)."""
    root = tmp_path_factory.mktemp("loop") / "ck"
    starts = [
        values(run_ranks(_crash_loop, 1, str(root), stop, distributed=False))[0]
        for stop in (8, 12, 13, 0)
    ]
    assert starts == [0, 5, 10, 10]
    return root


def test_prove_judges_the_newest_resume_with_evidence_and_says_which(crash_loop):
    gates = evaluate(crash_loop)
    judged = _by_name(gates)["resume judged"]
    assert judged.evidence.startswith("resume 2 (step 10, pid ")
    assert (
        "of 3: the newest with evidence; newer resume(s) 3 (step 10) recorded no step"
        in judged.evidence
    )
    assert passed(gates), [(g.name, g.status, g.evidence) for g in gates]
    first = evaluate(crash_loop, resume=1)
    assert _by_name(first)["resume judged"].evidence.startswith("resume 1 (step 5, pid ")
    assert _by_name(first)["data order identical"].evidence.startswith(
        "steps 6-8 replayed after the restore of step 5"
    )
    assert passed(first)
    last = evaluate(crash_loop, resume=3)
    assert verdict(last).startswith(
        "resume EVIDENCE MISSING (no gate found a difference; not compared: "
    )
    assert outcome(last) is Outcome.EVIDENCE_MISSING
    assert "recorded no step and no exit" in _by_name(last)["resumed run trained"].evidence


def test_prove_all_shows_each_resume_and_a_wrong_number_is_refused(crash_loop):
    shown = CliRunner().invoke(main, ["prove", str(crash_loop), "--all"])
    lines = [x for x in shown.output.splitlines() if x.startswith("resume ")]
    assert shown.exit_code == 3, (
        shown.output
    )  # the worst of the three: evidence missing, nothing FAILed
    assert [x.split(":")[0].rsplit(",", 1)[0] for x in lines] == [
        "resume 1 (step 5",
        "resume 2 (step 10",
        "resume 3 (step 10",
    ]
    assert lines[0].endswith("resume PROVEN") and lines[1].endswith("resume PROVEN")
    assert (
        "resume EVIDENCE MISSING" in lines[2]
        and "rank 0: the process that restored step 10" in lines[2]
    )
    as_json = json.loads(
        CliRunner().invoke(main, ["prove", str(crash_loop), "--all", "--json"]).output
    )
    assert [r["proven"] for r in as_json["resumes"]] == [True, True, False] and as_json[
        "proven"
    ] is False
    assert [r["outcome"] for r in as_json["resumes"]] == ["proven", "proven", "evidence missing"]
    assert as_json["outcome"] == "evidence missing" and as_json["exit_code"] == 3
    one = CliRunner().invoke(main, ["prove", str(crash_loop), "--resume", "2"])
    assert one.exit_code == 0 and "resume 2 (step 10" in one.output and "as asked" in one.output
    bad = CliRunner().invoke(main, ["prove", str(crash_loop), "--resume", "4"])
    assert bad.exit_code == 2 and "resumes 1-3" in bad.output and "Traceback" not in bad.output
    both = CliRunner().invoke(main, ["prove", str(crash_loop), "--all", "--resume", "1"])
    assert both.exit_code == 2


# ---------------------------------------------------------------- a resumed run must train


def _killed_after_14(rank: int, world: int, root: str, extra: dict) -> int:
    return int(
        loops.run(root, rank=rank, world=world, steps=20, save_every=4, total_steps=20, **extra)[
            "start"
        ]
    )


def test_a_resume_that_trains_zero_steps_fails_and_says_so_at_exit(tmp_path):
    root = tmp_path / "ck"
    assert values(
        run_ranks(_killed_after_14, 1, str(root), {"stop_after": 14}, distributed=False)
    ) == [0]
    # The relaunch (a real interpreter: the exit hook runs at its exit) restores step 12, the end of
    # an epoch of 12 steps, and iterates the loader of that epoch: exhausted, it trains nothing and
    # exits 0.
    cmd = [
        sys.executable,
        "-m",
        "ckptguard.demo.loops",
        "--root",
        str(root),
        "--steps",
        "20",
        "--save-every",
        "4",
        "--total-steps",
        "20",
        "--epoch-loader",
    ]
    stuck = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert stuck.returncode == 0, stuck.stderr[-3000:]
    assert "resumed at step 12 of 20 and trained 0 steps before the process exited" in stuck.stderr
    gates = evaluate(root)
    gate = _by_name(gates)["resumed run trained"]
    assert gate.status is Status.FAIL
    assert (
        "rank 0: resumed at step 12 of 20 and trained 0 steps, then the process exited (the "
        "plan's total_steps is 20)"
    ) in gate.evidence
    assert verdict(gates) == "resume NOT proven: resumed run trained (FAIL)"
    # the same relaunch with a loader that goes on to the next epoch
    assert values(run_ranks(_killed_after_14, 1, str(root), {}, distributed=False)) == [12]
    gates = evaluate(root)
    assert passed(gates), [(g.name, g.status, g.evidence) for g in gates]
    trained = _by_name(gates)["resumed run trained"].evidence
    assert trained == "trained 8 step(s) after the restore of step 12 (to step 20)"
    assert verdict(evaluate(root, resume=1)) == "resume NOT proven: resumed run trained (FAIL)"


def _write(root: Path, records: list[dict]) -> None:
    path = root / "proof" / "rank_00000.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    base = {"rank": 0, "host": "h", "mono": 0.0}
    path.write_text(
        "".join(json.dumps({**base, "time": float(i), **r}) + "\n" for i, r in enumerate(records))
    )


def _zero_step_job(
    root: Path, *, total: int | None, killed_to: int | None, restored: int = 12
) -> list:
    plan = {
        "rl": False,
        "deterministic": True,
        "replay_steps": 1,
        **({"total_steps": total} if total else {}),
    }
    killed = [
        {"event": "step", "pid": 1, "step": s, "sample_ids": f"i{s}"}
        for s in range(restored + 1, (killed_to or 0) + 1)
    ]
    _write(
        root,
        [
            {"event": "restore", "pid": 1, "step": 0, "fresh": True},
            {"event": "save", "pid": 1, "step": restored, "plan": plan},
            *killed,
            {
                "event": "restore",
                "pid": 2,
                "step": restored,
                "ok": True,
                "plan": plan,
                "digests_match": {"model": True},
            },
            {"event": "exit", "pid": 2, "step": restored, "trained": 0, "total_steps": total},
        ],
    )
    return evaluate(root)


@pytest.mark.parametrize(
    ("total", "killed_to", "status", "said"),
    [
        (
            None,
            14,
            Status.FAIL,
            "resumed at step 12 and trained 0 steps, then the process exited (the killed run had "
            "reached step 14)",
        ),
        (
            None,
            None,
            Status.MISSING,
            "whether steps were left is unknown: declare ProofPlan(total_steps=)",
        ),
        (
            12,
            None,
            Status.NA,
            "step 12 restored, the job's last (total_steps 12): nothing left to train",
        ),
    ],
)
def test_whether_steps_were_left_comes_from_the_plan_or_the_records(
    tmp_path, total, killed_to, status, said
):
    gate = _by_name(_zero_step_job(tmp_path, total=total, killed_to=killed_to))[
        "resumed run trained"
    ]
    assert gate.status is status and said in gate.evidence, gate.evidence


def test_the_exit_hook_records_and_logs_only_after_a_restore(tmp_path, caplog):
    from ckptguard._records.proofwriter import ProofLog

    (tmp_path / "proof").mkdir()
    log = ProofLog(tmp_path, 0)
    log.build("restore", step=0, fresh=True)
    log.watch.at_exit()
    assert not (tmp_path / "proof" / "rank_00000.jsonl").exists()  # a fresh start: nothing to say
    log.build("restore", step=120, ok=True, plan={"total_steps": 200})
    log.watch.at_exit()
    assert "resumed at step 120 of 200 and trained 0 steps" in caplog.text
    record = json.loads((tmp_path / "proof" / "rank_00000.jsonl").read_text())
    assert record["event"] == "exit" and record["trained"] == 0 and record["total_steps"] == 200
    log.build("restore", step=120, ok=True, plan={"total_steps": 200})
    log.build("step", step=121)
    caplog.clear()
    log.watch.at_exit()
    assert "trained 0" not in caplog.text


# ---------------------------------------------------------------- the proof names its code


def test_restore_and_save_records_name_their_code_and_prove_says_when_it_changed(
    replayed, tmp_path
):
    code = _by_name(evaluate(replayed / "exact"))["code identity"]
    # equal versions without a code hash say nothing of the training code: prove says it was not
    # compared
    assert code.status is Status.INFO and code.evidence.startswith(
        "the code was NOT compared: no code hash was "
        "declared; step 5 was saved and resumed under the "
        "same versions (no code hash, ckptguard "
    )
    assert "same code" not in code.evidence
    assert "torch 2.13" in code.evidence and "RunContract(code=hash_git_tree('.'))" in code.evidence
    records = (replayed / "exact" / "proof" / "rank_00000.jsonl").read_text().splitlines()
    changed = []
    for line in records:  # the resumed run ran other code: its restore record says so
        rec = json.loads(line)
        if rec["event"] == "restore" and rec["step"] == SAVE_EVERY:
            rec["code"] = {**rec["code"], "hash": "new", "ckptguard": "9.9"}
        changed.append(json.dumps(rec))
    (tmp_path / "proof").mkdir()
    (tmp_path / "proof" / "rank_00000.jsonl").write_text("\n".join(changed) + "\n")
    code = _by_name(evaluate(tmp_path))["code identity"]
    assert (
        "the saving and the resumed runs ran different code (ckptguard, hash differ)"
        in code.evidence
    )
    assert "resumed by code new, ckptguard 9.9" in code.evidence
    hashed = [
        ln.replace('"ckptguard": "9.9"', '"ckptguard": "0.1.0"').replace(
            '"hash": "new"', '"hash": "h1"'
        )
        for ln in changed
    ]
    hashed = [
        ln if '"event": "save"' not in ln else ln.replace('"code": {', '"code": {"hash": "h1", ')
        for ln in hashed
    ]
    (tmp_path / "proof" / "rank_00000.jsonl").write_text("\n".join(hashed) + "\n")
    code = _by_name(evaluate(tmp_path))["code identity"]
    assert code.evidence.startswith("step 5 saved and resumed by the same code (code h1, "), (
        code.evidence
    )


def test_a_changed_thread_count_is_named_as_the_cause(tmp_path):
    plan = {"rl": False, "deterministic": True, "replay_steps": 1}
    step = {"event": "step", "step": 6, "sample_ids": "i6", "ids_head": [6], "grad_norm": 0.5}
    _write(
        tmp_path,
        [
            {"event": "save", "pid": 1, "step": 5, "plan": plan},
            {**step, "pid": 1, "loss": 0.25, "threads": 4},
            {
                "event": "restore",
                "pid": 2,
                "step": 5,
                "ok": True,
                "plan": plan,
                "digests_match": {"model": True},
            },
            {**step, "pid": 2, "loss": 0.2500001, "threads": 1},
        ],
    )
    gate = _by_name(evaluate(tmp_path))["replayed steps identical"]
    assert gate.status is Status.FAIL and gate.evidence.startswith(
        "rank 0, step 6: loss 0.25 in the killed run"
    )
    assert "The killed run ran with 4 CPU threads, the resumed run with 1" in gate.evidence
