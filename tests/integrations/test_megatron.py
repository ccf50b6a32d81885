"""ckptguard.integrations.megatron on the real, pinned megatron-core (0.16.1) on the CPU.

Megatron-core's writer and its DistributedOptimizer need CUDA, so the suite takes what the CPU
allows: the sharded state dict of a real GPTModel, Megatron's files of a checkpoint written and
committed on an H200 (tests/fixtures/megatron, by ``benchmarks/megatron_h200.py fixture``) checked,
restored through Megatron's own ``dist_checkpointing.load`` and compared shard by shard, torn and
tampered copies of it refused, and the error a CPU save gets. The kill campaign is the H200's
(benchmarks/results/megatron_h200.md).
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptguard as cg
from ckptguard import StateOptions, StorageOptions
from ckptguard import testing as cgt
from ckptguard.errors import (
    CheckpointCorruptError,
    CheckpointIncompleteError,
    UnsafeCheckpointError,
)
from ckptguard.integrations import megatron as mg  # imports no megatron: check_files needs none
from ckptguard.storage.unpickler import read_dcp_metadata

# Only the tests that build a model or call Megatron's load need megatron-core (imported by the rank
# process).
needs_megatron = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None,
    reason="megatron-core not installed: `make venv` installs it with the dev extra "
    "(megatron-core==0.16.1, psutil)",
)

FIXTURE = Path(__file__).parents[1] / "fixtures" / "megatron"
OPT_ROOT = (
    FIXTURE / "megatron_root"
)  # model + DistributedOptimizer, bf16, step 4 (written on an H200)
MODEL_ROOT = FIXTURE / "megatron_model_only"  # the same model alone, step 4
MEGATRON_DIR = OPT_ROOT / "iter_0000004" / "megatron"
SIZE = {
    "layers": 1,
    "hidden": 32,
    "heads": 4,
    "vocab": 64,
}  # benchmarks/megatron_h200.py fixture --size
SEQ = 64


def _copy(root: Path, tmp: Path) -> Path:
    dst = tmp / root.name
    shutil.copytree(root, dst)
    return dst


# ---------------------------------------------------------------- Megatron's files, checked (no
# process group)


def test_check_files_reads_the_gpu_written_checkpoint() -> None:
    found = mg.check_files(MEGATRON_DIR)
    assert found.backend == "torch_dist"
    assert set(found.data_files) == {"__0_0.distcp", "__0_1.distcp"}
    for name, need in found.data_files.items():
        assert 0 < need <= (MEGATRON_DIR / name).stat().st_size
    assert found.keys > 0 and "optimizer" in found.common_keys


def test_metadata_with_save_plans_is_allowed_exactly(tmp_path: Path) -> None:
    """megatron-core under torch 2.13 adds every rank's save plan to ``.metadata``
    (``all_local_plans``; the H200's torch 2.11 file has none): read with ``METADATA_EXTRA``,
    nothing else let through."""
    import collections

    from torch.distributed.checkpoint.planner import SavePlan

    d = tmp_path / "m"
    shutil.copytree(MEGATRON_DIR, d)
    md = read_dcp_metadata(d)
    md.all_local_plans = [SavePlan(items=[])]  # type: ignore[attr-defined]
    (d / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(UnsafeCheckpointError, match="SavePlan"):
        read_dcp_metadata(d)  # the default allow-list: plain DCP never writes a SavePlan
    assert mg.check_files(d).backend == "torch_dist"
    md.all_local_plans = [collections.Counter()]  # type: ignore[attr-defined]
    (d / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(UnsafeCheckpointError, match="Counter"):
        mg.check_files(d)


@pytest.mark.parametrize(
    ("damage", "error", "names"),
    [
        ("short_data", CheckpointIncompleteError, "__0_1.distcp"),
        ("no_config", CheckpointIncompleteError, "metadata.json"),
        ("no_metadata", CheckpointIncompleteError, ".metadata"),
        ("no_common", CheckpointIncompleteError, "common.pt"),
        ("link_data", UnsafeCheckpointError, "__0_0.distcp"),
        ("other_backend", CheckpointCorruptError, "zarr"),
        ("code_in_common", UnsafeCheckpointError, "common.pt"),
    ],
)
def test_check_files_refuses_torn_and_tampered_files(
    tmp_path: Path, damage: str, error: type, names: str
) -> None:
    d = tmp_path / "m"
    shutil.copytree(MEGATRON_DIR, d)
    marker = tmp_path / "ran"
    if damage == "short_data":
        with open(d / "__0_1.distcp", "r+b") as f:
            f.truncate((d / "__0_1.distcp").stat().st_size - 1)
    elif damage == "no_config":
        (d / "metadata.json").unlink()
    elif damage == "no_metadata":
        (d / ".metadata").unlink()
    elif damage == "no_common":
        (d / "common.pt").unlink()
    elif damage == "link_data":
        real = tmp_path / "elsewhere.distcp"
        shutil.move(d / "__0_0.distcp", real)
        (d / "__0_0.distcp").symlink_to(real)
    elif damage == "other_backend":
        cfg = json.loads((d / "metadata.json").read_text())
        (d / "metadata.json").write_text(json.dumps({**cfg, "sharded_backend": "zarr"}))
    elif damage == "code_in_common":

        class Boom:
            def __reduce__(self) -> Any:
                return (os.system, (f"touch {marker}",))

        torch.save({"optimizer": Boom()}, d / "common.pt")
    with pytest.raises(error, match=names.replace(".", r"\.")):
        mg.check_files(d)
    assert not marker.exists()  # nothing in common.pt ran


def test_torn_megatron_save_is_never_picked_as_latest(tmp_path: Path) -> None:
    """What a kill inside Megatron's writer leaves (an in-flight directory: a torn data file, no
    .metadata, no metadata.json) and what a kill before the tracker leaves (a published step newer
    than the tracker)."""
    root = _copy(OPT_ROOT, tmp_path)
    step4 = root / "iter_0000004"
    torn = root / ".tmp-iter_0000006-deadbeef" / "megatron"
    torn.mkdir(parents=True)
    shutil.copy(step4 / "megatron" / "common.pt", torn)
    (torn / "__0_0.distcp").write_bytes((step4 / "megatron" / "__0_0.distcp").read_bytes()[:1000])
    with pytest.raises(CheckpointIncompleteError):
        mg.check_files(torn)
    orphan = root / "iter_0000008"
    shutil.copytree(step4, orphan)  # complete files, manifest of step 4: never committed as step 8
    mgr = cg.CheckpointManager(
        root, config=cg.CheckpointConfig(storage=StorageOptions(dir_template=mg.DIR_TEMPLATE))
    )
    res = mgr.resolve()
    assert (res.step, res.path) == (4, step4)
    assert mgr.committed_steps() == [4]


def test_ckptguard_verify_checks_megatron_files_by_checksum(tmp_path: Path) -> None:
    import subprocess
    import sys

    root = _copy(OPT_ROOT, tmp_path)
    cmd = [
        sys.executable,
        "-m",
        "ckptguard.cli",
        "verify",
        "--deep",
        "--json",
        "--template",
        mg.DIR_TEMPLATE,
        str(root),
    ]
    ok = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    data = root / "iter_0000004" / "megatron" / "__0_1.distcp"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 1
    data.write_bytes(bytes(raw))
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode == 1 and "megatron/__0_1.distcp" in bad.stdout


# ---------------------------------------------------------------- one CPU rank: a real GPTModel,
# Megatron's load


def _gpt(hidden: int = SIZE["hidden"]) -> Any:
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    cfg = TransformerConfig(
        num_layers=SIZE["layers"],
        hidden_size=hidden,
        num_attention_heads=SIZE["heads"],
        use_cpu_initialization=True,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
    )
    gpt = GPTModel(
        config=cfg,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=SIZE["vocab"],
        max_sequence_length=SEQ,
    )
    return Float16Module(cfg, gpt)  # as the H200 run built it: a wrapper the integration unwraps


class Position:
    """The fixture's data iterator item (benchmarks/megatron_h200.py Batches): its state is the
    position."""

    def __init__(self) -> None:
        self.position = -1

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.position = int(sd["position"])


def _cpu_rank(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Everything the suite does on one gloo rank (one Megatron import and model-parallel setup)."""
    from megatron.core import dist_checkpointing

    from ckptguard._state.state import check_weights_only

    out: dict[str, Any] = {}
    model = _gpt()
    inner = model.module
    st = mg.MegatronState(model)
    sd = st.sharded_state_dict()
    out["sd_keys"] = sorted(sd["model"])
    out["module_keys"] = sorted(inner.state_dict())
    out["param_names"] = sorted(n for n, _ in inner.named_parameters())
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    out["n_sharded"] = sum(isinstance(v, ShardedBase) for v in sd["model"].values())
    saved = st.state_dict()
    check_weights_only(
        saved, "megatron item"
    )  # raises if torch.load(weights_only=True) could not read it
    out["shards"] = len(saved["shards"])

    # A save on the CPU: Megatron's writer calls CUDA; the error names the call, nothing is
    # committed.
    root = Path(tmp) / "cpu_save"
    ck = mg.MegatronCheckpoint(root, model)
    try:
        ck.save(1)
        out["save_error"] = None
    except Exception as exc:
        out["save_error"] = (type(exc).__name__, str(exc))
    out["save_committed"] = ck.manager.committed_steps()
    out["save_tracker"] = (root / "latest_checkpointed_iteration.txt").read_text().strip()

    # Megatron's synchronous writer must not run in a background commit (it runs the group's
    # collectives).
    try:
        ck.manager.save_async(2, {"megatron": ck.megatron}).wait()
        out["bg_error"] = None
    except Exception as exc:
        out["bg_error"] = (type(exc).__name__, str(exc))
    # Megatron's async save on the CPU: its error names the CUDA call; nothing is committed.
    try:
        ck.save_async(3)
        ck.wait()
        out["async_error"] = None
    except Exception as exc:
        out["async_error"] = (type(exc).__name__, str(exc))
    out["async_committed"] = ck.manager.committed_steps()

    # The H200's checkpoint restored on the CPU through Megatron's own load: every shard equal.
    # its CUDA RNG needs a GPU
    cfg = cg.CheckpointConfig(
        storage=StorageOptions(dir_template=mg.DIR_TEMPLATE), state=StateOptions(restore_rng=False)
    )
    fresh = _gpt()
    ck = mg.MegatronCheckpoint(Path(tmp) / "model_only", fresh, config=cfg)
    state = {"data": Position()}
    out["restored_step"] = ck.restore(state)
    out["restored_position"] = state["data"].position
    out["restored_shards"] = ck.megatron.shard_digests()
    proof = Path(tmp) / "model_only" / "proof" / "rank_00000.jsonl"
    records = [json.loads(x) for x in proof.read_text().splitlines()]
    out["restore_record"] = next(r for r in reversed(records) if r["event"] == "restore")

    # Negative control: a load that leaves one shard changed is caught by the shard digests.
    real_load = dist_checkpointing.load

    def lossy(sharded: Any, directory: str, **kw: Any) -> Any:
        loaded = real_load(sharded, directory, **kw)
        loaded["model"]["embedding.word_embeddings.weight"].add_(1)
        return loaded

    dist_checkpointing.load = lossy
    try:
        mg.MegatronCheckpoint(Path(tmp) / "model_only", _gpt(), config=cfg).restore(
            {"data": Position()}
        )
        out["lossy_error"] = None
    except Exception as exc:
        out["lossy_error"] = (type(exc).__name__, str(exc))
    finally:
        dist_checkpointing.load = real_load

    # A byte of Megatron's data changed after the commit: refused before Megatron reads it.
    data = Path(tmp) / "model_only" / "iter_0000004" / "megatron" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    try:
        mg.MegatronCheckpoint(Path(tmp) / "model_only", _gpt(), config=cfg).restore(
            {"data": Position()}
        )
        out["flipped_error"] = None
    except Exception as exc:
        out["flipped_error"] = (type(exc).__name__, str(exc))
    return out


