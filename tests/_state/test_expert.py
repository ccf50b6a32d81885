"""Expert-parallel state: the DCP merge bug, the guard that refuses it, and EP-aware keys."""

from __future__ import annotations

import pytest
import torch

import ckptguard as cg
from ckptguard._disk.digest import digest
from ckptguard.testing import run_ranks, values

EXPERTS = 2


class MoE(torch.nn.Module):
    def __init__(self, ep_rank: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense = torch.nn.Linear(8, 16)
        torch.manual_seed(100 + ep_rank)  # each EP group holds different experts
        self.experts = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dense(x)
        return sum(e(h) for e in self.experts)


def build(
    rank: int, world: int, ep: int, seed_shift: int = 0
) -> tuple[MoE, torch.optim.Optimizer, object]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (ep, world // ep), mesh_dim_names=("ep", "edp"))
    ep_rank = mesh["ep"].get_local_rank()
    model = MoE(ep_rank + seed_shift)
    if (
        world // ep > 1
    ):  # FSDP2 inside each EP group: expert chunks repeat their offsets across groups
        for expert in model.experts:
            fully_shard(expert, mesh=mesh["edp"])
    fully_shard(model.dense, mesh=init_device_mesh("cpu", (world,)))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    torch.manual_seed(rank)
    model(torch.randn(4, 8)).pow(2).mean().backward()
    optim.step()
    return model, optim, mesh["ep"].get_group()


def expert_fingerprint(model: MoE, optim: torch.optim.Optimizer) -> dict[str, str]:
    out = {}
    for name, p in model.named_parameters():
        if name.startswith("experts."):
            out[name] = digest(p)
            for k, v in optim.state[p].items():
                out[f"{name}:{k}"] = digest(v)
    return out


def _ep_worker(rank: int, world: int, root: str, ep: int) -> dict:
    model, optim, ep_group = build(rank, world, ep)
    saved = expert_fingerprint(model, optim)
    out: dict = {"ep_rank": torch.distributed.get_rank(ep_group)}
    try:
        cg.CheckpointManager(f"{root}/plain").save(1, {"model": model, "optim": optim})
    except cg.ReplicatedDivergenceError as exc:
        out["refused"] = str(exc)
    ep_spec = cg.ExpertParallel(group=ep_group)
    mgr = cg.CheckpointManager(f"{root}/ep", expert_parallel=ep_spec)
    mgr.save(1, {"model": model, "optim": optim})

    fresh, fresh_optim, _ = build(rank, world, ep, seed_shift=7)
    assert expert_fingerprint(fresh, fresh_optim) != saved
    mgr.restore({"model": fresh, "optim": fresh_optim})
    out["bitwise"] = expert_fingerprint(fresh, fresh_optim) == saved
    out["n_tensors"] = len(saved)
    try:
        other = cg.CheckpointManager(f"{root}/ep", expert_parallel=cg.ExpertParallel(group=None))
        other.restore({"model": fresh, "optim": fresh_optim})
    except cg.TopologyMismatchError as exc:
        out["mismatch"] = str(exc)
    return out


@pytest.mark.parametrize(("world", "ep"), [(2, 2), (4, 2)])
def test_expert_state_roundtrips_per_ep_rank(tmp_path, world, ep):
    out = values(run_ranks(_ep_worker, world, str(tmp_path), ep))
    assert sorted({r["ep_rank"] for r in out}) == list(range(ep))
    for r in out:
        # Without EP-aware keys the expert chunks collide in DCP: the guard refuses the save.
        assert "experts.0.weight" in r["refused"] and "ExpertParallel" in r["refused"]
        assert "dense" not in r["refused"]
        # With them, every expert parameter and its Adam state comes back bit for bit.
        assert r["bitwise"] and r["n_tensors"] == EXPERTS * 2 * 4
        assert "'ep': 2" in r["mismatch"] and "'ep': 1" in r["mismatch"]
        assert (
            "regroups the experts of every old EP rank" in r["mismatch"]
        )  # what an EP reshard would need


def _dcp_bug_worker(rank: int, world: int, root: str) -> list[float]:
    import torch.distributed.checkpoint as dcp

    dcp.save({"experts": torch.full((4,), float(rank))}, checkpoint_id=root)
    target = {"experts": torch.zeros(4)}
    dcp.load(target, checkpoint_id=root)
    return target["experts"].tolist()


def test_plain_dcp_still_merges_per_rank_tensors(tmp_path):
    """The bug this module exists for, checked against the installed torch: if DCP ever
    stops merging, this test fails and the guard's rationale must be revisited."""
    out = values(run_ranks(_dcp_bug_worker, 2, str(tmp_path / "dcp")))
    assert out[1] == out[0] and out[1] != [1.0] * 4
