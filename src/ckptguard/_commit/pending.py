"""Async save: the caller blocks only for the snapshot; writing and commit run in the background.

Contract: ``stage`` replaces every tensor of a snapshot by a private copy, into spare GPU
memory when the GPU copies fit ``gpu_bytes``, otherwise into slots of the reusable host
staging pool (``storage._staging``) within ``host_bytes``: the caller waits only until the
copies are queued. What fits neither stays live: the background writer reads it, and the
fence holds the next mutation (optimizer step, ``staged()``) until it has; never a silent
synchronous save. ``coalesce.place_whole`` and ``fill`` stage a snapshot whole or not at all
(``OnBusy.COALESCE``'s queued save: it must never read live tensors), in two steps so that every
rank can agree between them. ``PendingSave`` runs the commit protocol in a thread at lowered CPU and
I/O priority, after the staged copies landed. The tracker moves only when that commit
completes; an error there is kept and raised by ``wait()``, which the manager calls before
its next collective call, so it is never lost.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .._context import Actions, Context
from .._records.entries import Figure
from .._state.state import Captured, KeyFn
from .._types import StateDict
from ..config import CheckpointConfig
from ..memory.budget import host_budget, local_ranks
from ..storage._staging import Fence, HostCopier, StagingPool, copier_for, slot_view
from ..storage._writer import exact
from .ahead import Ahead
from .snapshot import Snapshot, snapshot

log = logging.getLogger("ckptguard")
PREPARE_PATIENCE_S = (
    120  # a preparation this old (a hung pin) no longer holds save_async back (busy.may_start)
)
SMALL_GROW = 64 << 20  # what a save may pin on its thread (ms): a prepared pool's few missing bytes


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def nbytes(t: torch.Tensor) -> int:
    """The bytes of ``t`` this rank stages: its local shard."""
    local = _local(t)
    return local.numel() * local.element_size()


def rewrap(staged: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``staged`` as ``t`` is: the same DTensor placement around the staged local shard."""
    if not hasattr(t, "to_local"):
        return staged

    dt = cast(DTensor, t)  # a DTensor (it has to_local); the stub types it as a plain Tensor
    mesh, placements = dt.device_mesh, dt.placements
    return DTensor.from_local(
        staged, mesh, placements, run_check=False, shape=t.shape, stride=t.stride()
    )


@dataclass
class Staged:
    """What ``stage`` did with a snapshot: where its bytes went and what a mutation must wait
    for."""

    fence: Fence
    gpu_bytes: int = 0
    """Bytes cloned into spare GPU memory."""
    host_bytes: int = 0
    """Bytes copied into the host staging pool."""
    live_bytes: int = 0
    """Bytes that fit neither: the background writer reads them from the live tensors."""
    live_keys: list[str] = field(default_factory=list)
    host_budget: int = 0

    def cost(self, pool: StagingPool | None) -> dict[str, Figure]:
        return {
            "staged_gpu_bytes": self.gpu_bytes,
            "staged_host_bytes": self.host_bytes,
            "live_bytes": self.live_bytes,
            "host_budget_bytes": self.host_budget,
            "host_pool_bytes": pool.held_bytes if pool is not None else 0,
        }


def stage(
    snap: Snapshot,
    *,
    gpu_bytes: int,
    host_bytes: int,
    pool: StagingPool | None,
    timeout_s: float,
    grow: int = 0,
) -> Staged:
    """Make the snapshot independent of the live tensors, within the byte budgets.

    GPU tensors go to spare GPU memory when all of them fit ``gpu_bytes`` (a clone on the caller's
    stream: later kernels are ordered after it); the rest into ``pool`` slots, at most
    ``host_bytes`` in all (``grow``: bytes the pool may map and pin here, on the caller's thread);
    what fits neither stays live and is read by the writer, the fence then holding the next mutation
    until it was."""
    tensors = [(c, k, t) for c in snap.items.values() for k, t in c.tensors.items()]
    on_gpu = sum(nbytes(t) for _, _, t in tensors if _local(t).is_cuda)
    gpu_fits = on_gpu > 0 and on_gpu <= gpu_bytes and torch.cuda.mem_get_info()[0] > on_gpu
    for item in snap.items.values():
        # Plain values, PerRank values and stateful state are live objects too: a counter the
        # trainer bumps while the commit runs must not change what is saved.
        item.skeleton = copy.deepcopy(item.skeleton)
    out = Staged(fence=HostCopier().fence(live=False, timeout_s=timeout_s), host_budget=host_bytes)
    gpu_event = None
    to_host = []
    for item, key, t in tensors:
        local = exact(t)
        if local.is_cuda and gpu_fits:
            item.tensors[key] = rewrap(local.clone(), t)
            out.gpu_bytes += nbytes(t)
        elif local.numel() == 0:
            item.tensors[key] = rewrap(torch.empty(local.shape, dtype=local.dtype), t)
        else:
            to_host.append((item, key, t, local))
    if gpu_fits:
        gpu_event = torch.cuda.Event()
        gpu_event.record()
    slots: list[torch.Tensor | None] = []
    if to_host and pool is not None:
        sizes = [nbytes(t) for _, _, t, _ in to_host]
        # Never map or pin on the caller's thread: what the pool cannot hold yet is read live this
        # time (the fence holds the next mutation until it was), and the pool grows in the
        # background.
        slots = pool.place(sizes, host_bytes, grow=grow)
        if host_bytes and any(s is None for s in slots) and not pool.growing:
            pool.grow_async(sizes, host_bytes)  # the state grew: more room, off this thread
    copier = copier_for([local for *_, local in to_host])
    for i, (item, key, t, local) in enumerate(to_host):
        slot = slots[i] if i < len(slots) else None
        if slot is None:
            out.live_bytes += nbytes(t)
            out.live_keys.append(key)
            continue
        dst = slot_view(slot, local)
        copier.copy(dst, local)
        item.tensors[key] = rewrap(dst, t)
        out.host_bytes += nbytes(t)
    out.fence = copier.fence(live=out.live_bytes > 0, timeout_s=timeout_s)
    if gpu_event is not None:
        out.fence.also_wait(gpu_event)
    snap.staged_bytes = out.gpu_bytes + out.host_bytes
    return out