@pytest.fixture(scope="module")
def cpu(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("megatron")
    _copy(MODEL_ROOT, tmp).rename(tmp / "model_only")
    (value,) = cgt.values(cgt.run_ranks(_cpu_rank, 1, str(tmp), timeout=240))
    return value


@needs_megatron
def test_sharded_state_dict_of_a_wrapped_gpt_names_every_parameter(cpu: dict[str, Any]) -> None:
    # Float16Module unwrapped: the keys are the GPT's own (a wrapper would prefix 'module.')
    assert set(cpu["param_names"]) <= set(cpu["sd_keys"]) <= set(cpu["module_keys"])
    assert cpu["shards"] == cpu["n_sharded"] + 1  # one digest a shard, plus the non-sharded values


@needs_megatron
def test_save_on_the_cpu_names_the_cuda_call_and_commits_nothing(cpu: dict[str, Any]) -> None:
    kind, message = cpu["save_error"]
    assert kind == "CheckpointWriteError"
    assert "filesystem_async.py" in message and "torch.cuda.synchronize()" in message
    assert "cannot run without CUDA" in message and "GPU" in message
    assert cpu["save_committed"] == [] and cpu["save_tracker"] == "0"


@needs_megatron
def test_megatrons_writer_never_runs_in_a_background_commit_and_async_names_cuda(
    cpu: dict[str, Any],
) -> None:
    kind, message = cpu["bg_error"]
    assert "use MegatronCheckpoint.save_async, not manager.save_async" in message, (kind, message)
    kind, message = cpu["async_error"]
    assert kind == "CheckpointWriteError" or "CUDA" in message or "cuda" in message, (kind, message)
    assert cpu["async_committed"] == []


@needs_megatron
def test_gpu_checkpoint_restores_on_the_cpu_shard_by_shard(cpu: dict[str, Any]) -> None:
    assert cpu["restored_step"] == 4
    assert cpu["restored_position"] == 4  # the data iterator position, from ckptguard's extras
    assert len(cpu["restored_shards"]) == cpu["shards"]
    record = cpu["restore_record"]
    assert record["ok"] is True and record["digests_match"]["megatron"] is True


@needs_megatron
def test_a_load_that_changes_a_shard_is_refused(cpu: dict[str, Any]) -> None:
    kind, message = cpu["lossy_error"]
    assert kind == "StateMismatchError"
    assert "embedding.word_embeddings.weight" in message


@needs_megatron
def test_a_changed_megatron_file_is_refused_before_megatron_reads_it(cpu: dict[str, Any]) -> None:
    kind, message = cpu["flipped_error"]
    assert kind == "CheckpointCorruptError"
    assert "__0_0.distcp" in message and "xxh3" in message


def test_object_leaves_name_the_hyperparameter_a_load_changed() -> None:
    # What the restore's error names when a ShardedObject (the DistributedOptimizer's param_groups)
    # differs.
    saved = {
        "optimizer": {
            "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "step": 5.0, "wd_mult": 1.0}]
        },
        "grad_scaler": None,
        "big": torch.arange(4.0),
    }
    loaded = {
        "optimizer": {
            "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "step": 1, "wd_mult": 1.0}]
        },
        "big": torch.arange(4.0),
    }
    a, b = mg.object_leaves(saved), mg.object_leaves(loaded)
    assert a["optimizer.param_groups.0.betas"] == "tuple:(0.9, 0.95)"
    assert a["big"].startswith("Tensor[torch.float32,(4,)]|")
    assert mg.leaf_differences(a, b) == [
        "grad_scaler saved NoneType:None, now (absent)",
        "optimizer.param_groups.0.step saved float:5.0, now int:1",
    ]
    assert mg.leaf_differences(a, mg.object_leaves(saved)) == []


def test_adam_steps_lost_in_megatrons_load_are_put_back_one_tensor_each(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # megatron-core 0.16's torch fallback: its load leaves one shared step tensor holding the
    # loading template's step (seen on the H200: saved 5.0, loaded 1.0). The saved step comes back,
    # a tensor each.
    params = [torch.nn.Parameter(torch.ones(3)) for _ in range(3)]
    inner = torch.optim.AdamW(params, lr=0.1)
    for p in params:
        p.grad = torch.ones(3)
    inner.step()
    shared = torch.tensor(1.0)
    for st in inner.state.values():
        st["step"] = shared

    # what the integration reads of a DistributedOptimizer: its inner torch optimizer
    class Distributed:
        optimizer = inner

    state = object.__new__(mg.MegatronState)
    state.optimizer = Distributed()
    with caplog.at_level("WARNING", logger="ckptguard"):
        state._restore_adam_steps(
            {"optimizer": {"param_groups": [{"step": 5.0}, {"step": 5.0}]}}, Path("/x")
        )
    steps = [st["step"] for st in inner.state.values()]
    assert [float(s) for s in steps] == [5.0, 5.0, 5.0] and len({id(s) for s in steps}) == 3
    assert "left Adam's step at [1.0] in 3 of 3" in caplog.text and "shared" in caplog.text
    inner.step()  # each parameter's step advances once, as in a run that never stopped
    assert [float(st["step"]) for st in inner.state.values()] == [6.0, 6.0, 6.0]
    caplog.clear()
    state._restore_adam_steps({"optimizer": {"param_groups": [{"step": 6.0}]}}, Path("/x"))
    assert caplog.text == ""  # right already: untouched
