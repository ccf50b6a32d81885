"""Expert-parallel bitwise read-back on GPUs with NCCL (the guide's EP key rule).

Run under torchrun with N GPUs (N = 2 here; 4 for EP4 + FSDP2 when that machine is lent):

    torchrun --nproc_per_node 2 benchmarks/gpu_ep.py save --root /tmp/ep --out $OUT
    torchrun --nproc_per_node 2 benchmarks/gpu_ep.py restore --root /tmp/ep --out $OUT

``save`` builds an MoE-like model on cuda:<rank>: dense layers under FSDP2 over all ranks
(NCCL), experts different per EP rank (EP = world, or EP = world/2 with FSDP2 inside each EP
group when --edp 2), trains one step, shows that the save without EP-aware keys is refused,
saves with ``ExpertParallel`` and records per-rank digests of every expert parameter and its
Adam state. ``restore`` runs in new processes: it builds the model from other seeds, restores,
compares the digests bitwise, and checks that a different EP size raises. Each rank writes
``ep_<mode>_rank<r>.json`` to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import ckptguard as cg
from ckptguard._disk.digest import digest


class MoE(torch.nn.Module):
    def __init__(self, ep_rank: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.dense = torch.nn.Linear(256, 512)
        torch.manual_seed(seed + 100 + ep_rank)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(512, 512) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dense(x)
        return sum(e(h) for e in self.experts)


def build(world: int, edp: int, seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    ep = world // edp
    mesh = init_device_mesh("cuda", (ep, edp), mesh_dim_names=("ep", "edp"))
    ep_rank = mesh["ep"].get_local_rank()
    model = MoE(ep_rank, seed).cuda()
    if edp > 1:
        for e in model.experts:
            fully_shard(e, mesh=mesh["edp"])
    fully_shard(model.dense, mesh=init_device_mesh("cuda", (world,)))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    torch.manual_seed(1234 + dist.get_rank())
    model(torch.randn(8, 256, device="cuda")).pow(2).mean().backward()
    optim.step()
    return model, optim, mesh["ep"].get_group(), ep, ep_rank


def fingerprint(model, optim) -> dict[str, str]:
    out = {}
    for name, p in model.named_parameters():
        if name.startswith("experts."):
            out[name] = digest(p)
            for k, v in optim.state[p].items():
                out[f"{name}:{k}"] = digest(v)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["save", "restore"])
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--edp", type=int, default=1, help="FSDP2 size inside each EP group")
    a = ap.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    result: dict = {
        "rank": rank,
        "world": world,
        "edp": a.edp,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "backend": "nccl",
    }
    if a.mode == "save":
        model, optim, ep_group, ep, ep_rank = build(world, a.edp, seed=0)
        result.update(ep=ep, ep_rank=ep_rank)
        try:
            cg.CheckpointManager(f"{a.root}/plain").save(1, {"model": model, "optim": optim})
            result["plain_save"] = "committed (NOT refused)"
        except cg.ReplicatedDivergenceError as exc:
            result["plain_save"] = "refused: " + str(exc)[:300]
        mgr = cg.CheckpointManager(
            f"{a.root}/ep", expert_parallel=cg.ExpertParallel(group=ep_group)
        )
        mgr.save(1, {"model": model, "optim": optim})
        result["saved"] = fingerprint(model, optim)
        result["pid"] = os.getpid()
    else:
        saved = json.loads((Path(a.out) / f"ep_save_rank{rank}.json").read_text())
        model, optim, ep_group, ep, ep_rank = build(world, a.edp, seed=7)
        result.update(ep=ep, ep_rank=ep_rank, pid=os.getpid(), saving_pid=saved["pid"])
        result["differs_before_restore"] = fingerprint(model, optim) != saved["saved"]
        mgr = cg.CheckpointManager(
            f"{a.root}/ep", expert_parallel=cg.ExpertParallel(group=ep_group)
        )
        result["restored_step"] = mgr.restore({"model": model, "optim": optim})
        now = fingerprint(model, optim)
        result["expert_tensors"] = len(now)
        result["bitwise_equal"] = now == saved["saved"]
        try:
            cg.CheckpointManager(
                f"{a.root}/ep", expert_parallel=cg.ExpertParallel(group=None)
            ).restore({"model": model, "optim": optim})
            result["ep_size_mismatch"] = "restored (NOT refused)"
        except cg.TopologyMismatchError as exc:
            result["ep_size_mismatch"] = "raised TopologyMismatchError: " + str(exc)[:300]
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / f"ep_{a.mode}_rank{rank}.json").write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
