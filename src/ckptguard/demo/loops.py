"""Small training loops with the data-order bugs a resume proof must catch.

- ``prefetch="lost"``: the loop draws its next batch before the save point (a common
  prefetch pattern) and the state does not hold it; ``prefetch="saved"`` keeps it in the
  state as ``PerRank``.
- ``sampler="shuffle"``: a shuffling sampler whose ``state_dict`` keeps the epoch, the
  position and the current permutation but not its ``torch.Generator``, so the epoch after a
  resume repeats the first epoch's order; ``sampler="shuffle+generator"`` adds
  ``GeneratorState(sampler.generator)`` to the state.
- ``rollout=True``: a toy RL step that samples its completions with a generator that is on
  purpose not restored: the data order stays exact, the numbers do not.
- ``noise=True``: a plain step that adds noise from a generator that is not in the state (a
  dropout-like bug): the data order stays exact, the numbers do not, and the default plan FAILs.
- ``sampler="random"`` with ``prefetch="before_restore"``: nanoGPT's naive loop, whose first batch
  is drawn from torch's global RNG above the loop, before ``restore`` put that RNG back.
- ``epoch_loader=True``: the loop iterates a loader built for the epoch of the restored step; a
  restore at the end of an epoch finds it exhausted, and the resumed run trains zero steps.

Each rank draws its own samples and the gradients are all-reduced over gloo, so the model
stays replicated. ``run`` is one segment of a job (one process); ``stop_after`` ends it right
after recording that step, which leaves the proof records exactly as a SIGKILL there would.
Under torchrun: ``python -m ckptguard.demo.loops --root R --steps N --save-every K ...``.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

VOCAB, SEQ, DIM, BATCH = 16, 8, 16, 4
SAMPLES = 48  # the cursor's dataset
SHUFFLED = 12  # the shuffling sampler's dataset: 3 steps per epoch on one rank


def tokens_of(ids: torch.Tensor) -> torch.Tensor:
    """The dataset: sample ``i`` is a fixed token sequence."""
    rows = [
        torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(7919 * int(i) + 1))
        for i in ids
    ]
    return torch.stack(rows)


class Cursor:
    """Sequential sample ids, each rank its own; the cursor is saved and restored."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world, self.cursor = rank, world, 0

    def next(self) -> torch.Tensor:
        first = (self.cursor * self.world + self.rank) * BATCH
        self.cursor += 1
        return (torch.arange(BATCH) + first) % SAMPLES

    def state_dict(self) -> dict[str, int]:
        return {"cursor": self.cursor}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.cursor = int(sd["cursor"])


class RandomSampler:
    """Ids drawn from torch's global RNG (which ckptguard saves and restores), as nanoGPT's
    get_batch."""

    def next(self) -> torch.Tensor:
        return torch.randint(0, SAMPLES, (BATCH,))

    def state_dict(self) -> dict[str, int]:
        return {}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        pass


class ShuffleSampler:
    """Each epoch a permutation drawn from ``self.generator``; the state holds everything but the
    generator."""

    def __init__(self, rank: int, world: int, seed: int = 0) -> None:
        self.rank, self.world = rank, world
        self.generator = torch.Generator().manual_seed(seed)
        self.epoch, self.pos = 0, 0
        self.perm: torch.Tensor | None = None

    def next(self) -> torch.Tensor:
        per_step = BATCH * self.world
        if self.perm is None or self.pos + per_step > SHUFFLED:
            self.perm = torch.randperm(SHUFFLED, generator=self.generator)
            self.epoch, self.pos = self.epoch + 1, 0
        start = self.pos + self.rank * BATCH
        self.pos += per_step
        return self.perm[start : start + BATCH].clone()

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "pos": self.pos, "perm": self.perm}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.epoch, self.pos, self.perm = int(sd["epoch"]), int(sd["pos"]), sd["perm"]


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.tanh(self.emb(tokens)))
        return out


def _sync_grads(model: torch.nn.Module, world: int) -> float:
    """All-reduce the gradients (the model stays replicated) and return their global norm."""
    if world > 1:
        import torch.distributed as dist

        for p in model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad /= world
    grads = [p.grad.double() for p in model.parameters() if p.grad is not None]
    return float(torch.sqrt(torch.stack([(g**2).sum() for g in grads]).sum()))


def _rollout_loss(
    model: Model, prompts: torch.Tensor, gen: torch.Generator
) -> tuple[torch.Tensor, float]:
    tokens = prompts
    with torch.no_grad():
        for _ in range(SEQ - prompts.shape[1]):
            probs = torch.softmax(model(tokens)[:, -1], dim=-1)
            tokens = torch.cat([tokens, torch.multinomial(probs, 1, generator=gen)], dim=1)
    # A reward that varies across samples: a zero advantage would make the update zero
    # (docs/practices.md, 6.4).
    reward = tokens[:, prompts.shape[1] :].float().mean(dim=1) / VOCAB
    logp = (
        torch.log_softmax(model(tokens[:, :-1]), dim=-1)
        .gather(-1, tokens[:, 1:, None])
        .squeeze(-1)
        .sum(1)
    )
    return -((reward - reward.mean()) * logp).mean(), float(reward.mean())


