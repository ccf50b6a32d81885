"""A small supervised job with every kind of state an exact resume needs.

A model with dropout (CPU RNG), Adam (optimizer step and moments), a warmup LR
schedule, and a data loader whose cursor draws NumPy and Python randomness; FSDP2 under
a process group of more than one rank. The resume-equivalence oracle of the test suite
trains it straight through and through a kill and a resume, and compares bit for bit.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._disk.digest import digest

FEATURES = 16
HIDDEN = 64


class ToyLoader:
    """A data stream with a cursor; each batch draws NumPy and Python randomness."""

    def __init__(self, *, batch: int = 8, rank: int = 0) -> None:
        self.batch = batch
        self.rank = rank
        self.cursor = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        noise = np.random.standard_normal((self.batch, FEATURES)).astype(np.float32)
        scale = 0.5 + random.random()
        x = torch.from_numpy(noise) * scale + 0.01 * self.cursor
        y = x[:, :2].sum(dim=1, keepdim=True).sin()
        self.cursor += 1
        return x, y

    def state_dict(self) -> dict[str, int]:
        return {"cursor": self.cursor}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.cursor = int(sd["cursor"])


@dataclass
class Job:
    model: torch.nn.Module
    optim: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    loader: ToyLoader
    rank: int

    def state(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "optim": self.optim,
            "sched": self.sched,
            "loader": self.loader,
        }


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def build_job(*, rank: int = 0, world: int = 1, seed: int = 0, warmup: int = 5) -> Job:
    """The same initial weights on every rank; per-rank data and dropout streams.
    Under a process group of world > 1 the model is sharded with FSDP2."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(HIDDEN, 1),
    )
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))  # a CPU job, also on a machine with GPUs
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / warmup))
    seed_everything(seed + 1000 * (rank + 1))
    return Job(model, optim, sched, ToyLoader(rank=rank), rank)


def train_step(job: Job) -> float:
    x, y = job.loader.next_batch()
    loss = torch.nn.functional.mse_loss(job.model(x), y)
    job.optim.zero_grad(set_to_none=True)
    loss.backward()
    job.optim.step()
    job.sched.step()
    return float(loss.item())


def fingerprint(job: Job) -> dict[str, str]:
    """Bitwise digest of every parameter and every optimizer tensor this rank holds."""
    out = {f"param:{n}": digest(p) for n, p in job.model.named_parameters()}
    names = {id(p): n for n, p in job.model.named_parameters()}
    for group in job.optim.param_groups:
        for p in group["params"]:
            for k, v in job.optim.state.get(p, {}).items():
                out[f"optim:{names[id(p)]}:{k}"] = digest(v)
    out["lr"] = json.dumps(job.sched.get_last_lr())
    return out
