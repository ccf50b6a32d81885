"""GPU checks of the core (marked gpu; skipped without CUDA): digests of device tensors,
and a manager round trip of GPU state with the RNG of every device."""

from __future__ import annotations

import pytest
import torch

import ckptguard as cg
from ckptguard._resume.digest import digest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(autouse=True)
def _empty_pinned_cache():
    yield
    torch.cuda.synchronize()
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    if empty is not None:
        empty()  # digest() stages through pinned chunks; other GPU tests count pinned mappings


def test_gpu_digest_equals_cpu_digest():
    torch.manual_seed(0)
    for n in (0, 7, (64 << 20) // 4 + 3, (200 << 20) // 4):  # empty, tiny, just over a chunk, several chunks
        t = torch.randn(n, device="cuda")
        assert digest(t) == digest(t.cpu())
    v = torch.randn(64, 64, device="cuda")[:, 3]  # a non-contiguous view
    assert digest(v) == digest(v.cpu())


def test_manager_roundtrip_of_gpu_state(tmp_path):
    torch.manual_seed(1)
    model = torch.nn.Linear(256, 256).cuda()
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 256, device="cuda")).sum().backward()
    optim.step()
    mgr = cg.CheckpointManager(tmp_path / "ck")
    mgr.save(1, {"model": model, "optim": optim})
    expect = torch.cuda.get_rng_state()
    torch.cuda.manual_seed(99)
    fresh = torch.nn.Linear(256, 256).cuda()
    fresh_optim = torch.optim.Adam(fresh.parameters())
    ptr = fresh.weight.data_ptr()
    assert mgr.restore({"model": fresh, "optim": fresh_optim}) == 1
    assert torch.equal(fresh.weight, model.weight) and fresh.weight.data_ptr() == ptr
    assert torch.equal(torch.cuda.get_rng_state(), expect)
