"""Proof gates (each failing for its own reason), derived-state invalidation, and the demo."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckptguard as cg
from ckptguard import StateOptions
from ckptguard._state.derived import DerivedState, StaleDerivedStateError
from ckptguard.cli import main
from ckptguard.demo.toyjob import build_job, train_step
from ckptguard.ops.prove import Status, evaluate, passed, verdict

OLD, NEW = 111, 222


def _write(root: Path, rank: int, records: list[dict]) -> None:
    path = root / "proof" / f"rank_{rank:05d}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps({"rank": rank, "host": "h", "time": 0.0, "mono": 0.0, **r}) + "\n")


PLAN = {"rl": True, "deterministic": True, "replay_steps": 1}


def _honest(**over) -> list[dict]:
    fp = {"bytes": "b6", "scales": "s6"}
    killed = {
        "event": "step",
        "pid": OLD,
        "step": 7,
        "sample_ids": "ids7",
        "batch": "b7",
        "loss": 0.51866,
        "grad_norm": 0.5,
    }
    resumed = {**killed, "pid": NEW, **over.get("step", {})}
    records = [
        {"event": "export", "pid": OLD, "step": 6, "fingerprint": fp},
        {"event": "save", "pid": OLD, "step": 6, "plan": over.get("plan", PLAN)},
        *([killed] if over.get("killed", True) else []),
        *(
            [
                {
                    "event": "logprobs",
                    "pid": OLD,
                    "step": 7,
                    "probs_diff": 0.0,
                    "tokens": 10,
                    "max_abs_logprob_diff": 0.0,
                }
            ]
            if over.get("killed_lp")
            else []
        ),
        {
            "event": "restore",
            "pid": NEW,
            "step": 6,
            "digests_match": {"model": True, "optim": True},
            "ok": True,
            "format_version": 1,
            "addresses_changed": over.get("moved", []),
        },
        {"event": "export", "pid": NEW, "step": 6, "fingerprint": over.get("fp", fp)},
        {
            "event": "logprobs",
            "pid": NEW,
            "step": 7,
            "probs_diff": over.get("diff", 0.0),
            "tokens": 10,
            "max_abs_logprob_diff": 0.0,
        },
        {
            "event": "update",
            "pid": NEW,
            "step": 7,
            "grad_norm": over.get("norm", 0.5),
            "params_changed": True,
        },
        resumed,
    ]
    return records


def _gates(root: Path) -> dict[str, Status]:
    return {g.name: g.status for g in evaluate(root)}


def _evidence(root: Path, name: str) -> str:
    return next(g.evidence for g in evaluate(root) if g.name == name)


def test_honest_records_pass_every_gate(tmp_path):
    for rank in (0, 1):
        _write(tmp_path, rank, _honest())
    gates = evaluate(tmp_path)
    assert passed(gates) and verdict(gates) == "resume PROVEN"
    assert [g.status for g in gates if g.required] == [Status.PASS] * 10


@pytest.mark.parametrize(
    ("change", "gate"),
    [
        ({"fp": {"bytes": "other", "scales": "s6"}}, "first export byte-identical"),
        ({"fp": {"bytes": "b6", "scales": "stale"}}, "first export byte-identical"),
        ({"diff": 0.06, "killed_lp": True}, "first old-logprob aligned"),
        ({"norm": 0.0}, "one non-zero update"),
        ({"moved": ["model.weight"]}, "addresses unchanged"),
        ({"step": {"batch": "b8"}}, "data order identical"),
        ({"step": {"loss": 0.51793}}, "replayed steps identical"),
    ],
)
def test_each_gate_fails_for_its_own_reason(tmp_path, change, gate):
    _write(tmp_path, 0, _honest())
    _write(tmp_path, 1, _honest(**change))
    gates = _gates(tmp_path)
    assert gates[gate] is Status.FAIL
    assert [name for name, s in gates.items() if s is Status.FAIL] == [gate]
    assert (
        not passed(evaluate(tmp_path))
        and verdict(evaluate(tmp_path)) == f"resume NOT proven: {gate} (FAIL)"
    )


def test_a_real_engines_nonzero_probs_diff_is_aligned_only_when_bitwise_the_saving_runs(tmp_path):
    # a real rollout engine (vLLM) runs other kernels than the trainer: probs_diff is not 0, and the
    # first old-logprob after the restore must then be bitwise the one the saving run measured
    def records(killed_diff, resumed_diff, saver_pid=OLD):
        out = _honest(diff=resumed_diff)
        lp = {
            "event": "logprobs",
            "pid": saver_pid,
            "step": 7,
            "probs_diff": killed_diff,
            "tokens": 10,
            "max_abs_logprob_diff": 0.0,
        }
        return [*out[:2], lp, *out[2:]]

    _write(tmp_path / "same", 0, records(3.5e-7, 3.5e-7))
    assert _gates(tmp_path / "same")["first old-logprob aligned"] is Status.PASS
    assert "bitwise the saving run's of the same step" in _evidence(
        tmp_path / "same", "first old-logprob aligned"
    )
    _write(
        tmp_path / "stale", 0, records(3.5e-7, 0.02)
    )  # the engine kept other weights after the restore
    assert _gates(tmp_path / "stale")["first old-logprob aligned"] is Status.FAIL
    assert "the saving run's of the same step 3.5e-07" in _evidence(
        tmp_path / "stale", "first old-logprob aligned"
    )
    _write(
        tmp_path / "other", 0, records(3.5e-7, 3.5e-7, saver_pid=333)
    )  # not the saving process's record
    # nothing to compare with is missing evidence (the saving run was killed before it), not a
    # difference
    assert _gates(tmp_path / "other")["first old-logprob aligned"] is Status.MISSING
    assert "no run before this resume recorded an old-logprob of that step" in _evidence(
        tmp_path / "other", "first old-logprob aligned"
    )


def test_replay_gates_name_the_step_and_follow_the_plan(tmp_path):
    _write(tmp_path / "loss", 0, _honest(step={"loss": 0.51793}))
    assert _evidence(tmp_path / "loss", "replayed steps identical").startswith(
        "rank 0, step 7: loss 0.51866 in the killed run, 0.51793 after the resume"
    )
    lenient = {**PLAN, "deterministic": False}
    _write(tmp_path / "info", 0, _honest(step={"loss": 0.51793}, plan=lenient))
    info = next(g for g in evaluate(tmp_path / "info") if g.name == "replayed steps identical")
    assert (
        info.status is Status.INFO
        and not info.required
        and "largest difference 0.00073 in loss" in info.evidence
    )
    assert passed(evaluate(tmp_path / "info"))
    # no overlap: the kill came right after the save
    _write(tmp_path / "none", 0, _honest(killed=False))
    assert _gates(tmp_path / "none")["data order identical"] is Status.MISSING
    assert "the run that saved step 6 (pid 111) recorded no step past it" in _evidence(
        tmp_path / "none", "data order identical"
    )
    _write(tmp_path / "short", 0, _honest(plan={**PLAN, "replay_steps": 2}))
    assert "the plan asks for 2" in _evidence(tmp_path / "short", "data order identical")
    # a plain training job: the RL gates are N/A, not faked, and it is proven without them
    plain = [
        r for r in _honest(plan={**PLAN, "rl": False}) if r["event"] not in ("export", "logprobs")
    ]
    _write(tmp_path / "plain", 0, plain)
    gates = evaluate(tmp_path / "plain")
    na = [g for g in gates if g.status is Status.NA]
    assert [g.name for g in na] == ["first export byte-identical", "first old-logprob aligned"]
    assert all(g.evidence.startswith("(not an RL job)") and not g.required for g in na) and passed(
        gates
    )


def test_a_restore_that_raised_is_a_failure_naming_the_error(tmp_path):
    records = _honest()
    records[3] = {
        **records[3],
        "ok": False,
        "error": "CheckpointCorruptError: reading step 6 failed",
    }
    _write(tmp_path, 0, records)
    gates = _gates(tmp_path)
    assert gates["restored step confirmed before training"] is Status.FAIL
    assert (
        gates["all PIDs changed"] is Status.MISSING
    )  # not a PASS for a restore that did not complete
    assert "raised CheckpointCorruptError: reading step 6 failed" in _evidence(
        tmp_path, "restored step confirmed before training"
    )
    assert (
        verdict(evaluate(tmp_path))
        == "resume NOT proven: restored step confirmed before training (FAIL)"
    )


def test_a_record_torn_by_a_kill_mid_append_leaves_the_log_readable(tmp_path):
    from ckptguard._records.proofreader import read_records
    from ckptguard._records.proofwriter import ProofLog

    ProofLog(tmp_path, 0).append("save", step=6)
    with open(tmp_path / "proof/rank_00000.jsonl", "a") as f:
        f.write('{"event": "step", "step": 7, "ba')  # SIGKILL in the middle of an append
    ProofLog(tmp_path, 0).append("restore", step=6)  # the next process
    assert [r["event"] for r in read_records(tmp_path)[0]] == ["save", "restore"]
    with open(tmp_path / "proof/rank_00000.jsonl", "a") as f:
        f.write("edited by hand\n")
    ProofLog(tmp_path, 0).append("step", step=7)
    with pytest.raises(cg.CheckpointCorruptError, match="append-only"):
        read_records(tmp_path)


def test_tampered_digest_same_pid_and_late_confirmation_fail(tmp_path):
    records = _honest()
    records[3]["digests_match"]["optim"] = False
    _write(tmp_path / "a", 0, records)
    assert _gates(tmp_path / "a")["digests equal, item by item"] is Status.FAIL
    same = [dict(r, pid=OLD) for r in _honest()]
    _write(
        tmp_path / "b",
        0,
        [{"event": "update", "pid": 5, "step": 1, "grad_norm": 1.0, "params_changed": True}, *same],
    )
    assert _gates(tmp_path / "b")["all PIDs changed"] is Status.FAIL
    late = _honest()
    late.insert(
        3, {"event": "update", "pid": NEW, "step": 7, "grad_norm": 1.0, "params_changed": True}
    )
    _write(tmp_path / "c", 0, late)
    assert _gates(tmp_path / "c")["restored step confirmed before training"] is Status.FAIL


def test_cold_start_and_unexecuted_gates_are_not_run(tmp_path):
    _write(tmp_path / "cold", 0, [{"event": "restore", "pid": 1, "step": 0, "fresh": True}])
    gates = evaluate(tmp_path / "cold")
    assert all(g.status is Status.MISSING for g in gates if g.required)
    assert not passed(gates)
    records = [r for r in _honest() if r["event"] != "logprobs"]
    _write(tmp_path / "nolog", 0, records)
    assert _gates(tmp_path / "nolog")["first old-logprob aligned"] is Status.MISSING


@pytest.mark.parametrize("item", ["optim", "sched"])
def test_real_tampered_manifest_digest_is_recorded_and_fails(tmp_path, item):
    job = build_job()
    train_step(job)
    mgr = cg.CheckpointManager(tmp_path / "ck")
    mgr.save(1, job.state())
    manifest = tmp_path / "ck/step_00000001/manifest.json"
    data = json.loads(manifest.read_text())
    if item == "optim":  # a tensor item: the restore compares its layout-free digests
        key = sorted(data["layout_free"]["optim"])[0]
        data["layout_free"]["optim"][key] = "0" * 16
    else:  # a stateful object: its per-rank digest
        data["digests"]["0"]["sched"] = "0" * 16
    manifest.write_text(json.dumps(data))
    with pytest.raises(cg.StateMismatchError, match=f"'{item}'"):
        mgr.restore(build_job().state())
    assert _gates(tmp_path / "ck")["digests equal, item by item"] is Status.FAIL
    # the restore raised: shown as a failure naming the error, never as a confirmed step
    assert "raised StateMismatchError: restore of step 1" in _evidence(
        tmp_path / "ck", "restored step confirmed before training"
    )


def test_derived_state_invalidates_on_restore_and_update(tmp_path):
    registry = DerivedState()
    cache = {"scale": 1.0, "built_for": registry.stamp()}
    dropped = []
    registry.register("scale", lambda: dropped.append(registry.version))
    with pytest.raises(cg.ConfigError, match="already registered"):
        registry.register("scale", lambda: None)
    registry.check("scale", cache["built_for"])
    job = build_job()
    mgr = cg.CheckpointManager(tmp_path / "ck", derived=registry)
    mgr.save(1, job.state())
    mgr.restore(build_job().state())
    assert dropped == [1] and registry.history[-1] == (1, "restore of step 1")
    with pytest.raises(StaleDerivedStateError, match="built for parameter version 0"):
        registry.check("scale", cache["built_for"])
    registry.mark_updated()
    assert dropped == [1, 2] and registry.invalidations("scale") == 2
    registry.check("scale", registry.stamp())
    relaxed = DerivedState(checks=False)
    relaxed.register("x", lambda: None)
    relaxed.mark_updated()
    relaxed.check("x", 0)


def _demo(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "ckptguard.cli",
            "demo",
            "--workdir",
            str(tmp_path / "d"),
            "--steps",
            "7",
            "--save-every",
            "2",
            "--kill-at",
            "4",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_demo_proves_the_resume(tmp_path):
    proc = _demo(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resume from step 2" in proc.stdout and proc.stdout.rstrip().endswith("resume PROVEN")
    assert (
        proc.stdout.count("  PASS  ") == 11
    )  # the files, the replicas, the trajectory, "resumed run trained"
    assert "rl=True, deterministic=True" in proc.stdout
    assert "steps 3-4 replayed after the restore of step 2" in proc.stdout
    out = CliRunner().invoke(main, ["prove", str(tmp_path / "d/ckpt"), "--json"])
    shown = json.loads(out.output)
    assert out.exit_code == 0 and shown["verdict"] == "resume PROVEN"
    assert {g["status"] for g in shown["gates"]} == {"PASS", "INFO"}


def test_demo_negative_control_fails_the_right_gates(tmp_path):
    proc = _demo(tmp_path, "--no-derived-fix")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = {
        line[:41].strip(): line[41:].split()[0]
        for line in proc.stdout.splitlines()
        if "  " in line[35:45]
    }
    assert rows["first export byte-identical"] == "FAIL"
    assert rows["first old-logprob aligned"] == "FAIL"
    assert rows["digests equal, item by item"] == "PASS"  # the files are fine: a derived-state bug
    assert rows["one non-zero update"] == "PASS"
    assert rows["data order identical"] == "PASS"  # the same prompts...
    assert rows["replayed steps identical"] == "FAIL"  # ...trained on stale scales
    assert "resume NOT proven: first export byte-identical (FAIL)" in proc.stdout
    lines = [x for x in proc.stdout.splitlines() if "step  3:" in x or "step  4:" in x]
    assert not lines[-2].endswith("probs_diff 0") and lines[-1].endswith(
        "probs_diff 0"
    )  # the next step recovers


class Replacing(torch.nn.Linear):
    """A module whose load swaps in new Parameters: the bug the address gate exists for."""

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name in ("weight", "bias"):
            setattr(self, name, torch.nn.Parameter(state_dict[prefix + name].clone()))


def test_address_gate_catches_a_restore_that_replaced_tensors(tmp_path):
    for cls, expected in ((torch.nn.Linear, Status.PASS), (Replacing, Status.FAIL)):
        root = tmp_path / cls.__name__
        torch.manual_seed(0)
        unchecked = cg.CheckpointConfig(state=StateOptions(verify_restored=False))
        cg.CheckpointManager(root, config=unchecked).save(1, {"model": cls(4, 2)})
        _write(
            root, 0, [{"event": "save", "pid": OLD, "step": 1}]
        )  # as if saved by another process
        fresh = cls(4, 2)
        ptr = fresh.weight.data_ptr()
        cg.CheckpointManager(root, config=unchecked).restore({"model": fresh})
        assert (fresh.weight.data_ptr() == ptr) == (expected is Status.PASS)
        assert _gates(root)["addresses unchanged"] is expected
