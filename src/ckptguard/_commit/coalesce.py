"""``OnBusy.COALESCE``: at most one save staged while a commit runs, started only at an agreed
point.

Contract. A ``save_async`` that the busy round finds busy (a commit in flight on any rank) is
snapshotted now, on the busy round's agreement (the commit thread agrees on the manager's), into the
staging set that the running commit does not read, whole or not at all, and queued: not started.
Every rank first places its slots and says whether its whole snapshot fits (``save.queue``); rank 0
decides for all, so the queue is the same on every rank: when any rank cannot hold its snapshot (it
must never read live tensors: they change before it starts), every rank skips the request, with the
reason, and keeps what it had queued. A request while one is queued replaces it (the newest wins;
the replaced step is counted and recorded as coalesced, with its reason). The queued save starts
only in the caller's thread, at a point every rank reaches alike: a busy round that finds every
rank's commit ended (``poll``; a ``save_async`` there replaces it by its newer step instead), or
``wait()``, which every rank calls, after its own commit ended. No commit thread starts it on its
own, so no rank can have started a queued save that another rank replaced; the busy round also
checks that every rank holds the same queued step.

Host memory. Under the derived host budget (``AsyncOptions.host_bytes`` None), both sets together
stay within ``HOST_FACTOR`` (1.05x) the state's bytes: a request whose snapshot would take them
beyond it is skipped, its reason naming the figure (a second set beside a full first one is 2.0x,
issue 41). An explicit ``host_bytes`` is the caller's allowance for both sets together (twice the
state lets every request queue).
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from .._agree import Wire, gather_decide
from .._context import Actions, Context
from .._records.entries import Figure
from .._state.state import Captured
from .._types import StateDict
from ..config import CheckpointConfig, OnBusy
from ..storage._staging import Fence, HostCopier, StagingPool, copier_for, slot_view
from ..storage._writer import exact
from .busy import BusyDecision, BusyRound, InFlight, may_start, settle
from .pending import AsyncStaging, Staged, nbytes, rewrap
from .savehandle import PendingSave, committer
from .snapshot import Snapshot, snapshot

T = TypeVar("T")

HOST_FACTOR = 1.05
"""Host staging of both sets together, as a multiple of the state, under the derived budget (issue
41)."""


def state_bytes(items: Mapping[str, Captured]) -> int:
    """The bytes a whole snapshot of ``items`` stages (the local shards)."""
    return sum(nbytes(t) for item in items.values() for t in item.tensors.values())


@dataclass(frozen=True)
class HoldView(Wire):
    """One rank's answer: whether its snapshot of the request fits its second staging set whole."""

    whole: bool
    why: str = ""


@dataclass(frozen=True)
class HoldVerdict(Wire):
    """Rank 0's: queue the request on every rank, or skip it on every rank (``why``: which rank,
    why)."""

    whole: bool
    why: str = ""


def decide_hold(views: list[HoldView]) -> HoldVerdict:
    short = [(rank, v.why) for rank, v in enumerate(views) if not v.whole]
    if not short:
        return HoldVerdict(whole=True)
    rank, why = short[0]
    more = f" (ranks {[r for r, _ in short[1:]]} neither)" if len(short) > 1 else ""
    return HoldVerdict(
        whole=False, why=f"rank {rank} cannot hold the snapshot whole in host memory{more}: {why}"
    )


@dataclass
class Queued:
    """A save snapshotted and staged while a commit ran, not started (``SaveQueue.queued``)."""

    step: int
    snap: Snapshot
    staged: Staged
    staging: AsyncStaging
    requested: float
    """monotonic time of the request (the commit's seconds count from it)."""
    blocked_s: float
    """How long the request held the caller (the snapshot and its copies)."""
    health: tuple[bool | None, Any, Any]
    """The request's ``healthy``, ``loss`` and ``grad_norm``: the health agreement runs when it
    starts."""

    @property
    def resumed(self) -> float:
        """When its request gave the caller control back."""
        return self.requested + self.blocked_s

    def prepared(
        self, cost: Mapping[str, Figure], commit: Callable[[Snapshot, float, float, bool], Path]
    ) -> tuple[Callable[[], Path], Fence, float]:
        """What ``CheckpointManager.start_commit`` starts: its commit (its cost block gets ``cost``
        and the seconds it waited in the queue), its fence, its request time."""
        self.snap.cost.update({**cost, "queued_s": round(time.monotonic() - self.resumed, 4)})
        return (
            committer(commit, self.snap, self.requested, self.staging.pool),
            self.staged.fence,
            self.requested,
        )

    def drop(self, *, unguard: bool = True) -> None:
        """Release its slots (and the mutation hooks of its set, unless a newer save of that set
        holds them)."""
        self.staged.fence.live_read()
        if self.staging.pool is not None:
            self.staging.pool.done()
        if unguard:
            self.staging.unguard()
        return None


