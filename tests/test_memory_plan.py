"""Capacity plan (each term checked), safetensors estimate, vLLM log, recipe check."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptguard.errors import CheckpointCorruptError, ConfigError
from ckptguard.memory import (
    PhaseKind,
    PhaseRecorder,
    RecorderConfig,
    Verdict,
    check_recipe,
    compute_plan,
    estimate_dir,
    load_plan_toml,
    parse_vllm_log,
    plan_from_records,
    read_records,
)
from ckptguard.memory.cli import mem
from ckptguard.memory.plan import PlanInputs, PlanTerm, parse_bytes

FIX = Path(__file__).parent / "fixtures" / "memory"
GiB = 1 << 30


def test_plan_fixture_every_term():
    plan = compute_plan(load_plan_toml(FIX / "plan.toml"))
    terms = {t.name: t for t in plan.terms}
    # 1.1 GiB rounds to 2 GiB, 3 GiB to 4 GiB: (2 + 2 + 4) x 8 ranks.
    assert terms["pinned optimizer offload"].bytes == 64 * GiB
    assert "nominal" in terms["pinned optimizer offload"].detail
    assert terms["D2H staging"].bytes == 8 * 8 * GiB  # 5 GiB pinned -> 8 GiB, x 8
    assert terms["page cache of new checkpoint files"].bytes == 60 * GiB
    assert terms["serving backup (sleep level 1)"].bytes == 8 * 16 * GiB
    assert terms["floor: ray driver"].bytes == 12 * GiB and terms["floor: ray driver"].measured
    assert terms["floor: raylet + gcs"].bytes == 4 * GiB and not terms["floor: raylet + gcs"].measured
    assert plan.peak == (64 + 64 + 60 + 128 + 12 + 4) * GiB
    assert plan.limit_base_name == "memory.max" and plan.limit == int(480 * GiB * 0.95)
    assert plan.headroom == plan.limit - plan.peak
    assert plan.verdict is Verdict.FITS  # 124 GiB left of 456 GiB: above the 10% tight margin

def test_plan_verdicts_and_limits():
    t = (PlanTerm("x", 90 * GiB, False, ""),)
    assert compute_plan(PlanInputs(terms=t, memory_max=100 * GiB)).verdict is Verdict.TIGHT
    assert compute_plan(PlanInputs(terms=t, memory_max=200 * GiB)).verdict is Verdict.FITS
    over = compute_plan(PlanInputs(terms=t, mem_total=90 * GiB))
    assert over.verdict is Verdict.EXCEEDS and over.limit_base_name == "MemTotal" and over.headroom < 0
    none = compute_plan(PlanInputs(terms=t))
    assert none.verdict is None and "no limit" in none.notes[0]
    sampled = compute_plan(PlanInputs(terms=t, memory_max=200 * GiB, sampled_peak=150 * GiB))
    assert sampled.peak == 150 * GiB and sampled.notes


def test_parse_bytes_and_bad_plans(tmp_path):
    assert parse_bytes("1.5 GiB", "w") == 3 * GiB // 2 and parse_bytes("2GB", "w") == 2 * 10**9
    with pytest.raises(ConfigError, match="staging"):
        bad = tmp_path / "bad.toml"
        bad.write_text('[staging]\nbytes_per_rank = "lots"\n')
        load_plan_toml(bad)
    with pytest.raises(ConfigError, match="ranks"):
        bad.write_text("[staging]\nranks = 0\nbytes_per_rank = 1\n")
        load_plan_toml(bad)


def test_plan_from_records_of_a_real_save_phase(tmp_path):
    path = tmp_path / "mem.jsonl"
    with PhaseRecorder(RecorderConfig(path=path)) as rec, rec.phase(PhaseKind.SAVE, step=7):
        (tmp_path / "shard.bin").write_bytes(b"\x00" * (8 << 20))  # new file: page cache
    recs = read_records([path])
    inputs = plan_from_records(recs)
    plan = compute_plan(inputs)
    names = [t.name for t in plan.terms]
    assert names == ["pinned and shared memory (shmem)", "page cache of new checkpoint files",
                     "anonymous memory (other processes' floors, pageable staging)"]
    end = recs[-1]["host"]
    assert plan.terms[0].bytes == end["shmem"] and plan.terms[2].bytes == end["anon"]
    assert all(t.measured for t in plan.terms) and plan.limit_measured
    assert plan.sampled_peak == recs[-1]["peak"]["host_current"]
    assert plan.limit is not None and plan.verdict is not None
    # With a PLAN.toml as well: its (estimated) terms, limit from the TOML where given.
    both = compute_plan(plan_from_records(recs, load_plan_toml(FIX / "plan.toml")))
    assert both.limit_base == 480 * GiB and len(both.terms) == 6
    r = CliRunner().invoke(mem, ["plan", "--from-records", str(path)])
    assert r.exit_code in (0, 1) and "measured" in r.output and "headroom" in r.output
    with pytest.raises(ConfigError, match="no completed save"):
        plan_from_records([r for r in recs if r["kind"] == "phase_start"])


def test_plan_cli_prints_every_term_and_fails_on_exceeds(tmp_path):
    r = CliRunner().invoke(mem, ["plan", str(FIX / "plan.toml")])
    assert r.exit_code == 0, r.output
    for name in ("pinned optimizer offload", "D2H staging", "page cache", "serving backup", "floor: ray driver",
                 "estimated", "measured", "memory.max", "headroom", "verdict"):
        assert name in r.output
    small = tmp_path / "small.toml"
    small.write_text('[limit]\nmem_total = "100 GiB"\n[page_cache]\nbytes = "99 GiB"\n')
    r = CliRunner().invoke(mem, ["plan", "--json", str(small)])
    assert r.exit_code == 1 and json.loads(r.output)["verdict"] == "exceeds"
    assert CliRunner().invoke(mem, ["plan"]).exit_code == 2


def _write_safetensors(path: Path, tensors: dict, pad: int = 0) -> None:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    bits = {"BF16": 16, "F32": 32, "F8_E4M3": 8, "F4": 4}
    for name, (dtype, shape) in tensors.items():
        n = 1
        for d in shape:
            n *= d
        size = -(-n * bits[dtype] // 8)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\x00" * (offset + pad))


def test_estimate_from_headers_only(tmp_path):
    _write_safetensors(tmp_path / "model-00001.safetensors", {"a": ("BF16", (1024, 512)), "b": ("F32", (100,))})
    (tmp_path / "sub").mkdir()
    _write_safetensors(tmp_path / "sub" / "model-00002.safetensors", {"c": ("F8_E4M3", (4096, 256)),
                                                                      "d": ("F4", (33,))})
    est = estimate_dir(tmp_path, as_dtype="BF16")
    assert est.files == 2 and est.tensors == 4
    assert est.bytes_by_dtype == {"BF16": 1024 * 512 * 2, "F32": 400, "F8_E4M3": 4096 * 256, "F4": 17}
    assert est.total_bytes == sum(est.bytes_by_dtype.values())
    assert est.expanded_bytes == (1024 * 512 + 100 + 4096 * 256 + 33) * 2
    r = CliRunner().invoke(mem, ["estimate", "--json", str(tmp_path)])
    assert r.exit_code == 0 and json.loads(r.output)["total_bytes"] == est.total_bytes
    assert "BF16" in CliRunner().invoke(mem, ["estimate", str(tmp_path)]).output


def test_estimate_matches_the_safetensors_library(tmp_path):
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("safetensors.torch", reason="cross-check only; the estimate needs no safetensors")
    st.save_file({"w": torch.zeros(300, 7, dtype=torch.bfloat16), "b": torch.zeros(5)}, str(tmp_path / "m.safetensors"))
    est = estimate_dir(tmp_path)
    assert est.bytes_by_dtype == {"BF16": 300 * 7 * 2, "F32": 20}


def test_estimate_refuses_corrupt_headers(tmp_path):
    _write_safetensors(tmp_path / "x.safetensors", {"a": ("BF16", (8,))}, pad=3)  # trailing junk
    with pytest.raises(CheckpointCorruptError, match="file has"):
        estimate_dir(tmp_path)
    (tmp_path / "x.safetensors").write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(CheckpointCorruptError, match="100 MB"):
        estimate_dir(tmp_path)
    with pytest.raises(ConfigError, match="not a directory"):
        estimate_dir(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"no \*\.safetensors"):
        estimate_dir(tmp_path / "empty")


def test_vllm_log_says_what_vllm_got():
    s = parse_vllm_log((FIX / "vllm_startup.log").read_text())
    assert s.gpu_memory_utilization == 0.65
    assert s.kv_cache_bytes == round(61.37 * GiB) and s.kv_cache_tokens == 1_149_104
    assert s.max_concurrency == 35.07 and s.weights_bytes == round(14.25 * GiB)
    assert s.sleep_freed_bytes == round(75.62 * GiB) and s.sleep_still_in_use_bytes == round(3.12 * GiB)
    assert s.free_at_startup_bytes == round(88.10 * GiB) and s.requested_bytes == round(90.88 * GiB)
    assert [(e.kind.value, e.line_no) for e in s.errors] == [("free_memory_at_startup", 8)]
    r = CliRunner().invoke(mem, ["vllm-log", str(FIX / "vllm_startup.log")])
    assert r.exit_code == 1 and "free_memory_at_startup" in r.output
    empty = parse_vllm_log("INFO nothing here")
    assert empty.kv_cache_bytes is None and empty.errors == []


def test_recipe_gpu_memory_utilization_per_mode(tmp_path):
    good = {"modes": {"fsdp2": {"rollout": {"gpu_memory_utilization": 0.65}},
                      "dist_opt": {"gpu_memory_utilization": 0.55}}}
    assert check_recipe(good) == []
    glob = {"rollout": {"gpu_memory_utilization": 0.6}, "modes": {"fsdp2": {"x": 1}}}
    found = {(f.path, f.severity.value) for f in check_recipe(glob)}
    assert ("rollout.gpu_memory_utilization", "error") in found and ("modes.fsdp2", "error") in found
    assert any("per training mode" in f.message for f in check_recipe({"gpu_memory_utilization": 0.9}))
    bad = check_recipe({"modes": {"a": {"gpu_memory_utilization": 1.5}}})
    assert bad and "(0, 1]" in bad[0].message
    recipe = tmp_path / "recipe.toml"
    recipe.write_text("[modes.fsdp2]\ngpu_memory_utilization = 0.65\n[modes.megatron]\ngpu_memory_utilization = 0.45\n")
    assert CliRunner().invoke(mem, ["recipe", str(recipe)]).exit_code == 0
    recipe.write_text("gpu_memory_utilization = 0.9\n")
    assert CliRunner().invoke(mem, ["recipe", str(recipe)]).exit_code == 1
