"""StreamingStorage with GPU tensors: pinned pool, async D2H/H2D, bitwise via our reader and
plain dcp.load, pool unregistered and unmapped afterwards, failures raised. Needs CUDA."""

from __future__ import annotations

import errno
import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptguard._disk.digest import file_digest
from ckptguard.storage import _pool as _fastio_pool
from ckptguard.storage.base import StorageContext
from ckptguard.storage.streaming import StreamingConfig, StreamingStorage

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CTX = StorageContext(rank=0, world_size=1, process_group=None)
BUF = 61 * 4096
CFG = StreamingConfig(pool_bytes=3 * BUF, buffer_bytes=BUF)


def _pool_mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(
            1
            for line in f
            if (lambda a, b: int(b, 16) - int(a, 16))(*line.split()[0].split("-")) == BUF
        )


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    big = torch.randn(512, 1000, device="cuda", generator=g)
    return {
        "big": big,
        "view": big[7, 10:410],
        "transposed": big.t(),
        "bf16": torch.randn(3000, device="cuda", generator=g).bfloat16(),
        "cpu_too": torch.randn(100),
    }


def test_gpu_roundtrip_is_bitwise_and_leaves_nothing_pinned(tmp_path):
    state = _state()
    storage = StreamingStorage(CFG)
    storage.write(tmp_path / "warm", {"w": torch.ones(3, device="cuda")}, CTX)
    before = _pool_mappings()
    files = storage.write(tmp_path, state, CTX)
    assert storage.last_stats.pool_bytes == 3 * BUF
    assert _pool_mappings() == before
    for f in files:
        assert file_digest(str(tmp_path / os.path.basename(f.path))) == (f.size, f.xxh3)

    ours = {k: torch.zeros_like(v) for k, v in state.items()}
    storage.read(tmp_path, ours, CTX)
    assert _pool_mappings() == before
    plain = {k: torch.zeros_like(v) for k, v in state.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(plain, checkpoint_id=str(tmp_path), no_dist=True)
    for key, want in state.items():
        assert ours[key].device == want.device and torch.equal(ours[key], want), key
        assert torch.equal(plain[key], want), key


def test_gpu_write_failure_raises_with_offset_and_releases_the_pool(tmp_path, monkeypatch):
    real = os.write
    budget = {"left": 500_000}

    def stuck(fd, data):
        n = min(len(data), budget["left"])
        if n <= 0:
            return 0
        budget["left"] -= n
        return real(fd, data[:n])

    monkeypatch.setattr(_fastio_pool, "_write", stuck)
    before = _pool_mappings()
    with pytest.raises(OSError) as info:
        StreamingStorage(CFG).write(tmp_path, {"a": torch.randn(1 << 20, device="cuda")}, CTX)
    assert info.value.errno == errno.EIO and info.value.offset == 500_000
    assert _pool_mappings() == before