@dataclass
class Placement:
    """A snapshot's slots in a pool, not filled yet (``place_whole``)."""

    snap: Snapshot
    pool: StagingPool
    entries: list[tuple[Captured, str, torch.Tensor, torch.Tensor, torch.Tensor]]
    """(item, key, tensor, its exact local tensor, its slot)."""
    budget: int = 0
    """The host bytes this set could hold (for the cost block)."""

    def release(self) -> None:
        self.pool.done()


def place_whole(
    staging: AsyncStaging, snap: Snapshot, config: CheckpointConfig, budget: int
) -> Placement | str:
    """A host slot for every tensor of ``snap`` in this set's pool (within ``budget``), or why not
    (nothing placed then; the pool grows toward it in the background). Copies nothing: ``fill``
    does, once agreed. Placing resets the pool's slots: what this set held before stays intact until
    ``fill`` runs."""
    pool = staging.pool_for(snap.items, config)
    for item in snap.items.values():
        item.skeleton = copy.deepcopy(
            item.skeleton
        )  # the values the trainer bumps before it starts
    entries = []
    for item in snap.items.values():
        for key, t in item.tensors.items():
            local = exact(t)
            if local.numel() == 0:
                item.tensors[key] = rewrap(torch.empty(local.shape, dtype=local.dtype), t)
            else:
                entries.append((item, key, t, local))
    sizes = [nbytes(t) for _, _, t, _ in entries]
    want = sum(sizes)
    if pool.growing:
        return f"its host staging set for {want} B is still being allocated in the background"
    slots = pool.place(sizes, budget, grow=0)
    if all(slot is not None for slot in slots):
        placed = [(*e, slot) for e, slot in zip(entries, slots, strict=True) if slot is not None]
        return Placement(snap, pool, placed, budget)
    pool.done()
    if budget >= pool.held_bytes + pool.missing(sizes):
        pool.grow_async(sizes, budget)
        return (
            f"its host staging set for {want} B was not allocated yet (now being allocated in "
            "the background)"
        )
    return (
        f"it needs {want} B of host staging beside the commit's, and {budget} B of the "
        f"host staging budget are left (raise CheckpointConfig.async_save.host_bytes to "
        f"twice the state's bytes)"
    )


def fill(staging: AsyncStaging, placed: Placement, state: StateDict, timeout_s: float) -> Staged:
    """Copy ``placed``'s tensors into their slots; the next mutation waits for the copies (never for
    a live read: there is none)."""
    copier = copier_for([local for _, _, _, local, _ in placed.entries])
    out = Staged(
        fence=HostCopier().fence(live=False, timeout_s=timeout_s), host_budget=placed.budget
    )
    for item, key, t, local, slot in placed.entries:
        dst = slot_view(slot, local)
        copier.copy(dst, local)
        item.tensors[key] = rewrap(dst, t)
        out.host_bytes += nbytes(t)
    out.fence = copier.fence(live=False, timeout_s=timeout_s)
    placed.snap.staged_bytes = out.host_bytes
    placed.snap.cost = out.cost(placed.pool)
    staging.guard(out.fence, state)
    return out


