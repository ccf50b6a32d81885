"""GPU checks of the core (marked gpu; skipped without CUDA): digests of device tensors,
and a manager round trip of GPU state with the RNG of every device."""

from __future__ import annotations

import pytest
import torch

import ckptguard as cg
from ckptguard._disk.digest import digest

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
    for n in (
        0,
        7,
        (64 << 20) // 4 + 3,
        (200 << 20) // 4,
    ):  # empty, tiny, just over a chunk, several chunks
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


def test_gpu_layout_free_digest_equals_cpu_and_record_step_hashes_on_the_gpu(tmp_path):
    from ckptguard._disk import boxsum as d

    torch.manual_seed(2)
    # tiny, odd byte counts (partial words), an unaligned view, a box at an unaligned offset, and
    # more than one pass of the GPU's bounded product (d._LF_GPU_WORDS words)
    cases = [
        torch.randn(5, 3),
        torch.randint(0, 255, (4097,), dtype=torch.uint8),
        torch.randn(9, 7)[1:, 2:5],
        torch.randn(d._LF_GPU_WORDS + 3 * d._LF_BLOCK + 5, dtype=torch.float64),
    ]
    for t in cases:
        gshape = tuple(t.shape)
        assert d.box_sum(t.cuda(), (0,) * t.dim(), gshape) == d.box_sum(t, (0,) * t.dim(), gshape)
    part = torch.randn(11, 3)[
        5:
    ]  # rows 5.. of an (11, 3) float32 tensor: starts at byte 60, not a word boundary
    assert d.box_sum(part.cuda(), (5, 0), (11, 3)) == d.box_sum(part, (5, 0), (11, 3))
    mgr = cg.CheckpointManager(tmp_path / "ck")
    batch = torch.randint(0, 50000, (64, 2048), device="cuda")
    assert (
        mgr.record_step(1, batch=batch)["batch"] == mgr.record_step(1, batch=batch.cpu())["batch"]
    )


def test_restore_of_gpu_state_verifies_on_the_device_and_a_flipped_byte_names_the_file(
    tmp_path, monkeypatch
):
    """Same layout: GPU tensor items are checked by the layout-free pass on the device, with no
    D2H copy of every byte for an xxh3 pass, and a changed byte is still caught."""
    from ckptguard._disk import digest as d

    torch.manual_seed(3)
    model = torch.nn.Linear(512, 512).cuda()
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 512, device="cuda")).sum().backward()
    optim.step()
    root = tmp_path / "ck"
    cg.CheckpointManager(root).save(1, {"model": model, "optim": optim})
    staged: list[int] = []
    real = d._update_from_cuda
    monkeypatch.setattr(
        d, "_update_from_cuda", lambda h, flat: (staged.append(flat.numel()), real(h, flat))[1]
    )

    def fresh() -> dict:
        m = torch.nn.Linear(512, 512).cuda()
        return {"model": m, "optim": torch.optim.AdamW(m.parameters())}

    again = fresh()
    assert cg.CheckpointManager(root).restore(again) == 1
    assert staged == [], staged  # no GPU tensor went through the pinned-chunk xxh3 pass
    assert torch.equal(again["model"].weight, model.weight)
    moment = again["optim"].state_dict()["state"][0]["exp_avg_sq"]
    assert torch.equal(moment, optim.state_dict()["state"][0]["exp_avg_sq"])
    state_dir = root / "step_00000001" / "state"
    info = max(cg.read_dcp_metadata(state_dir).storage_data.values(), key=lambda i: i.length)
    shard = state_dir / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset + info.length // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(cg.StateMismatchError) as caught:
        cg.CheckpointManager(root).restore(fresh())
    assert shard.name in str(caught.value) and "layout-free digests differ" in str(caught.value), (
        str(caught.value)
    )