def run(
    root: str,
    *,
    rank: int = 0,
    world: int = 1,
    steps: int,
    save_every: int,
    prefetch: str = "none",
    sampler: str = "cursor",
    rollout: bool = False,
    noise: bool = False,
    deterministic: bool | None = None,
    total_steps: int | None = None,
    epoch_loader: bool = False,
    record_epoch: bool = False,
    stop_after: int | None = None,
    sleep_s: float = 0.0,
) -> dict[str, Any]:
    """One segment: restore (AUTO), train to ``steps`` with a step record each, save every
    ``save_every``. ``stop_after`` at or below the restored step ends the segment right after the
    restore (a relaunch killed before its first step)."""
    import ckptguard as cg

    if prefetch not in ("none", "lost", "saved", "before_restore") or sampler not in (
        "cursor",
        "shuffle",
        "shuffle+generator",
        "random",
    ):
        raise ValueError(f"prefetch={prefetch!r}, sampler={sampler!r}")
    torch.manual_seed(0)
    model = Model()
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    source = _source(sampler, rank, world)
    state: dict[str, Any] = {"model": model, "optim": optim, "sampler": source}
    if sampler == "shuffle+generator":
        state["sampler_gen"] = cg.GeneratorState(source.generator)  # type: ignore[union-attr]
    ahead = cg.PerRank(None)  # the batch drawn before the save point
    if prefetch == "saved":
        state["prefetched"] = ahead
    if prefetch == "before_restore":
        ahead.value = (
            source.next()
        )  # nanoGPT's `X, Y = get_batch('train')` above the loop: an RNG not yet restored
    rollout_gen = torch.Generator().manual_seed(os.getpid())  # on purpose not in the state
    plan = cg.ProofPlan(deterministic=deterministic, total_steps=total_steps)
    mgr = cg.CheckpointManager(
        root, config=cg.CheckpointConfig(proof=plan, retention=cg.KeepLast(2))
    )
    start = mgr.restore(state)
    if prefetch != "none" and ahead.value is None:
        ahead.value = source.next()
    losses: dict[int, float] = {}
    if stop_after is not None and stop_after <= start:
        return {"start": start, "losses": losses}
    last = steps
    if (
        epoch_loader and start
    ):  # the loader of the restored step's epoch: exhausted when restored at its end
        per_epoch = SAMPLES // (BATCH * world)
        last = min(steps, start if start % per_epoch == 0 else (start // per_epoch + 1) * per_epoch)
    for step in range(start + 1, last + 1):
        if prefetch == "none":
            ids = source.next()
        else:
            ids, ahead.value = (
                ahead.value,
                source.next(),
            )  # prefetch the next batch before the save point
        batch = tokens_of(ids)
        if rollout:
            loss, reward = _rollout_loss(model, batch[:, :2], rollout_gen)
            extra = {"reward": reward}
        else:
            logits = model(batch[:, :-1])
            if (
                noise
            ):  # drawn from a generator that is not in the state: the resumed run's noise differs
                logits = logits + 0.1 * torch.randn(logits.shape, generator=rollout_gen)
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1)
            )
            extra = {}
        optim.zero_grad(set_to_none=True)
        loss.backward()
        norm = _sync_grads(model, world)
        optim.step()
        losses[step] = float(loss.detach())
        if record_epoch and isinstance(
            source, ShuffleSampler
        ):  # the pass over the data this batch belongs to
            extra["epoch"] = source.epoch
        mgr.record_step(step, sample_ids=ids, batch=batch, loss=loss, grad_norm=norm, **extra)
        if step == stop_after:
            break
        if step % save_every == 0:
            mgr.save(step, state)
        if sleep_s:
            time.sleep(sleep_s)
    return {"start": start, "losses": losses}


def _source(sampler: str, rank: int, world: int) -> Cursor | ShuffleSampler | RandomSampler:
    if sampler == "cursor":
        return Cursor(rank, world)
    return RandomSampler() if sampler == "random" else ShuffleSampler(rank, world)


def _main() -> None:
    import argparse

    import torch.distributed as dist

    p = argparse.ArgumentParser(
        prog="python -m ckptguard.demo.loops", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--root", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-every", type=int, required=True)
    p.add_argument(
        "--prefetch", choices=("none", "lost", "saved", "before_restore"), default="none"
    )
    p.add_argument(
        "--sampler", choices=("cursor", "shuffle", "shuffle+generator", "random"), default="cursor"
    )
    p.add_argument("--rollout", action="store_true")
    p.add_argument("--not-deterministic", action="store_true")
    p.add_argument(
        "--noise", action="store_true", help="noise from a generator that is not in the state"
    )
    p.add_argument("--total-steps", type=int, default=None, help="ProofPlan(total_steps=)")
    p.add_argument(
        "--epoch-loader", action="store_true", help="a loader of the restored step's epoch only"
    )
    p.add_argument(
        "--record-epoch",
        action="store_true",
        help="record_step(..., epoch=) of the shuffling sampler",
    )
    p.add_argument(
        "--stop-after", type=int, default=None, help="end right after recording this step"
    )
    p.add_argument("--sleep", type=float, default=0.0, help="seconds to sleep after each step")
    a = p.parse_args()
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    run(
        a.root,
        rank=dist.get_rank() if world > 1 else 0,
        world=world,
        steps=a.steps,
        save_every=a.save_every,
        prefetch=a.prefetch,
        sampler=a.sampler,
        rollout=a.rollout,
        noise=a.noise,
        deterministic=False if a.not_deterministic else None,
        total_steps=a.total_steps,
        epoch_loader=a.epoch_loader,
        record_epoch=a.record_epoch,
        stop_after=a.stop_after,
        sleep_s=a.sleep,
    )


if __name__ == "__main__":
    _main()
