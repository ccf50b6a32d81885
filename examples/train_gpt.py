"""A nanoGPT-sized character model trained on the CPU with ckptguard end to end.

    python examples/train_gpt.py --root /tmp/gpt-ckpt --steps 40 --save-every 10
    python examples/train_gpt.py --root /tmp/gpt-ckpt --steps 40 --save-every 10 \\
        --kill-at 20  # dies mid-save
    # resumes, proves:
    python examples/train_gpt.py --root /tmp/gpt-ckpt --steps 40 --save-every 10

What it shows, in order of the loop:

1. ``restore(mode=AUTO)`` before the first step: the tracker's step, or a declared fresh start.
   It restores model, AdamW, the LR schedule, the data cursor and the RNG streams.
2. every step: the weights are "exported" to a sampler copy (as an RL trainer exports to its
   rollout engine) and recorded (``record_export``), the sampler's and the trainer's
   logprobs on the same tokens are recorded (``record_logprobs``), then the update
   (``record_update``) and the step's fingerprint (``record_step``: the batch it read, its loss
   and gradient norm). These are the evidence ``ckptguard prove ROOT`` checks after a resume:
   the steps a resumed run replays must read the same data and, since this job declares
   ``ProofPlan(rl=True, deterministic=True)``, produce the same numbers bitwise.
3. every ``--save-every`` steps: ``save`` commits the step atomically; retention keeps the
   last two. ``--kill-at N`` SIGKILLs the process in the middle of the save of step N.

Run it under ``torchrun --nproc-per-node 2`` and the ranks form a gloo group (FSDP2 model).
The last line printed is ``final <step> <digest>``: a resumed run prints the same digest
as a run that never stopped.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys

import torch
import torch.nn.functional as F

import ckptguard as cg
from ckptguard import testing as cg_testing
from ckptguard.ops import prove as proof

TEXT = (
    "First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. "
    "First Citizen: You are all resolved rather to die than to famish? All: Resolved. resolved. "
) * 4
CHARS = sorted(set(TEXT))
VOCAB, BLOCK, DIM, HEADS, LAYERS, BATCH = len(CHARS), 16, 32, 2, 2, 8


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(DIM), torch.nn.LayerNorm(DIM)
        self.qkv, self.proj = torch.nn.Linear(DIM, 3 * DIM), torch.nn.Linear(DIM, DIM)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(DIM, 4 * DIM), torch.nn.GELU(), torch.nn.Linear(4 * DIM, DIM)
        )
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        y = (
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
            .transpose(1, 2)
            .reshape(b, t, DIM)
        )
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(VOCAB, DIM), torch.nn.Embedding(BLOCK, DIM)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln, self.head = torch.nn.LayerNorm(DIM), torch.nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class Batches:
    """Random windows of the text; the cursor counts batches served (saved and restored)."""

    def __init__(self) -> None:
        self.data = torch.tensor([CHARS.index(c) for c in TEXT])
        self.cursor = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(
            len(self.data) - BLOCK - 1, (BATCH,)
        )  # the CPU RNG ckptguard restores
        self.cursor += 1
        x = torch.stack([self.data[s : s + BLOCK] for s in starts.tolist()])
        y = torch.stack([self.data[s + 1 : s + BLOCK + 1] for s in starts.tolist()])
        return x, y

    def state_dict(self) -> dict[str, int]:
        return {"cursor": self.cursor}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.cursor = int(sd["cursor"])


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded weights (collective under FSDP2): what a trainer sends to its sampler."""
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in model.named_parameters()
    }


def token_logprobs(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(model(x).float(), dim=-1).gather(-1, y[..., None]).squeeze(-1)


def build(world: int) -> tuple[GPT, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    model = GPT()
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(s / 200))
    )
    return model, optim, sched


def grad_norm(model: torch.nn.Module) -> float:
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def train(
    root: str,
    steps: int,
    save_every: int,
    kill_at: int | None,
    rank: int,
    world: int,
    timeout_s: float = 600.0,
) -> str:
    """Restore, train to ``steps`` with proof records, save every ``save_every``; return the final
    digest."""
    model, optim, sched = build(world)
    sampler = (
        GPT().eval()
    )  # built before the restore: building after it would draw from the restored RNG
    batches = Batches()
    torch.manual_seed(1000 + rank)  # per-rank data and dropout streams; saved and restored
    state = {"model": model, "optim": optim, "sched": sched, "data": batches}
    plan = cg.ProofPlan(
        rl=True, deterministic=True
    )  # exports are gates; a resume replays steps bitwise
    cfg = cg.CheckpointConfig(retention=cg.KeepLast(2), timeout_s=timeout_s, proof=plan)
    mgr = cg.CheckpointManager(root, config=cfg)
    start = mgr.restore(state, mode=cg.ResumeMode.AUTO)
    for step in range(start + 1, steps + 1):
        weights = full_weights(model)
        mgr.record_export(step - 1, weights)
        sampler.load_state_dict(weights)
        x, y = batches.next()
        model.eval()
        with torch.no_grad():
            mgr.record_logprobs(step, token_logprobs(model, x, y), token_logprobs(sampler, x, y))
        model.train()
        loss = F.cross_entropy(model(x).view(-1, VOCAB), y.view(-1))
        optim.zero_grad(set_to_none=True)
        loss.backward()
        norm = grad_norm(model)
        optim.step()
        sched.step()
        mgr.record_update(step, grad_norm=norm, params_changed=norm > 0)
        mgr.record_step(step, batch=(x, y), loss=loss, grad_norm=norm)
        if rank == 0:
            print(f"step {step:>3}  loss {loss.item():.4f}  grad_norm {norm:.3f}", flush=True)
        if step % save_every == 0:
            if step == kill_at:
                cg_testing.kill_at("storage.data_written")
                print(f"step {step:>3}  saving; SIGKILL in the middle of this save", flush=True)
            mgr.save(step, state)
    h = hashlib.sha256()
    for t in full_weights(model).values():
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", required=True, help="checkpoint root (created by the first save)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument(
        "--kill-at", type=int, default=None, help="SIGKILL this process mid-save of this step"
    )
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank() if world > 1 else 0
    final = train(args.root, args.steps, args.save_every, args.kill_at, rank, world)
    if rank == 0:
        gates = proof.evaluate(args.root)
        for g in gates:
            print(f"  {g.name:<42} {g.status.value:<8} {g.evidence}")
        print(proof.verdict(gates))
        print(f"final {args.steps} {final}", flush=True)
    if world > 1:
        # Leave together: a rank that exits while a peer still talks to it can abort the peer's
        # gloo.
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
