"""A training loop whose input pipeline is torchdata's StatefulDataLoader (what torchtitan and verl
checkpoint), put in the state as it is, with worker processes and a shuffle, on a model with a
Dropout; every step recorded for the proof (``ProofPlan(total_steps=)``: numerics compared bitwise).

``python tests/statefuldl_job.py ROOT KILL_AT [--own-generator] [--loader-not-in-state]``: SIGKILLs
itself right after step ``KILL_AT`` (0: never); ``--own-generator`` gives the loader
``generator=torch.Generator()`` (then no iterator it builds draws from torch's global RNG);
``--loader-not-in-state`` leaves the loader out of the state (the negative control: the resume
restarts the epoch). Prints ``RESULT {json}``."""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings

import torch

import ckptguard as cg
from ckptguard._disk.digest import digest  # bytes of every tensor, nested dicts, plain values

warnings.filterwarnings("ignore", message=".*set_vital.*")
TOTAL, SAVE_EVERY, BATCH, WORKERS = 25, 3, 4, 2  # 40 samples: 10 steps an epoch, 2.5 epochs


class Samples(torch.utils.data.Dataset):
    """40 samples; each item carries its id, so the proof records what every step consumed."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(40, 4, generator=gen), torch.randn(40, 1, generator=gen)

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int):
        return i, self.x[i], self.y[i]


def main(root: str, kill_at: int, loader_in_state: bool, own_generator: bool) -> dict:
    from torchdata.stateful_dataloader import StatefulDataLoader

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1)
    )
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = StatefulDataLoader(
        Samples(),
        batch_size=BATCH,
        shuffle=True,
        num_workers=WORKERS,
        generator=torch.Generator() if own_generator else None,
    )
    state = {"model": model, "optim": optim, **({"loader": loader} if loader_in_state else {})}
    mgr = cg.CheckpointManager(
        root, config=cg.CheckpointConfig(proof=cg.ProofPlan(total_steps=TOTAL))
    )
    start = step = mgr.restore(state)
    seen: list[int] = []
    while step < TOTAL:
        for ids, x, y in loader:
            step += 1
            loss = torch.nn.functional.mse_loss(model(x), y)
            optim.zero_grad()
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
            optim.step()
            seen += ids.tolist()
            mgr.record_step(step, sample_ids=ids.tolist(), loss=loss, grad_norm=norm)
            if step % SAVE_EVERY == 0:
                mgr.save(step, state)
            if step == kill_at:
                os.kill(
                    os.getpid(), signal.SIGKILL
                )  # mid-epoch, with the workers' batches in flight
            if step == TOTAL:
                break
    mgr.close()
    return {
        "start": start,
        "step": step,
        "seen": seen,
        "params": digest(model.state_dict()),
        "optim": digest(optim.state_dict()),
    }


if __name__ == "__main__":
    flags = sys.argv[3:]
    out = main(
        sys.argv[1],
        int(sys.argv[2]),
        "--loader-not-in-state" not in flags,
        "--own-generator" in flags,
    )
    print("RESULT " + json.dumps(out), flush=True)