class AsyncStaging:
    """A manager's host staging: the pool (created at the first ``save_async``, reused, released
    by ``close()`` or after ``async_pool_idle_s``), the host budget (derived once, logged once)
    and the hooks that make the next mutation wait for a save's fence."""

    def __init__(self) -> None:
        self.pool: StagingPool | None = None
        self.budget: int | None = None
        self.budget_why = ""
        self.preparing: Future[int] | None = None
        self._preparing_bytes = (
            0  # what the preparation in flight grows the pool to (before the budget)
        )
        self._preparing_since, self._patience_said = 0.0, False
        self._handles: list[Any] = []
        self.ahead = Ahead()

    def unready_bytes(self) -> int:
        """Bytes the staging being prepared in the background still lacks (0: none being prepared,
        or a preparation past ``PREPARE_PATIENCE_S``: saves then read live rather than be skipped
        without end)."""
        pool = self.pool
        if pool is None or not (
            pool.growing or (self.preparing is not None and not self.preparing.done())
        ):
            return 0
        if time.monotonic() - self._preparing_since > PREPARE_PATIENCE_S:
            if not self._patience_said:
                self._patience_said = True
                log.warning(
                    "ckptguard: the host staging has been prepared for over %d s (%d of %d B): "
                    "save_async stops waiting for it and reads the rest live",
                    PREPARE_PATIENCE_S,
                    pool.held_bytes,
                    self._preparing_bytes,
                )
            return 0
        return max(0, self._preparing_bytes - pool.held_bytes)

    def host_budget(self, config: CheckpointConfig) -> int:
        if self.budget is None:
            if config.async_save.host_bytes is not None:
                self.budget, self.budget_why = (
                    config.async_save.host_bytes,
                    "CheckpointConfig.async_save.host_bytes",
                )
            else:
                found = host_budget(ranks_per_node=local_ranks())
                self.budget, self.budget_why = found.bytes, found.why
            log.debug(
                "ckptguard: save_async host staging budget %d B per rank (%s)",
                self.budget,
                self.budget_why,
            )
        return self.budget

    def prepare(
        self, items: dict[str, Captured], config: CheckpointConfig, *, gpu_bytes: int | None = None
    ) -> Future[int]:
        """Derive the host budget (a memory probe: about 1 s) and grow the pool to what ``items``
        stage into the host, in the background (``prepare_async``, or the first ``save_async``
        without it). ``gpu_bytes``: what may go to spare GPU memory instead (None:
        ``async_gpu_bytes``; 0: everything to the host)."""
        pool = self.pool_for(items, config)
        tensors = [t for c in items.values() for t in c.tensors.values()]
        on_gpu = sum(nbytes(t) for t in tensors if _local(t).is_cuda)
        gpu_fits = 0 < on_gpu <= (config.async_save.gpu_bytes if gpu_bytes is None else gpu_bytes)
        sizes = [nbytes(t) for t in tensors if nbytes(t) and not (gpu_fits and _local(t).is_cuda)]
        done: Future[int] = Future()
        self._preparing_bytes, self._preparing_since, self._patience_said = (
            sum(sizes),
            time.monotonic(),
            False,
        )

        def run() -> None:
            try:
                done.set_result(pool.grow_async(sizes, self.host_budget(config)).result())
            except (
                BaseException
            ) as exc:  # the future carries it; a later save_async reads live meanwhile
                done.set_exception(exc)

        self.preparing = done
        threading.Thread(target=run, name="ckptguard-prepare", daemon=True).start()
        return done

    def known(self, state: StateDict, keyfn: KeyFn, config: CheckpointConfig) -> None:
        """The state is known (``restore``): prepare the pool for it in the background
        (``ahead.Ahead``: a fresh optimizer after its first step), so the first ``save_async`` costs
        what later ones cost. Unused, the pool goes after ``AsyncOptions.pool_idle_s``."""
        if self.preparing is None and not (self.pool is not None and self.pool.held_bytes):
            self.ahead.arm(state, keyfn, self._prepared_ahead, config)

    def _prepared_ahead(self, items: dict[str, Captured], config: CheckpointConfig) -> None:
        done, pool = self.prepare(items, config), self.pool
        if pool is not None:
            done.add_done_callback(lambda _: pool.idle_from_now())

    def pool_for(self, items: dict[str, Captured], config: CheckpointConfig) -> StagingPool:
        pin = torch.cuda.is_available() and any(
            _local(t).is_cuda for c in items.values() for t in c.tensors.values()
        )
        if self.pool is not None and pin and not self.pool.pin:
            self.pool.release()  # a CPU-only state's pool cannot serve non-blocking D2H copies
            self.pool = None
        if self.pool is None:
            self.pool = StagingPool(pin=pin, idle_s=config.async_save.pool_idle_s)
        return self.pool

    def stage(self, snap: Snapshot, state: StateDict, config: CheckpointConfig) -> Staged:
        self.ahead.stop()
        pool = self.pool_for(snap.items, config)
        if self.budget is None and self.preparing is None:
            self.prepare(
                snap.items, config
            )  # no prepare_async: this first save reads live, never pins here
        budget = self.budget if self.budget is not None else 0
        # A pool being prepared in the background is waited for by nothing: what it lacks is read
        # live this once.
        preparing = pool.growing or (self.preparing is not None and not self.preparing.done())
        staged = stage(
            snap,
            gpu_bytes=config.async_save.gpu_bytes,
            host_bytes=budget,
            pool=pool,
            timeout_s=config.timeout_s,
            grow=0 if preparing else SMALL_GROW,
        )
        snap.read_done = staged.fence.live_read
        snap.cost = {
            **staged.cost(pool),
            "host_budget_why": self.budget_why,
            "host_pool_release": "close()"
            + (
                f" or {config.async_save.pool_idle_s:g} s without a save_async"
                if config.async_save.pool_idle_s
                else ""
            ),
        }
        self.guard(staged.fence, state)
        if staged.live_bytes:
            # Growing in the background (the first save_async): this once, the documented wait, said
            # quietly.
            ready = pool.growing or (self.preparing is not None and not self.preparing.done())
            log.log(
                logging.INFO if ready else logging.WARNING,
                "ckptguard: step %d: %d of %d B are not staged (host staging budget %d B, pool %d "
                "B%s): the background writer reads them from the live tensors, and the next "
                "optimizer step waits until it has (see PendingSave.mutation_wait_seconds); raise "
                "CheckpointConfig.async_save.host_bytes to stage them, or call "
                "prepare_async(state) ahead of the first save_async",
                snap.step,
                staged.live_bytes,
                staged.live_bytes + snap.staged_bytes,
                staged.host_budget,
                pool.held_bytes,
                ", growing in the background" if ready else "",
            )
        return staged

    def guard(self, fence: Fence, state: StateDict) -> None:
        """Hold the next optimizer step (any optimizer), and the next forward of a module whose
        saved state has buffers (running statistics change in forward), until ``fence`` allows
        mutation."""
        self.unguard()
        handles: list[Any] = []
        armed = [True]

        def before(*_: Any) -> None:
            # Disarm, never remove here: torch iterates its hook dicts while calling them, and
            # removing one then raises "OrderedDict mutated during iteration" in the user's
            # optimizer.step() whenever another hook (another manager's, FSDP's) is registered.
            # The handles go at the next save_async or close() (unguard).
            if armed[0]:
                armed[0] = False
                fence.before_mutation()

        handles.append(register_optimizer_step_pre_hook(before))
        for value in state.values():
            if isinstance(value, torch.nn.Module) and _has_saved_buffers(value):
                handles.append(value.register_forward_pre_hook(before))
        self._handles = handles

    def unguard(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def close(self) -> None:
        self.unguard()
        self.ahead.stop()
        if self.preparing is not None:  # a region pinned after the release would outlive close()
            if self.pool is not None:
                self.pool.stop_growing()
            wait_futures([self.preparing], timeout=600)
            self.preparing = None
        if self.pool is not None:
            self.pool.release()
            self.pool = None


def _has_saved_buffers(module: torch.nn.Module) -> bool:
    """A persistent buffer anywhere in the module (running statistics); read without state_dict(),
    whose hooks (FSDP's) must not run on every save."""
    return any(
        b is not None and name not in m._non_persistent_buffers_set
        for m in module.modules()
        for name, b in m._buffers.items()
    )


def staged_snapshot(
    ctx: Context,
    staging: AsyncStaging,
    step: int,
    state: StateDict,
    actions: Actions,
    cost: Callable[[], Mapping[str, Figure]],
) -> tuple[Snapshot, Fence]:
    """The snapshot of ``state`` with its copies queued into ``staging`` (a run stages each role's),
    and the fence the next mutation waits on."""
    # The divergence guard hashes every tensor: on the staged copies, in the background.
    snap = snapshot(ctx, step, state, guard=False, actions=actions)
    staged = staging.stage(snap, state, ctx.config)
    snap.cost.update(cost())
    snap.resumed = time.monotonic()
    return snap, staged.fence
