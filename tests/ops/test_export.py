"""`ckptguard export`: a committed step to HF safetensors, every tensor checked as read and as
written.

The transformers round trips (a 2-rank FSDP2 Llama, a 4-rank expert-parallel Mixtral, each loaded by
from_pretrained and compared with the trainer's logits) run tests/export_job.py in .venv-hf."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from test_hf_integration import HF_PYTHON, REPO, _env, needs_hf

import ckptguard as cg
from ckptguard.cli import main
from ckptguard.ops import export as ex
from ckptguard.testing import run_ranks, set_fault_hook, values

JOB = REPO / "tests" / "export_job.py"


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 64), torch.nn.Linear(64, 32)
    )


@pytest.fixture(scope="module")
def step(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    root = tmp_path_factory.mktemp("export") / "ck"
    model = _model()
    cg.CheckpointManager(root).save(
        4, {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}
    )
    return root, model


def _copy_step(root: Path, tmp: Path) -> Path:
    import shutil

    shutil.copytree(root, tmp / "ck")
    return tmp / "ck"


def _load(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = json.loads((out / ex.INDEX_NAME).read_text())
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(str(out / file)))
    assert set(tensors) == set(index["weight_map"])
    return tensors


def _budget_for(planned: list[ex.Planned], shard: int) -> int:
    """The smallest budget (to 4 kB) whose output files hold at least ``shard`` bytes of tensors."""
    for b in range(56 << 20, 64 << 20, 4096):
        try:
            if ex.Budget.of(b, planned).shard >= shard:
                return b
        except cg.ConfigError:
            continue
    raise AssertionError("no budget found")


def _flip(path: Path, at: int, bit: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 1 << bit
    path.write_bytes(bytes(data))


def _offset_of(path: Path, t: torch.Tensor) -> int:
    at = path.read_bytes().find(t.detach().contiguous().numpy().tobytes())
    assert at > 0
    return at


# ---------------------------------------------------------------- one process


def test_export_is_bitwise_and_sharded_within_the_budget(step, tmp_path):
    root, model = step
    planned = ex.plan_export(root / "step_00000004")
    # the reader's 8 MiB pool, the slack for what is not a tensor, and about 40 kB of tensors:
    # several files
    budget = _budget_for(planned, 40_000)
    result = ex.export_hf(ex.step_dir_of(root, None), tmp_path / "out", max_host_bytes=budget)
    assert result.step == 4 and result.item == "model" and result.tensors == 6
    got = _load(tmp_path / "out")
    assert {k: torch.equal(v, model.state_dict()[k]) for k, v in got.items()} == dict.fromkeys(
        model.state_dict(), True
    )
    shards = [f for f in result.files if f.endswith(".safetensors")]
    assert len(shards) == 2 and result.peak_tensor_bytes <= result.budget["shard"]
    assert result.budget["pool"] + result.budget["shard"] + result.budget["cast"] <= budget
    manifest = json.loads((tmp_path / "out" / ex.EXPORT_MANIFEST).read_text())
    assert manifest["source"]["step"] == 4 and set(manifest["tensors"]) == set(model.state_dict())
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        [*result.files, ex.EXPORT_MANIFEST]
    )
    assert ex.verify_export(tmp_path / "out", deep=True) == []
    # A budget no tensor fits in is refused before anything is read or created, naming what it
    # needs.
    with pytest.raises(cg.ConfigError, match=r"'0.weight'.*pass --max-host-bytes \d+"):
        ex.export_hf(ex.step_dir_of(root, 4), tmp_path / "small", max_host_bytes=56 << 20)
    assert not (tmp_path / "small").exists()


def test_cast_is_the_rounding_of_the_checked_bytes(step, tmp_path):
    root, model = step
    result = ex.export_hf(ex.step_dir_of(root, 4), tmp_path / "bf16", dtype=torch.bfloat16)
    got = _load(tmp_path / "bf16")
    assert all(torch.equal(v, model.state_dict()[k].to(torch.bfloat16)) for k, v in got.items())
    manifest = json.loads((tmp_path / "bf16" / ex.EXPORT_MANIFEST).read_text())
    assert result.dtype == "bfloat16" and manifest["tensors"]["0.weight"]["cast_from"] == "float32"


def test_a_flipped_byte_in_a_step_shard_is_caught_before_publishing(step, tmp_path):
    """Negative control of the read check, under a cast that would hide it: the lowest mantissa bit
    of one fp32 weight, which rounding to bf16 drops."""
    root, model = step
    ck = _copy_step(root, tmp_path)
    shard = ck / "step_00000004" / "state" / "__0_0.distcp"
    _flip(shard, _offset_of(shard, model[2].weight) + 4 * 37)
    for dtype in (None, torch.bfloat16):
        out = tmp_path / f"out-{dtype}"
        with pytest.raises(
            cg.CheckpointCorruptError, match=r"key 'model.2.weight' of step 4.*verify --deep"
        ):
            ex.export_hf(ck / "step_00000004", out, dtype=dtype)
        assert not out.exists()
    assert not list(tmp_path.glob(".out-*"))  # the failed export removed its own temp directory


def test_a_byte_flipped_in_a_written_file_is_caught_before_publishing(step, tmp_path):
    root = step[0]

    def damage() -> None:
        (shard,) = tmp_path.glob(".out.tmp-export-*/model-00001-of-*.safetensors")
        _flip(shard, shard.stat().st_size - 3)

    set_fault_hook("export.shard_written", damage)
    try:
        with pytest.raises(cg.CheckpointCorruptError, match="reads back from the written file"):
            ex.export_hf(ex.step_dir_of(root, 4), tmp_path / "out")
    finally:
        set_fault_hook("export.shard_written", None)
    assert not (tmp_path / "out").exists()


_KILLED = """
import sys
from pathlib import Path
from ckptguard.ops import export as ex
from ckptguard.testing import kill_at
kill_at(sys.argv[3])
ex.export_hf(Path(sys.argv[1]), Path(sys.argv[2]), max_host_bytes=int(sys.argv[4]))
"""


@pytest.mark.parametrize("point", ["export.before_manifest"])
def test_a_killed_export_leaves_no_manifest_and_is_swept_by_the_next(step, tmp_path, point):
    root = step[0]
    out = tmp_path / "out"
    planned = ex.plan_export(root / "step_00000004")
    budget = _budget_for(planned, 40_000)
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED, str(root / "step_00000004"), str(out), point, str(budget)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    (left,) = tmp_path.glob(".out.tmp-export-*")
    assert not out.exists() and not (left / ex.EXPORT_MANIFEST).exists()
    assert list(left.glob("*.safetensors"))  # it died mid-export, files written
    runner = CliRunner()
    bad = runner.invoke(main, ["verify", str(left)])
    assert bad.exit_code == 1  # never taken for an export
    done = runner.invoke(main, ["export", str(root), "--hf", str(out), "--json"])
    assert done.exit_code == 0, done.output
    assert not left.exists() and ex.verify_export(out, deep=True) == []


def test_cli_export_and_verify_of_the_export(step, tmp_path):
    root = step[0]
    runner = CliRunner()
    out = tmp_path / "out"
    done = runner.invoke(main, ["export", str(root), "4", "--hf", str(out), "--dtype", "bf16"])
    assert (
        done.exit_code == 0
        and "exported step 4 (model): 6 tensors" in done.output
        and "bfloat16" in done.output
    )
    again = runner.invoke(main, ["export", str(root), "--hf", str(out), "--json"])
    assert again.exit_code == 2 and "never overwrites" in json.loads(again.output)["error"]
    missing = runner.invoke(main, ["export", str(root), "9", "--hf", str(tmp_path / "x")])
    assert missing.exit_code == 1 and "newer than the tracker" in missing.output
    ok = runner.invoke(main, ["verify", str(out), "--deep", "--json"])
    assert ok.exit_code == 0 and json.loads(ok.output)["ok"] is True
    shard = next(out.glob("model-*.safetensors"))
    _flip(shard, shard.stat().st_size - 1)
    assert runner.invoke(main, ["verify", str(out)]).exit_code == 0  # sizes only
    deep = runner.invoke(main, ["verify", str(out), "--deep"])
    assert deep.exit_code == 1 and "checksum" in deep.output and "FAIL" in deep.output


def test_a_step_without_a_model_item_is_refused_naming_why(tmp_path):
    cg.CheckpointManager(tmp_path / "ck").save(1, {"counter": 3})
    result = CliRunner().invoke(
        main, ["export", str(tmp_path / "ck"), "--hf", str(tmp_path / "out")]
    )
    assert (
        result.exit_code == 2
        and "holds no model item" in result.output
        and "Traceback" not in result.output
    )


# ---------------------------------------------------------------- expert parallel, per-expert
# modules


class MoE(torch.nn.Module):
    def __init__(self, ep_rank: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense = torch.nn.Linear(8, 16)
        torch.manual_seed(100 + ep_rank)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))


def _moe_worker(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("ep", "edp"))
    ep = mesh["ep"].get_local_rank()
    model = MoE(ep)
    local = {k: v.clone() for k, v in model.state_dict().items()}
    for expert in model.experts:
        fully_shard(expert, mesh=mesh["edp"])
    fully_shard(model.dense, mesh=init_device_mesh("cpu", (world,)))
    mgr = cg.CheckpointManager(
        root, expert_parallel=cg.ExpertParallel(group=mesh["ep"].get_group())
    )
    mgr.save(1, {"model": model})
    return {"ep": ep, "local": local}


def test_expert_parallel_step_is_numbered_globally(tmp_path):
    ranks = values(run_ranks(_moe_worker, 4, str(tmp_path / "ck")))
    ex.export_hf(ex.step_dir_of(tmp_path / "ck", None), tmp_path / "out")
    got = _load(tmp_path / "out")
    want = {k: v for k, v in ranks[0]["local"].items() if k.startswith("dense")}
    for r in ranks:  # EP rank e's local expert i is global expert 2e + i
        for i in range(2):
            for p in ("weight", "bias"):
                want[f"experts.{2 * r['ep'] + i}.{p}"] = r["local"][f"experts.{i}.{p}"]
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


# ---------------------------------------------------------------- transformers, in .venv-hf


@pytest.fixture(scope="module")
def hf_jobs(tmp_path_factory) -> dict:
    """The transformers round trips in one .venv-hf process (its imports are the expensive part)."""
    work = tmp_path_factory.mktemp("hfexport")
    proc = subprocess.run(
        [str(HF_PYTHON), str(JOB), "all", str(work)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=900,
        cwd=work,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_hf
@pytest.mark.timeout(
    1200
)  # the first test of a module fixture runs the .venv-hf job (slow on a loaded 2-core host)
def test_fsdp2_step_exported_loads_in_transformers_with_the_trainers_logits(hf_jobs):
    out = hf_jobs["fsdp2"]
    assert out["ranks_agree"] and out["sharded_params"] > 0 and out["trainer_logits_nonzero"]
    assert out[
        "fp32_bitwise"
    ]  # from_pretrained(export) gives the FSDP2 trainer's logits bit for bit
    assert out[
        "bf16_equals_rounded"
    ]  # the bf16 export is exactly the trainer's weights rounded to bf16
    assert 0 < out["bf16_max_abs_diff"] < 0.1 and out["bf16_auto_dtype"] == "torch.bfloat16"
    assert (
        "config.json" in out["bf16_copied"] and "model.safetensors.index.json" in out["fp32_files"]
    )


@needs_hf
@pytest.mark.timeout(
    1200
)  # the first test of a module fixture runs the .venv-hf job (slow on a loaded 2-core host)
def test_expert_parallel_step_exported_loads_in_transformers(hf_jobs):
    out = hf_jobs["expert"]
    assert (
        out["ep_ranks"] == [0, 1] and out["bitwise"] and len(out["ep_keys"]) == 8
    )  # stored per EP rank
    assert out["expert_names"] and all("#ep" not in n for n in out["expert_names"])


@needs_hf
@pytest.mark.timeout(1200)
def test_tied_embeddings_export_loads_tied_with_the_trainers_logits(hf_jobs):
    out = hf_jobs["tied"]
    assert out["tied_in_trainer"] and out["tied_after_load"] and out["bitwise"], out
    # the step holds the tied tensor under both names (the model's state_dict does); the export
    # writes both, and from_pretrained ties them again (save_pretrained would omit lm_head.weight:
    # same logits)
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(out["names"])


# ---------------------------------------------------------------- LoRA / PEFT, in .venv-hf

LORA_JOB = REPO / "tests" / "lora_job.py"


@pytest.fixture(scope="module")
def lora_job(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("lora")
    proc = subprocess.run(
        [str(HF_PYTHON), str(LORA_JOB), str(work)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=600,
        cwd=work,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_hf
@pytest.mark.timeout(
    1200
)  # the first test of a module fixture runs the .venv-hf job (slow on a loaded 2-core host)
def test_lora_step_holds_the_adapter_only_and_resumes_bitwise(lora_job):
    assert lora_job["saved_keys"] and all(
        "lora_" in k for k in lora_job["saved_keys"]
    )  # no base weight saved
    assert lora_job["resumed_step"] == 2 and lora_job["resume_bitwise"] and lora_job["cache"]
    # prove shows what the restore was bound to: the base's files and the adapter's digests
    assert "model.safetensors" in lora_job["prove_lora"] and "r=4 alpha=8" in lora_job["prove_lora"]
    assert "8 tensors, digest" in lora_job["prove_lora"]


@needs_hf
@pytest.mark.timeout(
    1200
)  # the first test of a module fixture runs the .venv-hf job (slow on a loaded 2-core host)
def test_lora_restore_refused_on_another_base_config_or_a_merged_base(lora_job):
    assert "base file 'model.safetensors'" in lora_job["other_base"]
    assert "adapter config field 'r': saved 4, now 8" in lora_job["other_config"]
    assert "an adapter was merged into them" in lora_job["merged_in_memory"]


@needs_hf
@pytest.mark.timeout(
    1200
)  # the first test of a module fixture runs the .venv-hf job (slow on a loaded 2-core host)
def test_lora_exported_merged_once_equals_peft_merge(lora_job):
    assert isinstance(lora_job["export"], dict), lora_job["export"]
    assert (
        lora_job["merged_bitwise"]
        and lora_job["merged_logits_bitwise"]
        and lora_job["merged_differs_from_base"]
    )
    assert lora_job["verify_rc"] == 0
    # Negative controls: the delta added twice, and a base folder that already holds the merge.
    assert (
        "2.00 x the adapter's delta" in lora_job["double_merge"]
        and not lora_job["double_merge_published"]
    )
    assert "differs from the base step 2 was trained on" in lora_job["merged_base"]


def test_lora_base_identity_is_cached_by_file_stats_and_hashes(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    from ckptguard.integrations import peft as cpeft

    base, root = tmp_path / "base", tmp_path / "ck"
    base.mkdir()
    root.mkdir()
    save_file({"w": torch.arange(12.0).reshape(3, 4)}, str(base / "model.safetensors"))
    first = cpeft.base_identity(base, cache_dir=root)
    assert set(first["files"]) == {"model.safetensors"} and set(first["tensors"]) == {"w"}

    def no_hashing(*_a, **_k):
        raise AssertionError("hashed again although nothing changed")

    monkeypatch.setattr(cpeft, "file_digest", no_hashing)
    monkeypatch.setattr(cpeft, "read_tensors", no_hashing)
    assert (
        cpeft.base_identity(base, cache_dir=root) == first
    )  # from ROOT/lora_base_cache.json alone
    monkeypatch.undo()
    save_file(
        {"w": torch.arange(12.0).reshape(3, 4) + 1}, str(base / "model.safetensors")
    )  # a new file
    second = cpeft.base_identity(base, cache_dir=root)
    assert second["files"] != first["files"] and second["tensors"]["w"] != first["tensors"]["w"]
