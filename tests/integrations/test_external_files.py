"""Files committed through ExternalFiles are checked (size and xxh3) on restore, on every rank,
before the caller hands the step directory to the framework that wrote them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ckptguard as cg
from ckptguard.integrations.external import ExternalFiles
from ckptguard.testing import run_ranks, values


def _writer(rank: int):
    def write(directory: Path) -> None:
        # rank 0 writes the framework's optimizer file, every rank its own RNG file (as HF under
        # DDP)
        if rank == 0:
            torch.save({"exp_avg": torch.arange(256.0)}, directory / "optimizer.pt")
            (directory / "config.json").write_text('{"n_layer": 1}')
        torch.save({"cpu": torch.arange(8)}, directory / f"rng_state_{rank}.pth")

    return write


def _manager(root: str, rank: int) -> cg.CheckpointManager:
    storage = ExternalFiles(cg.StreamingStorage(), {"hf": _writer(rank)})
    return cg.CheckpointManager(root, config=cg.CheckpointConfig(timeout_s=30), storage=storage)


def _tamper_worker(rank: int, world: int, root: str, how: str) -> dict:
    mgr = _manager(root, rank)
    mgr.save(1, {"meta": cg.PerRank({"rank": rank})})
    dist.barrier()
    target = Path(root) / "step_00000001" / "hf" / "optimizer.pt"
    if rank == 0:
        if how == "flip":
            data = bytearray(target.read_bytes())
            data[len(data) // 2] ^= 0x01
            target.write_bytes(bytes(data))
        elif how == "delete":
            target.unlink()
    dist.barrier()
    state = {"meta": cg.PerRank({})}
    try:
        step = _manager(root, rank).restore(state)
    except cg.CheckpointError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None, "step": step, "meta": state["meta"].value}


def test_untouched_external_files_restore(tmp_path):
    out = values(run_ranks(_tamper_worker, 2, str(tmp_path / "ck"), "none"))
    assert out == [
        {"error": None, "step": 1, "meta": {"rank": 0}},
        {"error": None, "step": 1, "meta": {"rank": 1}},
    ]


@pytest.mark.parametrize(
    ("how", "error", "says"),
    [("flip", "CheckpointCorruptError", "xxh3"), ("delete", "CheckpointIncompleteError", "absent")],
)
def test_changed_external_file_is_refused_on_every_rank_naming_it(tmp_path, how, error, says):
    out = values(run_ranks(_tamper_worker, 2, str(tmp_path / "ck"), how))
    for result in out:
        assert result["error"] == error, result
        assert "hf/optimizer.pt" in result["message"] and says in result["message"]
        assert "step 1" in result["message"]
    # the ranks split the files: the one that found it is named, and both raise its error
    assert len({r["message"].split("(checked on rank ")[1][0] for r in out}) == 1


def test_single_process_flip_names_the_file(tmp_path):
    root = tmp_path / "ck"
    _manager(str(root), 0).save(3, {"meta": cg.PerRank({"n": 1})})
    cfg = root / "step_00000003" / "hf" / "config.json"
    cfg.write_text('{"n_layer": 2}')  # same size, other bytes
    with pytest.raises(cg.CheckpointCorruptError, match=r"hf/config\.json of step 3"):
        _manager(str(root), 0).restore({"meta": cg.PerRank({})})
