"""A diverged resume is never PROVEN, and a difference the records show is never missing evidence.

Hand-written records in the format ``record_*`` appends (``ROOT/proof/rank_NNNNN.jsonl``), each a
case a cold review found: a crash loop whose resumes share a restore bug, a rank judged by another
rank, an optimizer that never stepped past the reference, a reference update recorded after its step
record, and a ``save_async`` save record lost with the kill. Each case has an exact twin that must
still PASS.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ckptguard.ops.prove import Outcome, Status, evaluate, outcome, verdict

PLAN = {"rl": False, "deterministic": True, "replay_steps": 1}


def _write(root: Path, rank: int, records: list[dict[str, Any]], offset: int = 0) -> None:
    path = root / "proof" / f"rank_{rank:05d}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for i, r in enumerate(
            records
        ):  # in time order: each launch is told apart by its restore's time
            f.write(
                json.dumps(
                    {
                        "rank": rank,
                        "host": "h",
                        "time": float(i + offset),
                        "mono": float(i + offset),
                        **r,
                    }
                )
                + "\n"
            )


def _step(pid: int, step: int, ids: str, norm: float = 0.5, **extra: Any) -> dict[str, Any]:
    out = {
        "event": "step",
        "pid": pid,
        "step": step,
        "sample_ids": ids,
        "loss": 0.5,
        "grad_norm": norm,
    }
    return {**out, "extra": extra} if extra else out


def _restore(pid: int, step: int, world: int = 1) -> dict[str, Any]:
    return {
        "event": "restore",
        "pid": pid,
        "step": step,
        "digests_match": {"model": True},
        "ok": True,
        "addresses_changed": [],
        "world_size": world,
        "saved_world_size": world,
    }


def _save(pid: int, step: int, plan: dict[str, Any] = PLAN) -> dict[str, Any]:
    return {"event": "save", "pid": pid, "step": step, "plan": plan}


def _update(pid: int, step: int, norm: float, changed: bool) -> dict[str, Any]:
    return {
        "event": "update",
        "pid": pid,
        "step": step,
        "grad_norm": norm,
        "params_changed": changed,
    }


def _gate(gates, name: str):
    return next(g for g in gates if g.name == name)


def _crash_loop(root: Path, resumed: list[str], epochs: list[int] | None = None) -> None:
    """Steps 1-6 trained and saved; two resumes of step 6 consume ``resumed`` at steps 7-8 (the
    saving run recorded nothing past the save)."""

    def ep(i: int) -> dict[str, Any]:
        return {"epoch": epochs[i]} if epochs is not None else {}

    first = [
        _step(100, s, f"ids{s}", **({"epoch": 0} if epochs is not None else {}))
        for s in range(1, 7)
    ]
    again = [_step(pid, 7 + i, ids, **ep(i)) for pid in (200, 300) for i, ids in enumerate(resumed)]
    _write(
        root,
        0,
        [
            _restore(100, 0),
            *first,
            _save(100, 6),
            _restore(200, 6),
            *again[:2],
            _restore(300, 6),
            *again[2:],
        ],
    )


def test_a_crash_loop_whose_resumes_share_a_restore_bug_is_not_proven(tmp_path):
    # CE1: every resume puts the cursor back to the pass's start; they agree with each other
    _crash_loop(tmp_path, ["ids1", "ids2"])
    gates = evaluate(tmp_path)
    data = _gate(gates, "data order identical")
    assert outcome(gates) is not Outcome.PROVEN, verdict(gates)
    assert data.status is Status.MISSING, data.evidence
    assert (
        "step 7: the resumed run consumed sample_ids ids1, which step 1 consumed "
        "before the save of step 6"
        in data.evidence
        and "record_step(..., epoch=)" in data.evidence
    )


def test_a_crash_loop_repeating_data_of_the_same_epoch_fails(tmp_path):
    _crash_loop(
        tmp_path, ["ids3", "ids4"], epochs=[0, 0]
    )  # a cursor restored to an older value, in epoch 0
    gates = evaluate(tmp_path)
    data = _gate(gates, "data order identical")
    assert outcome(gates) is Outcome.DIVERGED and data.status is Status.FAIL, data.evidence
    assert (
        "rank 0, step 7: the resumed run consumed sample_ids ids3, already consumed at "
        "step 3 in the same epoch 0" in data.evidence
    )


def test_an_exact_crash_loop_is_still_proven_and_says_what_it_rests_on(tmp_path):
    _crash_loop(tmp_path, ["ids7", "ids8"])
    gates = evaluate(tmp_path)
    assert outcome(gates) is Outcome.PROVEN, verdict(gates)
    assert "compared with an earlier resume of step 6, not with the run that saved it" in verdict(
        gates
    )
    # a new epoch recorded as such is not data consumed twice
    _crash_loop(tmp_path / "epoch", ["ids1", "ids2"], epochs=[1, 1])
    gates = evaluate(tmp_path / "epoch")
    assert outcome(gates) is Outcome.PROVEN, verdict(gates)


def _two_ranks(
    root: Path, plan: dict[str, Any], rank1_ids: list[str], rank1_history: bool = True
) -> None:
    """A job-wide kill after rank 0 recorded step 6 and before rank 1 did; both resumed from step
    5."""
    _write(
        root,
        0,
        [
            _restore(10, 0, 2),
            _step(10, 5, "a5"),
            _save(10, 5, plan),
            _step(10, 6, "a6"),
            _restore(30, 5, 2),
            _step(30, 6, "a6"),
            _step(30, 7, "a7"),
        ],
    )
    earlier = [_restore(11, 0, 2), _step(11, 5, "b5"), _save(11, 5, plan)] if rank1_history else []
    resumed = [_restore(31, 5, 2), *(_step(31, 6 + i, ids) for i, ids in enumerate(rank1_ids))]
    _write(root, 1, [*earlier, *resumed], offset=0 if rank1_history else 4)


def test_a_rank_judged_by_another_under_a_non_deterministic_plan_is_missing_evidence(tmp_path):
    # CE2: rank 1 consumed the wrong data; only rank 0 has a reference, and its numbers say nothing
    # bitwise
    _two_ranks(tmp_path, {**PLAN, "deterministic": False}, ["b1", "b2"])
    gates = evaluate(tmp_path)
    data = _gate(gates, "data order identical")
    assert outcome(gates) is not Outcome.PROVEN and data.status is Status.MISSING, data.evidence
    assert "rank 1: no run before this resume recorded a step past step 5" in data.evidence


def test_a_rank_without_any_earlier_record_is_not_judged_by_another(tmp_path):
    # CE2b: rank 1's records of the killed run were lost with its node
    _two_ranks(tmp_path, PLAN, ["b1", "b2"], rank1_history=False)
    data = _gate(evaluate(tmp_path), "data order identical")
    assert data.status is Status.MISSING, data.evidence
    assert "rank 1: no record of any run before this resume on this rank" in data.evidence
    assert "the killed run had recorded nothing past step 5 there" not in data.evidence


def test_ranks_one_record_apart_under_a_deterministic_plan_pass_with_what_it_rests_on(tmp_path):
    _two_ranks(tmp_path, PLAN, ["b6", "b7"])
    gates = evaluate(tmp_path)
    data = _gate(gates, "data order identical")
    assert data.status is Status.PASS, data.evidence
    assert "judged by rank(s) [0]" in data.evidence
    assert (
        "data order of rank(s) [1] judged by the other ranks' replay (ranks taken as symmetric)"
        in data.qualifies
    )
    # the same resume under a non-deterministic plan: rank 1's data stands on nothing
    _two_ranks(tmp_path / "nd", {**PLAN, "deterministic": False}, ["b6", "b7"])
    assert _gate(evaluate(tmp_path / "nd"), "data order identical").status is Status.MISSING


def test_a_rank_that_consumed_another_ranks_samples_is_not_judged_by_it(tmp_path):
    # the lead's review 2: rank 1 consumed rank 0's samples at steps 6-7 (its data shard lost), one
    # record behind rank 0 at the kill; data parallel at the restored step (a5 vs b5), so rank 0's
    # replay cannot stand for it
    _two_ranks(tmp_path, PLAN, ["a6", "a7"])
    gates = evaluate(tmp_path)
    data = _gate(gates, "data order identical")
    assert outcome(gates) is not Outcome.PROVEN and data.status is Status.MISSING, data.evidence
    assert "rank 1: no run before this resume recorded a step past step 5" in data.evidence
    assert (
        "not judged by rank(s) [0]: at step 6 it consumed the data a judged rank consumed there"
        in data.evidence
    )
    # ranks that share their data (tensor parallel: the same samples at the restored step too) stay
    # symmetric
    _write(
        tmp_path / "tp",
        0,
        [
            _restore(10, 0, 2),
            _step(10, 5, "a5"),
            _save(10, 5, PLAN),
            _step(10, 6, "a6"),
            _restore(30, 5, 2),
            _step(30, 6, "a6"),
            _step(30, 7, "a7"),
        ],
    )
    _write(
        tmp_path / "tp",
        1,
        [
            _restore(11, 0, 2),
            _step(11, 5, "a5"),
            _save(11, 5, PLAN),
            _restore(31, 5, 2),
            _step(31, 6, "a6"),
            _step(31, 7, "a7"),
        ],
    )
    assert _gate(evaluate(tmp_path / "tp"), "data order identical").status is Status.PASS


def test_a_replayed_update_whose_grad_norm_differs_fails_the_numbers(tmp_path):
    # the step records' loss is this rank's, before the all-reduce; the update's grad_norm carries
    # every rank's data
    _write(
        tmp_path,
        0,
        [
            _restore(10, 0),
            _step(10, 5, "a5"),
            _save(10, 5),
            _step(10, 6, "a6"),
            _update(10, 6, 0.7, True),
            _restore(30, 5),
            _step(30, 6, "a6"),
            _update(30, 6, 0.9, True),
        ],
    )
    numbers = _gate(evaluate(tmp_path), "replayed steps identical")
    assert numbers.status is Status.FAIL and "grad_norm (record_update)" in numbers.evidence, (
        numbers.evidence
    )


def test_a_container_restart_that_reuses_the_pid_is_a_new_process(tmp_path):
    # the lead's review 3: pid 1 as the entrypoint, one hostname; the restore records' process_start
    # differ
    first, second = (
        {**_restore(1, 0), "process_start": 100.0},
        {**_restore(1, 5), "process_start": 200.0},
    )
    _write(
        tmp_path,
        0,
        [first, _step(1, 5, "a5"), _save(1, 5), _step(1, 6, "a6"), second, _step(1, 6, "a6")],
    )
    gates = evaluate(tmp_path)
    assert outcome(gates) is Outcome.PROVEN, verdict(gates)
    assert "pid 1, its reuse 1" in _gate(gates, "resume judged").evidence
    # without process_start (an older record) one pid is one process, as before: restored in the
    # same process
    _write(
        tmp_path / "old",
        0,
        [_restore(1, 0), _step(1, 5, "a5"), _save(1, 5), _restore(1, 5), _step(1, 6, "a6")],
    )
    assert _gate(evaluate(tmp_path / "old"), "all PIDs changed").status is Status.FAIL


def test_a_resume_after_a_rollback_whose_step_was_saved_twice_is_missing_evidence(tmp_path):
    # the lead's review 4: run A saves 5 and 10 and trains to 12; run B rolls back to 5 and records
    # step 10 (its save record lost with a kill); run C restores step 10: A's or B's, nothing says
    # which
    a = [
        _restore(1, 0),
        *(_step(1, s, f"a{s}") for s in range(4, 6)),
        _save(1, 5),
        *(_step(1, s, f"a{s}") for s in range(6, 11)),
        _save(1, 10),
        _step(1, 11, "a11"),
        _step(1, 12, "a12"),
    ]
    b = [_restore(2, 5), *(_step(2, s, f"b{s}") for s in range(6, 11))]
    c = [_restore(3, 10), _step(3, 11, "b11"), _step(3, 12, "b12")]
    _write(tmp_path, 0, [*a, *b, *c])
    gates = evaluate(tmp_path)
    data = _gate(gates, "data order identical")
    assert data.status is Status.MISSING and outcome(gates) is not Outcome.DIVERGED, data.evidence


def test_a_resumed_process_that_died_on_an_exception_is_not_called_an_exhausted_loader(tmp_path):
    # H3's finding F2: an exit record that names the exception ("raised") is said as such
    exited = {
        "event": "exit",
        "pid": 2,
        "step": 5,
        "trained": 0,
        "total_steps": 9,
        "raised": "ConfigError: step 5 is already committed",
    }
    _write(
        tmp_path,
        0,
        [_restore(1, 0), _step(1, 5, "a5"), _save(1, 5), _step(1, 6, "a6"), _restore(2, 5), exited],
    )
    trained = _gate(evaluate(tmp_path), "resumed run trained")
    assert (
        trained.status is Status.FAIL
        and "died on an uncaught exception before its first step: ConfigError: "
        "step 5 is already committed"
        in trained.evidence
    ), trained.evidence
    assert "exhausted loader" not in trained.evidence


def test_an_optimizer_that_never_steps_past_the_reference_is_not_a_pass(tmp_path):
    # CE3: the reference had a zero update at step 7; the resumed run's optimizer changes no
    # parameter from then on
    resumed = [
        r
        for s in range(7, 30)
        for r in (
            _update(2, s, 0.0 if s == 7 else 0.9, False),
            _step(2, s, f"i{s}", 0.0 if s == 7 else 0.9),
        )
    ]
    _write(
        tmp_path,
        0,
        [_save(1, 6), _update(1, 7, 0.0, False), _step(1, 7, "i7", 0.0), _restore(2, 6), *resumed],
    )
    gates = evaluate(tmp_path)
    gate = _gate(gates, "one non-zero update")
    assert gate.status is Status.MISSING and outcome(gates) is not Outcome.PROVEN, gate.evidence
    assert (
        "step 8, which no earlier run recorded, had grad_norm 0.9 and params_changed=False"
        in gate.evidence
    )


def test_zero_updates_past_the_reference_need_the_planned_replayed_steps(tmp_path):
    plan = {**PLAN, "replay_steps": 2}
    _write(
        tmp_path,
        0,
        [
            _save(1, 6, plan),
            _update(1, 7, 0.0, False),
            _restore(2, 6),
            _update(2, 7, 0.0, False),
            _update(2, 8, 0.0, False),
        ],
    )
    gate = _gate(evaluate(tmp_path), "one non-zero update")
    assert gate.status is Status.MISSING and "the plan asks for 2" in gate.evidence, gate.evidence


def test_the_reference_update_is_found_whatever_the_order_of_its_records(tmp_path):
    # CE4: the reference wrote record_step (no grad_norm) before record_update of each step
    def plain(pid: int, s: int) -> dict[str, Any]:
        return {"event": "step", "pid": pid, "step": s, "sample_ids": f"i{s}", "loss": 0.5}

    _write(
        tmp_path,
        0,
        [
            _save(1, 6),
            plain(1, 7),
            _update(1, 7, 0.7, True),
            plain(1, 8),
            _update(1, 8, 0.7, True),
            _restore(2, 6),
            plain(2, 7),
            _update(2, 7, 0.0, False),
            plain(2, 8),
            _update(2, 8, 0.0, False),
        ],
    )
    gates = evaluate(tmp_path)
    gate = _gate(gates, "one non-zero update")
    assert gate.status is Status.FAIL and outcome(gates) is Outcome.DIVERGED, gate.evidence
    assert (
        "where the run that saved step 6 (pid 1) had grad_norm 0.7 at the same step"
        in gate.evidence
    )


@pytest.mark.parametrize(
    ("resumed", "expected"),
    [(["ids1", "ids2"], Outcome.DIVERGED), (["ids7", "ids8"], Outcome.PROVEN)],
)
def test_a_lost_async_save_record_keeps_the_saving_runs_own_steps(tmp_path, resumed, expected):
    # CE5: save_async of step 6 committed while steps 7-8 trained; the kill landed before its save
    # record
    _write(
        tmp_path,
        0,
        [
            _restore(1, 0),
            _save(1, 0),
            *(_step(1, s, f"ids{s}") for s in range(1, 9)),
            _restore(2, 6),
            _step(2, 7, resumed[0]),
            _step(2, 8, resumed[1]),
        ],
    )
    gates = evaluate(tmp_path)
    data = _gate(gates, "data order identical")
    assert outcome(gates) is expected, verdict(gates)
    if expected is Outcome.DIVERGED:
        assert (
            data.status is Status.FAIL
            and "the resumed run consumed sample_ids ids1, the killed run sample_ids ids7"
            in data.evidence
        ), data.evidence
    else:
        assert data.status is Status.PASS and data.qualifies == "", (data.evidence, data.qualifies)


def test_an_export_compared_with_an_earlier_resume_says_so_in_the_verdict(tmp_path):
    fp = {"bytes": "b6", "scales": "none"}
    rl = {**PLAN, "rl": True}
    _write(
        tmp_path,
        0,
        [
            _restore(100, 0),
            _save(100, 6, rl),
            _restore(200, 6),
            {"event": "export", "pid": 200, "step": 6, "fingerprint": fp},
            _restore(300, 6),
            {"event": "export", "pid": 300, "step": 6, "fingerprint": fp},
        ],
    )
    gate = _gate(evaluate(tmp_path), "first export byte-identical")
    assert (
        gate.status is Status.PASS
        and "that of an earlier resume of step 6 (pid 200)" in gate.evidence
    )
    assert gate.qualifies.startswith(
        "first export byte-identical compared with an earlier resume"
    ), gate.qualifies
