"""Tensor-parallel ``Shard(1)`` DTensors on 2 gloo ranks: the layout-free digest of the shards
combined equals the whole tensor's, a flipped byte in one rank's shard changes only its key, and
word-aligned row runs are summed for many rows at once (no Python call per row)."""

from __future__ import annotations

import torch

from ckptguard._disk import boxsum as d
from ckptguard.testing import run_ranks, values


def _tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "w": torch.randn(96, 64),  # fp32, 32 columns a rank: runs of 128 bytes, word-aligned
        "bf": torch.randn(33, 4, 64).to(
            torch.bfloat16
        ),  # dims after the split whole: runs of 256 bytes
        "odd": torch.randn(7, 5),  # 3 + 2 columns: runs of 12 and 8 bytes, not word-aligned
    }


def _partials(rank: int, world: int, flip: bool) -> tuple[dict, dict[str, int]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    shards = {k: distribute_tensor(t, mesh, [Shard(1)]) for k, t in _tensors().items()}
    if flip and rank == 1:
        shards["w"].to_local().view(-1).view(torch.uint8)[333] ^= 4
    calls: dict[str, int] = {}
    real = d._bytes_sum

    def counted(*args, **kwargs):
        calls[key] = calls.get(key, 0) + 1
        return real(*args, **kwargs)

    d._bytes_sum = counted
    out = {}
    for key, t in shards.items():
        out.update(d.layout_free_partials({"model": {key: t}}))
    return out, calls


def test_tp_shard1_layout_free_digest_equals_the_whole_tensors():
    whole = d.combine_layout_free([d.layout_free_partials({"model": _tensors()})])
    ranks = values(run_ranks(_partials, 2, False))
    assert d.combine_layout_free([p for p, _ in ranks]) == whole
    for _, calls in ranks:
        assert "w" not in calls and "bf" not in calls, (
            calls
        )  # 96 and 33 x 2 rows, none summed one by one
        assert calls["odd"] == 7  # the fallback: one run per row
    flipped = d.combine_layout_free([p for p, _ in values(run_ranks(_partials, 2, True))])
    assert flipped["model"]["w"] != whole["model"]["w"]
    assert {k: v for k, v in flipped["model"].items() if k != "w"} == {
        k: v for k, v in whole["model"].items() if k != "w"
    }
