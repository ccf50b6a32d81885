"""nanoGPT's ``train.py``, its shape kept, checkpointed with ckptguard as the README's Usage says.

    python examples/nanogpt.py --out-dir /tmp/nano --max-iters 40
    torchrun --standalone --nproc-per-node 2 examples/nanogpt.py --out-dir /tmp/nano --max-iters 40
    (kill it at any moment, run the same command again: it resumes; then
    ``ckptguard prove /tmp/nano/ckpt``)

What upstream's loop does and this one keeps: a GPT (pre-LN blocks, causal self-attention, GELU MLP,
a ``Dropout`` in every block, the LM head tied to the token embedding, GPT-2's init); the tokens of
a ``uint16`` file read through a fresh ``np.memmap`` per batch; ``get_batch`` drawing random offsets
from torch's *global* RNG, seeded ``1337 + rank``; the next batch fetched right after each
micro-step's forward (a prefetch); AdamW with weight decay on the 2-D parameters only; gradient
accumulation (DDP syncs gradients on the last micro-step only); clipping; warmup then cosine decay
of the lr, computed from the iteration number; ``estimate_loss`` every ``eval_interval`` iterations
on rank 0, which draws its batches from the same global RNG as training.

What ckptguard changes, and why each line is needed for an exact resume:

- ``state = {"model", "optimizer", "prefetched", "best_val_loss"}`` and ``restore`` before the loop:
  the model and AdamW, the batch already drawn for the next iteration (``cg.PerRank``: each rank
  drew its own; without it a resumed run would draw a new one from the restored RNG, one batch
  ahead of the killed run), and every rank's RNG streams (restored by ckptguard itself).
- The evaluation and the save come after the iteration's step (upstream runs them at the top of the
  loop): a resumed run starting at the top would evaluate the saved iteration a second time and so
  draw ``eval_iters`` batches more from the restored RNG than the uninterrupted run did.
- ``record_step`` every iteration (the offsets it read, the batch's tokens, the loss, the gradient
  norm, the lr) under ``ProofPlan(deterministic=True)``: ``ckptguard prove`` compares the steps a
  resumed run replays with the killed run's, bitwise.

The last line is ``final <iter> <digest>`` (parameters and AdamW state): a run killed and resumed
any number of times prints the digest of a run that never stopped.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import ckptguard as cg


@dataclass
class Config:
    """Upstream's config globals, sized for a CPU."""

    batch_size: int = 4
    block_size: int = 16
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    vocab_size: int = 65  # shakespeare_char's
    dropout: float = 0.1
    bias: bool = True
    gradient_accumulation_steps: int = 4  # over all ranks, as upstream (divided by the world size)
    learning_rate: float = 1e-3
    weight_decay: float = 1e-1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0
    warmup_iters: int = 5
    lr_decay_iters: int = 500
    min_lr: float = 1e-4
    eval_interval: int = 5
    eval_iters: int = 2
    ckpt_interval: int = 4
    max_iters: int = 40


# ---------------------------------------------------------------- the model (upstream model.py,
# shortened)


