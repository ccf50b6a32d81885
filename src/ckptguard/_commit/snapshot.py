"""Step 0 of a save: the snapshot of the state (taken in the caller's thread) and the divergence
guard.

DCP keeps one copy per (key, offset): a replicated tensor that differs across ranks would come
back as one rank's bytes, so the guard refuses it before anything is written.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from .._agree import gather_decide, on_every_rank
from .._context import NO_ACTIONS, Actions, Context
from .._disk.digest import digest
from .._records.entries import Figure
from .._state import rng as _rng
from .._state.state import Captured, capture
from .._types import StateDict
from ..errors import (
    ReplicatedDivergenceError,
    StateMismatchError,
)
from .messages import ChunkDigests, ChunkVerdict


@dataclass
class Snapshot:
    """What a save writes, taken in the caller's thread: the blocking part of a save."""

    step: int
    items: dict[str, Captured]
    rng: Any
    started: float
    staged_bytes: int = 0
    reshard: dict[str, dict[str, Any]] = field(default_factory=dict)
    cost: dict[str, Figure] = field(default_factory=dict)
    """Figures of the staging (async saves) added to the manifest's cost block."""
    read_done: Callable[[], None] | None = None
    """Called once the write and the digest pass no longer read the snapshot's tensors."""
    resumed: float | None = None
    """monotonic time the caller got control back (async saves), for the step time in the cost
    block."""
    guarded: bool = True
    """False: the divergence guard has not run yet; ``commit`` runs it first."""
    actions: Actions = NO_ACTIONS
    """The one-shot actions of this save (``overwrite``, ``break_lease``)."""


def snapshot(
    ctx: Context, step: int, state: StateDict, *, guard: bool = True, actions: Actions = NO_ACTIONS
) -> Snapshot:
    """Capture every item and the RNG streams, and run the divergence guard (``guard=False``: the
    commit runs it, on the staged copies, so an async save's caller does not wait for its
    digests)."""
    started = time.monotonic()

    def take() -> tuple[dict[str, Captured], Any]:
        return capture(state, ctx.keyfn()), (
            _rng.capture() if ctx.config.state.capture_rng else None
        )

    items, rng = on_every_rank(ctx.agreement, "save.capture", take)
    if guard:
        check_replicated(ctx, items, step)
    return Snapshot(
        step, items, rng, started, reshard=ctx.declared_rules(state), guarded=guard, actions=actions
    )


def check_replicated(ctx: Context, items: dict[str, Captured], step: int) -> None:
    """Refuse two ranks holding the same (key, offset) chunk with different bytes.

    DCP keeps one copy per (key, offset): a plain tensor that differs per rank, or an
    expert shard whose FSDP offset repeats in another EP group, would come back as some
    other rank's bytes, silently.
    """
    if ctx.world == 1:
        return
    mine = ChunkDigests(
        {_chunk_id(k, t): digest(t) for c in items.values() for k, t in c.tensors.items()},
        {name: c.kind.value for name, c in items.items()},
    )
    verdict = gather_decide(
        ctx.agreement, "save.chunks", mine, _divergent_chunks, decision=ChunkVerdict
    )
    if verdict.kinds:
        # Committed, such a step could not be restored by any fresh process: one rank's
        # extras hold a value where the DCP files hold a tensor.
        listing = "; ".join(
            f"{item!r}: "
            + ", ".join(
                f"{kind} on rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}"
                for kind, r in by.items()
            )
            for item, by in verdict.kinds
        )
        raise StateMismatchError(
            f"save of step {step}: state items differ in kind across ranks ({listing}); "
            f"every rank must pass the same items with the same kinds (wrap per-rank "
            f"values in ckptguard.PerRank(...))"
        )
    bad = [(c, g) for c, g in verdict.bad]
    if not bad:
        return
    plain = [
        f"{c.rsplit('@', 1)[0]} (ranks grouped by content: {g})"
        for c, g in bad
        if c.endswith("@()")
        or set(c.rsplit("@", 1)[1].strip("(),").replace(" ", "").split(",")) <= {"0", ""}
    ]
    shown = (
        plain
        if len(plain) == len(bad)
        else [f"{c} (ranks grouped by content: {g})" for c, g in bad]
    )
    raise ReplicatedDivergenceError(
        f"save of step {step}: {len(bad)} tensor chunk(s) are held by several ranks with different "
        f"bytes, and DCP stores one copy per key and offset, so restore would hand them one rank's "
        f"copy: {'; '.join(shown[:10])}{' ...' if len(bad) > 10 else ''}. Wrap per-rank values in "
        f"ckptguard.PerRank(...), make them DTensors, or, for expert-parallel state, pass "
        f"CheckpointManager(expert_parallel=ExpertParallel(group=ep_group)) so expert keys carry "
        f"the EP rank."
    )


def _chunk_id(key: str, t: torch.Tensor) -> str:
    """Where DCP files this rank's piece of ``key``: the key and the chunk's global offset."""
    if hasattr(t, "device_mesh") and hasattr(t, "placements"):
        offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)[1]
        return f"{key}@{tuple(int(o) for o in offsets)}"
    return f"{key}@{(0,) * t.dim()}"


def _divergent_chunks(views: list[ChunkDigests]) -> ChunkVerdict:
    holders: dict[str, dict[str, list[int]]] = {}
    for rank, view in enumerate(views):
        for chunk, dig in view.chunks.items():
            holders.setdefault(chunk, {}).setdefault(dig, []).append(rank)
    kinds: dict[str, dict[str, list[int]]] = {}
    for rank, view in enumerate(views):
        for item, kind in view.kinds.items():
            kinds.setdefault(item, {}).setdefault(kind, []).append(rank)
    for item in kinds:
        absent = [r for r, v in enumerate(views) if item not in v.kinds]
        if absent:
            kinds[item]["absent"] = absent
    return ChunkVerdict(
        [[c, sorted(g.values())] for c, g in sorted(holders.items()) if len(g) > 1],
        [[item, by_kind] for item, by_kind in sorted(kinds.items()) if len(by_kind) > 1],
    )


def resumed(snap: Snapshot) -> float:
    # Training resumed when the caller got control back: at the end of a sync save, but right
    # after the snapshot of an async one (its commit overlaps the steps that follow).
    return snap.resumed if snap.resumed is not None else time.monotonic()