class SaveQueue:
    """One front door's queue of ``OnBusy.COALESCE`` and its two staging sets: ``primary`` (the
    front door's own) and a spare one; a queued save stages into whichever set the running commit
    does not read."""

    def __init__(self, busy: BusyRound, primary: AsyncStaging, record: Callable[..., None]) -> None:
        self.busy = busy
        self.sets = (primary, AsyncStaging())
        self.reading = primary
        """The set the last started commit reads."""
        self.queued: Queued | None = None
        """The save queued now, not started (the same step on every rank)."""
        self._record = record

    @property
    def queued_step(self) -> int | None:
        return self.queued.step if self.queued is not None else None

    def admit(
        self,
        step: int,
        pending: InFlight | None,
        ctx: Context,
        state: StateDict,
        actions: Actions,
        health: tuple[bool | None, Any, Any],
        *,
        wait: Callable[[], Any],
    ) -> bool:
        """``CheckpointConfig.async_save.on_busy`` for a ``save_async`` of ``step``: True when it
        starts now; False when it was skipped or queued, alike on every rank (``may_start``, or
        ``request`` under ``OnBusy.COALESCE``)."""
        if ctx.config.async_save.on_busy is not OnBusy.COALESCE:
            return may_start(
                self.busy,
                step,
                pending,
                ctx.config.async_save.on_busy,
                wait=wait,
                record=self._record,
                unready=self.sets[0].unready_bytes(),
            )
        return self.request(step, pending, ctx, state, actions, health, start=lambda: True) or False

    def request(
        self,
        step: int,
        pending: InFlight | None,
        ctx: Context,
        state: StateDict,
        actions: Actions,
        health: tuple[bool | None, Any, Any],
        *,
        start: Callable[[], T],
    ) -> T | None:
        """A ``save_async`` of ``step`` under ``OnBusy.COALESCE``: ``start()`` at once when every
        rank's commit ended (a queued save is replaced by it), else snapshotted and queued, or
        skipped, alike on every rank; None when not started."""
        config = ctx.config
        self.busy.request(step)
        decision = self._round(step, pending)
        if not decision.busy:
            settle(self.busy, pending)
            if self.queued is not None:
                self._supersede(
                    step,
                    "every rank's commit had ended when it was requested: the newest wins",
                    unguard=True,
                )
            self.reading = self.sets[0]
            return start()
        began = time.monotonic()
        target = self.spare()
        # The commit thread agrees on the front door's agreement: this snapshot's round runs on the
        # busy one.
        snap = snapshot(
            dataclasses.replace(ctx, agreement=self.busy.agreement),
            step,
            state,
            guard=False,
            actions=actions,
        )
        budget = self.budget(target, config, state_bytes(snap.items))
        placed = place_whole(target, snap, config, budget) if isinstance(budget, int) else budget
        mine = (
            HoldView(whole=True)
            if not isinstance(placed, str)
            else HoldView(whole=False, why=placed)
        )
        verdict = gather_decide(
            self.busy.agreement, "save.queue", mine, decide_hold, decision=HoldVerdict
        )
        if not verdict.whole or isinstance(placed, str):
            if not isinstance(placed, str):
                placed.release()  # what was queued before stays queued, its bytes untouched
            self._skip(step, decision, f"not queued: {verdict.why}")
            return None
        staged = fill(target, placed, state, config.timeout_s)
        snap.resumed = time.monotonic()
        if self.queued is not None:
            # Filled into the same set: its mutation hooks are the new save's now.
            self._supersede(
                step, f"requested while {self.busy.running_reason(decision)}", unguard=False
            )
        self.queued = Queued(step, snap, staged, target, began, snap.resumed - began, health)
        self._record("busy_queue", durable=False, step=step, running=decision.running)
        return None

    def poll(self, pending: InFlight | None, healthy: Callable[..., bool]) -> Queued | None:
        """Collective when a save is queued (on every rank alike, then): when every rank's commit
        ended, the queued save taken out to be started (``take``); None otherwise."""
        if (
            self.queued is None
        ):  # the same on every rank: queued and replaced only on agreed verdicts
            return None
        if not self._round(self.queued.step, pending).busy:
            settle(self.busy, pending)
            return self.take(healthy)
        return None

    def take(self, healthy: Callable[..., bool]) -> Queued | None:
        """The queued save, out of the queue, once its request's health agreement (``healthy(step,
        healthy, loss, grad_norm)``, collective) passed; an unhealthy one is dropped. ``wait()``:
        every rank's own commit ended."""
        queued, self.queued = self.queued, None
        if queued is None:
            return None
        if not healthy(queued.step, *queued.health):
            queued.drop()
            return None
        self.reading = queued.staging
        return queued

    def spare(self) -> AsyncStaging:
        return self.sets[1] if self.reading is self.sets[0] else self.sets[0]

    def budget(self, target: AsyncStaging, config: CheckpointConfig, want: int) -> int | str:
        """The host bytes ``target`` may hold for a snapshot of ``want`` bytes: the front door's
        host staging budget less what the other set holds (both are alive at once); under the
        derived budget also within ``HOST_FACTOR`` the state, or why not (with the figure)."""
        other = self.sets[1] if target is self.sets[0] else self.sets[0]
        held = other.pool.held_bytes if other.pool is not None else 0
        if config.async_save.host_bytes is not None:
            return max(0, config.async_save.host_bytes - held)
        cap = int(HOST_FACTOR * want)
        if held + want > cap:
            return (
                f"its snapshot ({want} B) beside the {held} B the commit's staging set "
                f"holds would keep {(held + want) / max(want, 1):.2f}x the state in host "
                f"memory, over OnBusy.COALESCE's {HOST_FACTOR}x ({cap} B); set "
                f"CheckpointConfig.async_save.host_bytes to {held + want} B or more to "
                f"allow it, or use OnBusy.SKIP"
            )
        total = self.sets[0].budget
        if total is None:
            return (
                "the host staging budget is still being derived (the first save_async's "
                "background probe)"
            )
        return max(0, min(total, cap) - held)

    def known(self, state: StateDict, ctx: Context) -> None:
        """The state is known (``restore``): the primary set prepares for it in the background
        (``AsyncStaging.known``); ``prepare_async`` also grows the spare set."""
        self.sets[0].known(state, ctx.keyfn(), ctx.config)

    def prepare(self, items: dict[str, Captured], config: CheckpointConfig) -> Future[int]:
        """``prepare_async``: the primary set's ``prepare``; under ``OnBusy.COALESCE`` then the
        spare set grown to ``items`` (all to the host) within what the budget leaves, in the
        background; a future of the bytes added."""
        first = self.sets[0].prepare(items, config)
        if config.async_save.on_busy is not OnBusy.COALESCE:
            return first
        done: Future[int] = Future()
        spare = self.sets[1]

        def run() -> None:
            try:
                added = first.result()
                budget = self.budget(spare, config, state_bytes(items))
                spare.budget = budget if isinstance(budget, int) else 0
                done.set_result(added + spare.prepare(items, config, gpu_bytes=0).result())
            except (
                BaseException
            ) as exc:  # the future carries it; a coalesced request skips meanwhile
                done.set_exception(exc)

        threading.Thread(target=run, name="ckptguard-prepare-queue", daemon=True).start()
        return done

    def staged(self, pending: PendingSave | None) -> float:
        """``staged()`` for the save in flight and the queued one's copies; the seconds it
        blocked."""
        waited = self.queued.staged.fence.before_mutation() if self.queued is not None else 0.0
        return waited + (
            pending.fence.before_mutation() if pending is not None and pending.fence else 0.0
        )

    def close(self, wait: Callable[[], Any]) -> None:
        """``wait()`` (it commits a queued save), then drop what is still queued (its error stopped
        it) and release both sets, also when it raised."""
        try:
            wait()
        finally:
            if self.queued is not None:
                self.queued.drop()
                self.queued = None
            for staging in self.sets:
                staging.close()

    def _round(self, step: int, pending: InFlight | None) -> BusyDecision:
        running = pending if pending is not None and pending.busy() else None
        return self.busy.round(
            step,
            running.step if running else None,
            running.running_seconds() if running else 0.0,
            queued=self.queued_step,
        )

    def _supersede(self, by: int, reason: str, *, unguard: bool) -> None:
        old, self.queued = self.queued, None
        assert old is not None
        old.drop(unguard=unguard)
        gone = self.busy.coalesce(old.step, by, reason)
        self._record("busy_coalesced", durable=False, step=old.step, by=by, reason=gone.reason)

    def _skip(self, step: int, decision: BusyDecision, why: str) -> None:
        skipped = self.busy.skip(step, decision, why=why)
        self._record(
            "busy_skip",
            durable=False,
            step=step,
            running=decision.running,
            reason=skipped.reason,
            policy="coalesce",
        )