class CausalSelfAttention(torch.nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.c_attn = torch.nn.Linear(c.n_embd, 3 * c.n_embd, bias=c.bias)
        self.c_proj = torch.nn.Linear(c.n_embd, c.n_embd, bias=c.bias)
        self.attn_dropout, self.resid_dropout = (
            torch.nn.Dropout(c.dropout),
            torch.nn.Dropout(c.dropout),
        )
        self.n_head, self.dropout = c.n_head, c.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, e = x.size()
        q, k, v = (
            z.view(b, t, self.n_head, e // self.n_head).transpose(1, 2)
            for z in self.c_attn(x).split(e, 2)
        )
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        out: torch.Tensor = self.resid_dropout(
            self.c_proj(y.transpose(1, 2).contiguous().view(b, t, e))
        )
        return out


class Block(torch.nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = (
            torch.nn.LayerNorm(c.n_embd, bias=c.bias),
            torch.nn.LayerNorm(c.n_embd, bias=c.bias),
        )
        self.attn = CausalSelfAttention(c)
        hidden = 4 * c.n_embd
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(c.n_embd, hidden, bias=c.bias),
            torch.nn.GELU(),
            torch.nn.Linear(hidden, c.n_embd, bias=c.bias),
            torch.nn.Dropout(c.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        out: torch.Tensor = x + self.mlp(self.ln_2(x))
        return out


class GPT(torch.nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.wte, self.wpe = (
            torch.nn.Embedding(c.vocab_size, c.n_embd),
            torch.nn.Embedding(c.block_size, c.n_embd),
        )
        self.drop = torch.nn.Dropout(c.dropout)
        self.h = torch.nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = torch.nn.LayerNorm(c.n_embd, bias=c.bias)
        self.lm_head = torch.nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying
        for m in self.modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
                torch.nn.init.normal_(m.weight, mean=0.0, std=0.02)
                if isinstance(m, torch.nn.Linear) and m.bias is not None:
                    torch.nn.init.zeros_(m.bias)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * c.n_layer))

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(idx.size(1), dtype=torch.long)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    def configure_optimizers(self, c: Config) -> torch.optim.AdamW:
        params = [p for p in self.parameters() if p.requires_grad]  # tied weights appear once
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": c.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=c.learning_rate, betas=(c.beta1, c.beta2))


# ---------------------------------------------------------------- data and schedule (upstream
# train.py)


def prepare(data_dir: Path, c: Config) -> None:
    """``train.bin``/``val.bin`` of uint16 tokens (a fixed pseudo-text), each written atomically
    once."""
    data_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for split, n in (("train", 20000), ("val", 2000)):
        path = data_dir / f"{split}.bin"
        if path.is_file():
            continue
        words = rng.integers(0, c.vocab_size, size=(n // 4, 4), dtype=np.uint16)  # 4-token "words"
        tokens = np.concatenate(
            [words, np.full((n // 4, 1), c.vocab_size - 1, dtype=np.uint16)], axis=1
        )
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tokens.reshape(-1)[:n].tofile(tmp)
        tmp.rename(path)  # a kill while writing leaves no half file for the next launch to read


def get_batch(
    data_dir: Path, split: str, c: Config
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # a new memmap per batch, as upstream (avoids its memory leak)
    data = np.memmap(data_dir / f"{split}.bin", dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - c.block_size, (c.batch_size,))  # torch's global RNG
    x = torch.stack(
        [torch.from_numpy(data[i : i + c.block_size].astype(np.int64)) for i in ix.tolist()]
    )
    y = torch.stack(
        [torch.from_numpy(data[i + 1 : i + 1 + c.block_size].astype(np.int64)) for i in ix.tolist()]
    )
    return x, y, ix


def get_lr(it: int, c: Config) -> float:
    if it < c.warmup_iters:
        return c.learning_rate * (it + 1) / (c.warmup_iters + 1)
    if it > c.lr_decay_iters:
        return c.min_lr
    ratio = (it - c.warmup_iters) / (c.lr_decay_iters - c.warmup_iters)
    return c.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (c.learning_rate - c.min_lr)


@torch.no_grad()
def estimate_loss(model: torch.nn.Module, data_dir: Path, c: Config) -> dict[str, float]:
    out = {}
    model.eval()
    for split in ("train", "val"):
        losses = torch.zeros(c.eval_iters)
        for k in range(c.eval_iters):
            x, y, _ = get_batch(data_dir, split, c)
            losses[k] = model(x, y)[1].item()
        out[split] = float(losses.mean())
    model.train()
    return out


def digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """sha256 of every parameter's and every AdamW tensor's bytes, in a fixed order."""
    h = hashlib.sha256()
    tensors: list[torch.Tensor] = [p for _, p in model.named_parameters()]
    tensors += [
        v
        for p in tensors
        for v in optimizer.state.get(p, {}).values()
        if isinstance(v, torch.Tensor)
    ]
    for t in tensors:
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------- the loop


def train(out_dir: str, c: Config, *, data_dir: str | None = None, root: str | None = None) -> str:
    """One process of the job (a process group, if any, already initialised); returns the final
    digest. The checkpoint root is ``root``, by default OUT_DIR/ckpt; the tokens DATA_DIR, by
    default OUT_DIR/data."""
    ddp = torch.distributed.is_initialized()
    rank, world = (
        (torch.distributed.get_rank(), torch.distributed.get_world_size()) if ddp else (0, 1)
    )
    if c.gradient_accumulation_steps % world:
        raise SystemExit(
            f"gradient_accumulation_steps {c.gradient_accumulation_steps}: a multiple of the world "
            f"size ({world})"
        )
    accum = c.gradient_accumulation_steps // world
    data = Path(data_dir) if data_dir else Path(out_dir) / "data"
    if rank == 0:
        prepare(data, c)
    if ddp:
        torch.distributed.barrier()  # the token files exist before any rank maps them
    torch.manual_seed(1337 + rank)
    raw = GPT(c)
    model: torch.nn.Module = torch.nn.parallel.DistributedDataParallel(raw) if ddp else raw
    optimizer = raw.configure_optimizers(c)
    prefetched = cg.PerRank(None)  # the batch drawn for the next iteration (upstream's X, Y)
    state: dict[str, Any] = {
        "model": raw,
        "optimizer": optimizer,
        "prefetched": prefetched,
        "best_val_loss": 1e9,
    }
    mgr = cg.CheckpointManager(
        Path(root) if root else Path(out_dir) / "ckpt",
        config=cg.CheckpointConfig(
            retention=cg.KeepLast(2),
            proof=cg.ProofPlan(deterministic=True, total_steps=c.max_iters),
        ),
    )
    iter_num = mgr.restore(state)
    best_val_loss = state["best_val_loss"]
    x, y, ix = (
        prefetched.value if prefetched.value is not None else get_batch(data, "train", c)
    )  # the first batch
    while iter_num < c.max_iters:
        lr = get_lr(iter_num, c)
        for group in optimizer.param_groups:
            group["lr"] = lr
        read, total = [], torch.zeros(())
        for micro_step in range(accum):
            if ddp:
                last = micro_step == accum - 1
                model.require_backward_grad_sync = last  # type: ignore[assignment]
            read.append((x, ix))
            _, loss = model(x, y)
            loss = loss / accum
            x, y, ix = get_batch(
                data, "train", c
            )  # prefetch, while the model works (upstream's comment)
            loss.backward()
            total += loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), c.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        iter_num += 1
        prefetched.value = (x, y, ix)
        extra = {}
        if iter_num % c.eval_interval == 0 and rank == 0:
            losses = estimate_loss(model, data, c)
            best_val_loss = min(best_val_loss, losses["val"])
            extra = {"val_loss": losses["val"]}
            print(
                f"iter {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}",
                flush=True,
            )
        mgr.record_step(
            iter_num,
            sample_ids=torch.cat([i for _, i in read]).tolist(),
            batch=[t for t, _ in read],
            loss=total,
            grad_norm=norm,
            lr=lr,
            **extra,
        )
        if iter_num % c.ckpt_interval == 0:
            state["best_val_loss"] = (
                best_val_loss  # a plain value: a snapshot, refreshed before each save
            )
            mgr.save(iter_num, state)
    mgr.close()
    return digest(raw, optimizer)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out-dir",
        required=True,
        help="the checkpoint root is OUT_DIR/ckpt, the tokens OUT_DIR/data",
    )
    p.add_argument(
        "--data-dir", default=None, help="where train.bin and val.bin are (made there if absent)"
    )
    p.add_argument("--max-iters", type=int, default=Config.max_iters)
    p.add_argument("--ckpt-interval", type=int, default=Config.ckpt_interval)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        torch.distributed.init_process_group("gloo")
    final = train(
        a.out_dir, Config(max_iters=a.max_iters, ckpt_interval=a.ckpt_interval), data_dir=a.data_dir
    )
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == 0:
        print(f"final {a.max_iters} {final}", flush=True)
    if torch.distributed.is_initialized():
        # leave together: a rank gone while its peer still talks aborts the peer
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
