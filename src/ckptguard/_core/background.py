"""A ``CheckpointManager``'s commits in the background: ``save_async``'s, a queued one's, an
over-budget save's.

``stage`` runs the caller's part (the health agreement, the snapshot with its copies queued into
spare GPU memory or the host staging pool: ``_commit.pending``), ``begin`` starts the commit in a
``PendingSave``'s thread, ``queued`` starts the save ``OnBusy.COALESCE`` queued once every rank's
commit ended, and ``request`` is a ``save_async`` through the ``on_busy`` round
(``_commit.coalesce``), or a synchronous ``save`` estimated over ``CheckpointConfig.blocking``
(``_commit.budget``). The manager keeps the save in flight, which its ``wait`` reads on every save's
walk: each call here hands back the ``PendingSave`` it started. A synchronous save within its budget
and a restore never enter this module.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._commit import pending as _async
from .._commit import protocol as _commit
from .._commit.budget import BudgetRound
from .._commit.busy import BusyRound
from .._commit.coalesce import Queued, SaveQueue
from .._commit.savehandle import PendingSave, committer
from .._commit.snapshot import Snapshot
from .._context import NO_ACTIONS, Actions, Context
from .._dist import make_agreement
from .._types import StateDict
from .parts import Parts, Staged
from .root import Root
from .rootstage import RootStage


class BackgroundCommits:
    """The rounds, the staging sets and the calls a manager's background commits run on.

    ``healthy`` is the manager's health agreement of a save, ``published`` what follows its commits,
    ``cleanup`` its retention after one, ``wait`` its wait for the save in flight (the ``WAIT``
    policy), ``start`` its start of a staged commit (it keeps the save in flight). A door that made
    the manager with its ``Parts`` (the tiers, Megatron's async save) gets ``stage``, ``start`` and
    ``cleanup`` bound into them."""

    def __init__(
        self,
        ctx: Context,
        stage: RootStage,
        core: Root,
        parts: Parts | None,
        *,
        name: str,
        process_group: Any,
        healthy: Callable[..., bool],
        published: Callable[..., Path],
        cleanup: Callable[[int], None],
        wait: Callable[[], Any],
        start: Callable[[int, Staged, float], PendingSave],
    ) -> None:
        self.ctx, self.root_stage, self.core = ctx, stage, core
        self.healthy, self.published, self.cleanup, self.wait = healthy, published, cleanup, wait
        config = ctx.config
        # Its own agreement: the busy round runs in the caller's thread while a commit agrees in its
        # own.
        busy = make_agreement(process_group, timeout_s=config.timeout_s, namespace=f"{name}-busy")
        self.busy = BusyRound(busy, policy=config.async_save.on_busy)
        self.staging = (
            parts.staging
            if parts is not None and parts.staging is not None
            else _async.AsyncStaging()
        )
        self.queue = SaveQueue(self.busy, self.staging, core.proof.record)
        # On the busy agreement: a save over the budget runs its round beside the commit in flight
        # (issue 41).
        self.blocking = BudgetRound(
            self.busy.agreement, ctx.world, process_group, config.blocking, ctx.root, ctx.storage
        )
        if parts is not None:  # the door that made this manager drives these
            parts.bind(ctx, stage, self.stage, start, cleanup, core.restarted_at)

    def request(
        self,
        step: int,
        state: StateDict,
        actions: Actions,
        health: tuple[Any, ...],
        previous: PendingSave | None,
        measure: bool = False,
    ) -> PendingSave | None:
        """A save to commit in the background, through the ``on_busy`` round (``health``: its
        ``healthy``, ``loss`` and ``grad_norm``): the commit started, or None (skipped, queued or
        unhealthy, alike on every rank)."""
        healthy, loss, grad_norm = health
        health_args = (healthy, loss, grad_norm)
        if not self.queue.admit(
            step, previous, self.ctx, state, actions, health_args, wait=self.wait
        ):
            return None
        prepared = self.stage(step, state, healthy, loss, grad_norm, actions, measure=measure)
        return (
            None
            if prepared is None
            else self.begin(step, prepared, time.monotonic(), after=previous)
        )

    def queued(self, queued: Queued, after: PendingSave | None) -> PendingSave:
        """The commit of a queued save whose health agreement passed, in the background."""
        prepared = queued.prepared(self.busy.pending_cost(), self.commit)
        return self.begin(queued.step, prepared, queued.resumed, after=after)

    def begin(
        self, step: int, prepared: Staged, resumed: float, *, after: PendingSave | None = None
    ) -> PendingSave:
        """The commit ``stage`` prepared, started in the background (``resumed``: when the caller
        got control back; ``after``: the save whose commit it follows)."""
        run, fence, start = prepared
        return PendingSave(
            step,
            run,
            resumed - start,
            fence=fence,
            started=start,
            cleanup=lambda: self.cleanup(step),
            after=after,
        )

    def stage(
        self,
        step: int,
        state: StateDict,
        healthy: bool | None,
        loss: Any,
        grad_norm: Any,
        actions: Actions = NO_ACTIONS,
        *,
        busy: BusyRound | None = None,
        measure: bool = False,
    ) -> Staged | None:
        """The caller's part of ``save_async`` (health agreement, snapshot, copies queued): the
        background commit, its fence, its start; None: unhealthy. ``busy``: whose skips the cost
        block reports; ``measure``: see budget.py."""
        actions = self.root_stage.before_save(step, actions)
        if not self.healthy(step, healthy, loss, grad_norm):
            return None
        start = time.monotonic()
        snap, fence = _async.staged_snapshot(
            self.ctx, self.staging, step, state, actions, (busy or self.busy).pending_cost
        )
        return committer(self.commit, snap, start, self.staging.pool, measure), fence, start

    def commit(self, snap: Snapshot, start: float, blocked_s: float, measure: bool = False) -> Path:
        """The background commit of a staged snapshot, and what follows it (``published``)."""
        # save_async's divergence guard runs in its commit.
        with self.core.proof.divergence(snap.step):
            path = self.published(
                _commit.commit(self.ctx, snap), snap.step, blocked_s=blocked_s, began=start
            )
        if measure:  # what a synchronous save would have held the caller: the next estimate's speed
            self.blocking.observe(snap, time.monotonic() - start, by="background")
        return path
