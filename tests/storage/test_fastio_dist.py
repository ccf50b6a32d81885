"""StreamingStorage on 2 gloo ranks with FSDP2 DTensor state: bitwise round trip through our
reader and plain dcp.load, dedup of a replicated tensor, and resharding reads (2 ranks ->
1 process, 1 process -> 2 ranks) that narrow saved chunks in bounded blocks."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from ckptguard._disk.digest import digest, file_digest
from ckptguard.demo.toyjob import build_job, train_step
from ckptguard.storage.base import StorageContext
from ckptguard.storage.streaming import StreamingConfig, StreamingStorage
from ckptguard.testing import run_ranks, values

# Small buffers so every parameter shard is cut into several pieces and blocks.
CFG = StreamingConfig(pool_bytes=4 * 4096, buffer_bytes=4096)


def _model_sd(job) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(job.model)


def _local_digests(sd: dict[str, torch.Tensor]) -> dict[str, str]:
    return {k: digest(v) for k, v in sd.items()}


def _plain_load(sd: dict[str, torch.Tensor], path: str, **kw) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=path, **kw)


def _worker(rank: int, world: int, root: str, single: str) -> dict:
    import torch.distributed as dist

    ctx = StorageContext(rank=rank, world_size=world, process_group=dist.group.WORLD)
    storage = StreamingStorage(CFG)
    job = build_job(rank=rank, world=world)
    train_step(job)
    sd = {**_model_sd(job), "shared": torch.arange(6.0)}  # replicated: DCP stores it once
    files = storage.write(Path(root), sd, ctx)
    checks = [file_digest(str(Path(root) / Path(f.path).name)) == (f.size, f.xxh3) for f in files]

    ours = {**_model_sd(build_job(rank=rank, world=world, seed=7)), "shared": torch.zeros(6)}
    storage.read(Path(root), ours, ctx)
    plain = {**_model_sd(build_job(rank=rank, world=world, seed=9)), "shared": torch.zeros(6)}
    _plain_load(plain, root)

    # A checkpoint of one process, read into this rank's shards: boxes cut out of whole tensors.
    from_single = _model_sd(build_job(rank=rank, world=world, seed=11))
    storage.read(Path(single), from_single, ctx)
    from_single_plain = _model_sd(build_job(rank=rank, world=world, seed=12))
    _plain_load(from_single_plain, single)
    return {
        "files": [f.path for f in files],
        "checks": checks,
        "saved": _local_digests(sd),
        "ours": _local_digests(ours),
        "plain": _local_digests(plain),
        "single_ours": _local_digests(from_single),
        "single_plain": _local_digests(from_single_plain),
    }


def test_two_rank_fsdp2_roundtrip_and_resharding(tmp_path):
    ctx = StorageContext(rank=0, world_size=1, process_group=None)
    single = tmp_path / "single"
    single.mkdir()
    one = build_job(seed=3)
    train_step(one)
    StreamingStorage(CFG).write(single, _model_sd(one), ctx)

    root = tmp_path / "two"
    root.mkdir()
    out = values(run_ranks(_worker, 2, str(root), str(single)))
    assert out[0]["files"] == ["state/.metadata", "state/__0_0.distcp"]
    assert out[1]["files"] == ["state/__1_0.distcp"]
    for r in out:
        assert all(r["checks"])
        assert r["ours"] == r["saved"] == r["plain"]
        assert r["single_ours"] == r["single_plain"]
    assert out[0]["saved"] != out[1]["saved"]  # different shards: the comparison was not trivial

    md = StreamingStorage().read_metadata(root)
    shared = [k for k in md.storage_data if k.fqn == "shared"]
    assert len(shared) == 1  # deduplicated as dcp.save does

    # Both ranks' chunks into one process's whole tensors, ours vs plain DCP.
    ours = _model_sd(build_job(seed=5))
    StreamingStorage(CFG).read(root, ours, ctx)
    plain = _model_sd(build_job(seed=6))
    _plain_load(plain, str(root), no_dist=True)
    assert _local_digests(ours) == _local_digests(plain)
    assert _local_digests(ours) != _local_digests(_model_sd(build_job(seed=5)))
