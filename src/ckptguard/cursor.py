"""A global data position that does not depend on the world size: ``DataCursor``.

Contract: the samples of an epoch are read in one global order, a permutation of
``range(num_samples)`` seeded by ``(seed, epoch)`` (Megatron's ``consumed_samples`` idea). The
cursor counts the samples of that order consumed so far, over all ranks together; every rank
holds the same count. ``take(n)`` hands this rank its ``n`` ids of the next global batch of
``n * world_size`` ids (rank r gets the r-th block of ``n``) and advances the count by the whole
batch, so every rank must call it alike (same ``n``, same number of times), which a data-parallel
loop does. The state is a small dict (``state_dict()``)::

    {"version": 1, "num_samples": int, "seed": int, "shuffle": bool, "epoch": int, "consumed": int}

Rank and world size are not in it: a resume on another world size re-partitions the rest of
the epoch over the new ranks, and every sample of the epoch is consumed exactly once.

The end of an epoch, when fewer than ``n * world_size`` ids are left: by default the rest is
split in rank order and some ranks get fewer than ``n`` ids (possibly none); ``drop_last=True``
skips the rest (those ids are not read in that epoch); ``pad=True`` fills the last batch with
ids from the head of the epoch's order (DistributedSampler's padding: those few are read twice).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import xxhash

from . import _log
from ._types import StateDict
from .errors import ConfigError

STATE_VERSION = 1
log = _log.logger()


def _count(name: str, value: Any, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"DataCursor: {name} must be an int >= {low}, got {value!r}")
    return value


class DataCursor:
    """A position in a seeded global order of ``num_samples`` ids, counted in samples consumed.

    ``rank``/``world_size`` are the data-parallel rank and size; they default to the default process
    group's (0 and 1 without one), which is right for pure data parallelism; with tensor or pipeline
    parallelism pass the DP rank and size (the ranks of one DP replica read the same ids). Put the
    cursor in the state (``state["data"] = cursor``): on a restore onto another world size it is
    re-partitioned over the new ranks (``ReshardRule.BY_ITEM``).
    """

    def __init__(
        self,
        num_samples: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        pad: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        self.num_samples = _count("num_samples", num_samples, 1)
        self.seed = _count("seed", seed, 0)
        if drop_last and pad:
            raise ConfigError(
                "DataCursor: drop_last and pad exclude each other; pick one way to end an epoch"
            )
        self.shuffle, self.drop_last, self.pad = bool(shuffle), bool(drop_last), bool(pad)
        initialized = dist.is_available() and dist.is_initialized()
        self.rank = _count(
            "rank", rank if rank is not None else (dist.get_rank() if initialized else 0), 0
        )
        self.world_size = _count(
            "world_size",
            world_size if world_size is not None else (dist.get_world_size() if initialized else 1),
            1,
        )
        if self.rank >= self.world_size:
            raise ConfigError(
                f"DataCursor: rank {self.rank} is not below world_size {self.world_size}"
            )
        self.epoch = 0
        self.consumed = 0
        self._order: tuple[int, list[int]] | None = None

    def __iter__(self) -> Iterator[int]:
        """One id at a time, for a single consumer (an RL driver's prompt stream,
        ``RolloutLedger(cursor)``): build it with ``rank=0, world_size=1`` there, or each rank's
        share is all it yields. Ends with the epoch; iterating again continues with the next one."""
        if self.exhausted(1):
            self.epoch, self.consumed = self.epoch + 1, 0
        epoch = self.epoch
        while self.epoch == epoch and not self.exhausted(1):
            ids = self.take(1)
            if ids:
                yield ids[0]

    def rest(self) -> Iterator[int]:
        """The rest of the current epoch, one id at a time, never starting the next one: what an
        iteration that was open at a save still yields after the restore (``RolloutLedger``
        continues its source so; at the end of an epoch it yields nothing, as the uninterrupted
        iteration)."""
        epoch = self.epoch
        while self.epoch == epoch and not self.exhausted(1):
            ids = self.take(1)
            if ids:
                yield ids[0]

    # ------------------------------------------------------------ the global order

    def order(self, epoch: int | None = None) -> list[int]:
        """The global order of ``epoch`` (default: the current one); the same on every rank and
        world size."""
        epoch = self.epoch if epoch is None else epoch
        if self._order is None or self._order[0] != epoch:
            if self.shuffle:
                seed = xxhash.xxh3_64_intdigest(f"ckptguard-data:{self.seed}:{epoch}".encode()) & (
                    (1 << 63) - 1
                )
                gen = torch.Generator().manual_seed(seed)
                ids = torch.randperm(self.num_samples, generator=gen).tolist()
            else:
                ids = list(range(self.num_samples))
            self._order = (epoch, ids)
        return self._order[1]

    def exhausted(self, n: int) -> bool:
        """True when the current epoch has no batch of ``n`` ids per rank left to hand out."""
        left = self.num_samples - self.consumed
        return left <= 0 or (self.drop_last and left < n * self.world_size)

    def take(self, n: int) -> list[int]:
        """This rank's ``n`` ids of the next global batch; the count advances by the whole batch.

        A new epoch starts when the current one is exhausted. Every rank calls this alike."""
        n = _count("n", n, 1)
        if self.exhausted(n):
            self.epoch, self.consumed = self.epoch + 1, 0
        order = self.order()
        start = self.consumed
        size = n * self.world_size
        end = min(start + size, self.num_samples)
        lo = start + self.rank * n
        mine = [order[i] for i in range(lo, min(lo + n, end))]
        if self.pad and len(mine) < n:
            # The head of this epoch's order fills the last batch, so every rank gets n ids.
            missing = range(max(lo, end) - end, lo + n - end)
            mine += [order[i % self.num_samples] for i in missing]
        self.consumed = end
        return mine

    def remaining(self, n: int) -> int:
        """How many ids this rank still gets in the current epoch with batches of ``n`` per rank."""
        left = max(self.num_samples - self.consumed, 0)
        size = n * self.world_size
        full, rest = divmod(left, size)
        if self.drop_last or not rest:
            return full * n
        return full * n + (n if self.pad else min(max(rest - self.rank * n, 0), n))

    def sampler(self, batch_size: int) -> CursorSampler:
        """A ``torch.utils.data.Sampler`` of this rank's ids, for ``DataLoader(sampler=...,
        generator=torch.Generator())`` (see ``CursorSampler`` for why the loader needs its own
        generator)."""
        return CursorSampler(self, batch_size)

    # ------------------------------------------------------------ state

    def state_dict(self) -> StateDict:
        return {
            "version": STATE_VERSION,
            "num_samples": self.num_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "consumed": self.consumed,
        }

    def load_state_dict(self, sd: StateDict) -> None:
        if not isinstance(sd, dict) or sd.get("version") != STATE_VERSION:
            raise ConfigError(
                f"DataCursor: not a DataCursor state of version {STATE_VERSION}: {sd!r:.200}"
            )
        # A position in another order (other dataset size, seed or shuffling) would read other
        # samples.
        for name in ("num_samples", "seed", "shuffle"):
            if sd.get(name) != getattr(self, name):
                raise ConfigError(
                    f"DataCursor: the saved position is in an order with {name}={sd.get(name)!r}, "
                    f"this cursor has {name}={getattr(self, name)!r}; build the cursor as the "
                    f"saving run did (same dataset size, seed and shuffle), or declare a new "
                    f"contract phase for a new dataset"
                )
        epoch, consumed = sd.get("epoch"), sd.get("consumed")
        if (
            not isinstance(epoch, int)
            or not isinstance(consumed, int)
            or not 0 <= consumed <= self.num_samples
        ):
            raise ConfigError(
                f"DataCursor: saved epoch {epoch!r} / consumed {consumed!r} "
                f"are not a valid position"
            )
        self.epoch, self.consumed = epoch, consumed

    def __repr__(self) -> str:
        return (
            f"DataCursor(num_samples={self.num_samples}, epoch={self.epoch}, "
            f"consumed={self.consumed}, rank={self.rank}/{self.world_size})"
        )


class CursorSampler(torch.utils.data.Sampler[int]):
    """This rank's ids for the rest of the current epoch, taken from a ``DataCursor`` batch by
    batch.

    Use with ``DataLoader(dataset, batch_size=batch_size, sampler=cursor.sampler(batch_size))``.
    The cursor advances when the loader draws a batch's first id, so with ``num_workers=0`` its
    position is exactly what the loop has received. Worker processes draw
    ``prefetch_factor * num_workers`` batches ahead, and a save would then skip those: with
    workers, call ``cursor.take(n)`` in the loop instead and index the dataset with the ids.
    Each ``iter()`` starts the next epoch when the current one is exhausted.

    Give the loader a generator of its own (``generator=torch.Generator()``): ``iter(DataLoader)``
    draws its base seed from it, and without one from torch's global RNG, before step 1 in a fresh
    run but right after ``restore()`` put the saved RNG back in a resumed one, so every later draw
    (dropout) shifts.
    """

    def __init__(self, cursor: DataCursor, batch_size: int) -> None:
        self.cursor = cursor
        self.batch_size = _count("batch_size", batch_size, 1)
        if (
            cursor.world_size > 1
            and not (cursor.drop_last or cursor.pad)
            and cursor.num_samples % (batch_size * cursor.world_size)
        ):
            # The default end of an epoch gives some ranks fewer ids, possibly none: a loader with
            # no last batch on one rank while the others enter one more all-reduce hangs a
            # data-parallel loop.
            log.warning(
                "ckptguard: DataCursor(num_samples=%d).sampler(%d) on %d ranks: the last batch of "
                "an epoch leaves some ranks with fewer ids or none, so their loaders yield a "
                "different number of batches; in a data-parallel loop (equal collectives per step) "
                "use DataCursor(..., pad=True) or drop_last=True",
                cursor.num_samples,
                batch_size,
                cursor.world_size,
            )

    def __iter__(self) -> Iterator[int]:
        c, n = self.cursor, self.batch_size
        if c.exhausted(n):
            c.epoch, c.consumed = c.epoch + 1, 0
        epoch = c.epoch
        while c.epoch == epoch and not c.exhausted(n):
            yield from c.take(n)

    def __len__(self) -> int:
        c = self.cursor
        if c.exhausted(self.batch_size):
            return DataCursor.remaining(_fresh_epoch(c), self.batch_size)
        return c.remaining(self.batch_size)


def _fresh_epoch(c: DataCursor) -> DataCursor:
    probe = DataCursor(
        c.num_samples,
        seed=c.seed,
        shuffle=c.shuffle,
        drop_last=c.drop_last,
        pad=c.pad,
        rank=c.rank,
        world_size=c.world_size,
    )
    probe.epoch = c.epoch + 1
    return probe
