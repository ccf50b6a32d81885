"""CheckpointManager: the public face of the File and Resume-state contracts.

Every public method is collective: all ranks of the group call it in the same order.
The manager owns the cross-cutting guards (arguments, timeouts, logging); the protocol
itself lives in ``_commit`` (save) and ``_restore`` (resolve, restore).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from . import _faults, _log
from ._commit import protocol as _commit
from ._commit.coalesce import Queued
from ._commit.savehandle import PendingSave
from ._commit.snapshot import snapshot
from ._context import Actions, Context
from ._core import proofevents as _events
from ._core import rootacts as _acts
from ._core.background import BackgroundCommits
from ._core.guard import GuardTarget
from ._core.opening import checked_config, open_context
from ._core.parts import Parts, Staged
from ._core.root import Root, check_state, check_step
from ._records import retention
from ._records import trust as _trust
from ._records.exportdigest import ExportFingerprint
from ._records.proofwriter import process_start
from ._resume import resolve_agreed as _resolve
from ._resume import restore as _restore
from ._resume.resolve_local import Resolution
from ._state.derived import DerivedState
from ._state.expert import ExpertParallel
from ._state.state import addresses, capture, check_items, moved
from ._types import JsonObject, StateDict
from .config import CheckpointConfig, ResumeMode
from .errors import ConfigError
from .storage.base import Storage

log = _log.logger()


class CheckpointManager:
    """Saves and restores a dict of named state items under one checkpoint root.

    ``root`` is never created by the constructor or by ``restore``: a mistyped path must
    not turn into a silent fresh start. The first ``save`` creates it. ``root`` may be an object
    store, ``"s3://bucket/prefix"``: each step is committed to a local staging root
    (``StorageOptions.object_staging``), then published to the store; a restore loads the store's
    step (docs/objectstore.md). ``StorageOptions.object_store`` says how the store is talked to.

    The constructor is collective too: every rank creates its managers in the same order
    (their agreement keys are numbered by creation), e.g. the actor's and the critic's.
    It raises LeaseHeldError when another live run holds the root's write lease, and so
    does ``restore``: a duplicate launch stops before it trains.
    """

    _created = 0

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        config: CheckpointConfig | None = None,
        process_group: Any | None = None,
        storage: Storage | None = None,
        derived: DerivedState | None = None,
        expert_parallel: ExpertParallel | None = None,
        parts: Parts | None = None,
    ) -> None:
        base = checked_config(config)
        # Created collectively, in the same order on every rank: a counter names this one's store
        # keys alike everywhere; the root path would not (node-local roots differ per node).
        CheckpointManager._created += 1
        name = f"manager-{CheckpointManager._created}"
        self.root, self.config, self._stage, self._ctx = open_context(
            root, base, process_group, storage, expert_parallel, name
        )
        ctx = self._ctx
        self._pending: PendingSave | None = None
        self.process_group = process_group
        """The group this manager (and a PreemptionGuard) agrees over; None: the default group."""
        self.derived = derived
        """Parameter-derived caches; a restore invalidates them (``DerivedState.mark_restored``)."""
        _faults.arm_pause_from_env(ctx.rank)  # only under `ckptguard rehearse`
        proof, health = (parts.proof, parts.health) if parts else (None, None)
        self.core = Root(
            self.root, self.config, ctx.naming, ctx.agreement, proof=proof, health=health
        )
        """This root's bookkeeping (lease, health, trust, retention, trajectory): ``_core``."""
        self._background = BackgroundCommits(
            ctx,
            self._stage,
            self.core,
            parts,
            name=name,
            process_group=process_group,
            healthy=self._healthy,
            published=self._published,
            cleanup=self._cleanup_after,
            wait=self.wait,
            start=self._start_commit,
        )
        self.busy = self._background.busy
        """``save_async``'s ``on_busy`` choices: ``busy.skipped_total``, ``busy.last_commit_s``."""
        self.queue = self._background.queue
        """``OnBusy.COALESCE``'s queued save (``queue.queued_step``) and its second staging set."""
        self.blocking = self._background.blocking
        """How long a synchronous ``save`` may hold the caller (``CheckpointConfig.blocking``)."""
        self._staging = self._background.staging
        self.core.check_lease("create")

    @property
    def last_health(self) -> _trust.HealthVerdict | None:
        """The last ``save``/``save_async`` call's health verdict (``.skip``: not committed)."""
        return self.core.last_health

    @property
    def context(self) -> Context:
        """What this root's commit protocol and restore run on (``ckptguard._context``)."""
        return self._ctx

    def preemption_target(self) -> GuardTarget:
        """What a ``PreemptionGuard`` guards: this manager's save, wait, commits and save times."""
        return _acts.preemption_target(self.core, self.process_group, self.save, self.wait)

    @property
    def rank(self) -> int:
        return self._ctx.rank

    @property
    def world_size(self) -> int:
        return self._ctx.world

    # ------------------------------------------------------------ queries

    def committed_steps(self) -> list[int]:
        """Steps with a valid manifest and no newer than the tracker, ascending: this rank's reading
        of the disk now, not agreed. While a rotation deletes (after a commit, in the background)
        two ranks can list different steps; ``resolve()`` is the agreed answer of which step a
        restore loads. An ``s3://`` root's are the store's."""
        return _acts.committed_steps(self.core, self._stage)

    def resolve(
        self,
        *,
        mode: ResumeMode = ResumeMode.AUTO,
        path: str | os.PathLike[str] | None = None,
        prefer: _trust.Prefer | str | None = None,
    ) -> Resolution:
        """Which step a restore would load and why, agreed by all ranks; loads nothing.

        ``prefer="verified"`` (or ``HealthPolicy.prefer``) makes AUTO and MUST pick the newest
        verified step no newer than the tracker (``ckptguard._records.trust``); resuming it while
        newer candidates exist is a rollback: saving their steps again needs ``overwrite=True``.
        """
        if not isinstance(mode, ResumeMode):
            raise ConfigError(f"mode must be a ResumeMode (AUTO, MUST, NEVER), got {mode!r}")
        chosen = self.config.health.prefer if prefer is None else _trust.as_prefer(prefer, "prefer")
        self.wait()  # the agreement is not shared with a background commit
        # An s3:// root's: on the store.
        stored = self._stage.resolve(mode, chosen) if path is None else None
        return stored or _resolve.resolve(
            self._ctx, mode, Path(path) if path is not None else None, prefer=chosen
        )

    # ------------------------------------------------------------ save / restore

    def save(
        self,
        step: int,
        state: StateDict,
        *,
        healthy: bool | None = None,
        loss: Any = None,
        grad_norm: Any = None,
        overwrite: bool = False,
        break_lease: bool = False,
    ) -> Path | None:
        """Commit ``state`` as step ``step`` on every rank, or raise on every rank.

        Returns the committed step directory. On failure the tracker stays: the previous committed
        step stays the resume target. Healthy steps only (``CheckpointConfig.health``): when, on
        any rank, ``loss`` or ``grad_norm`` (these arguments, else that rank's ``record_step`` of
        ``step``) is not finite, ``healthy=False`` was passed or the policy's check fails, no rank
        commits: the reasons are logged as an error, nothing is written, the tracker stays, every
        rank returns None (``last_health`` holds the verdict): the policy working, not a failed
        save (``if mgr.save(...) is None`` tells the loop). ``overwrite=True`` replaces a committed
        step or saves one older than the tracker (a deliberate rollback); ``break_lease=True``
        takes the root's write lease from a live owner. Both are one-shot: this call only, never
        config acting again on every restart. With several ranks, a save estimated to hold the
        slowest one longer than ``CheckpointConfig.blocking`` (half the collective timeout) is
        warned about (``OverBudget.WARN``), committed in the background (None; ``wait()`` joins
        it) or refused on every rank (``SaveBudgetError``), before anything is captured.
        """
        check_step(step, "save")
        check_state(state, "save")
        actions = Actions(overwrite, break_lease)
        # Over CheckpointConfig.blocking: as save_async (on_busy: never held).
        if self.blocking.over(step, state):
            self._in_background(step, state, actions, healthy, loss, grad_norm, measure=True)
            return None
        self.wait()
        # An s3:// root: the store's lease, what it never committed.
        actions = self._stage.before_save(step, actions)
        if not self._healthy(step, healthy, loss, grad_norm):
            return None
        start = time.monotonic()
        # In the proof records: prove names the tensor under its replica gate.
        with self.core.proof.divergence(step):
            snap = snapshot(self._ctx, step, state, actions=actions)
        snap.cost.update(self.busy.pending_cost())
        committed = _commit.commit(self._ctx, snap)
        path = self._published(committed, step, blocked_s=time.monotonic() - start, began=start)
        self.blocking.observe(snap, time.monotonic() - start)
        self._cleanup_after(step)
        return path

    def save_async(
        self,
        step: int,
        state: StateDict,
        *,
        healthy: bool | None = None,
        loss: Any = None,
        grad_norm: Any = None,
        overwrite: bool = False,
        break_lease: bool = False,
    ) -> PendingSave | None:
        """Snapshot ``state`` now and commit step ``step`` in the background.

        Requested while the previous commit runs (on any rank), it follows
        ``CheckpointConfig.async_save.on_busy``: ``SKIP`` (default) returns None at once, logged
        with the interval that fits the measured commit time, counted (``busy.skipped_total``) and
        recorded in the next step's cost block (so a final save is ``wait()`` first); ``WAIT``
        waits; ``COALESCE`` queues it (``poll()``, ``wait()`` start it). The caller blocks only
        until the snapshot's copies are queued, on a side stream: into spare GPU memory within
        ``AsyncOptions.gpu_bytes``, else the reusable pinned host pool within
        ``AsyncOptions.host_bytes`` (None: what the memory contract leaves). The next optimizer
        step (a step pre-hook), the next forward of a module with buffers, or ``staged()`` waits
        for the copies; what does not fit the pool the background writer reads live, and that
        wait lasts until it was read (reported, never a silent synchronous save). The tracker
        moves when the commit completes; its error is raised by ``wait()`` or the next save,
        save_async, restore or wait. The health agreement runs first, as in ``save`` (queued: when
        it starts). ``overwrite``, ``break_lease`` as in ``save``; ``prepare_async`` pins ahead.
        Retention runs after a commit, in its thread, never holding the next ``save_async``.
        """
        check_step(step, "save_async")
        check_state(state, "save_async")
        return self._in_background(
            step, state, Actions(overwrite, break_lease), healthy, loss, grad_norm
        )

    def poll(self) -> PendingSave | None:
        """COALESCE: start the queued save once all commits ended (collective; e.g. every step)."""
        return self._start_queued(self.queue.poll(self._pending, self._healthy), self._pending)

    def _start_queued(self, queued: Queued | None, after: PendingSave | None) -> PendingSave | None:
        """The commit of a queued save whose health agreement passed, in the background."""
        if queued is None:
            return None
        self._pending = self._background.queued(queued, after)
        return self._pending

    def _start_commit(self, step: int, prepared: Staged, resumed: float) -> PendingSave:
        """Start in the background the commit ``Parts.commits.stage`` prepared (``resumed``: when
        the caller got control back); an integration whose own writer finishes later (Megatron's
        async save) starts it then."""
        self._pending = self._background.begin(step, prepared, resumed)
        return self._pending

    def _in_background(
        self, step: int, state: StateDict, actions: Actions, *health: Any, measure: bool = False
    ) -> PendingSave | None:
        """A save committed in the background via the ``on_busy`` round: its commit, now in flight;
        None: skipped, queued (``async_save.on_busy``) or unhealthy, alike on every rank."""
        started = self._background.request(step, state, actions, health, self._pending, measure)
        if started is not None:
            self._pending = started
        return started

    def prepare_async(self, state: StateDict) -> Future[int]:
        """Optional (``restore`` does it): pin the staging pool(s) for ``state`` in the background;
        no collective."""
        check_state(state, "prepare_async")
        return self.queue.prepare(capture(state, self._ctx.keyfn()), self.config)

    def staged(self) -> float:
        """Make later changes of the saved tensors safe for the last ``save_async`` (and a queued
        one): later work on the current CUDA stream runs after its copies, and what did not fit the
        pool has been read (the CPU waits for that). Call it before changing saved tensors outside
        an optimizer step (a manual ``p.add_()``, a weight sync into the model). Returns the seconds
        it blocked."""
        return self.queue.staged(self._pending)

    def close(self) -> None:
        """Wait for a pending save (raising its error) and release the host staging pools now (an
        ``s3://`` root: the proof records copied to the store, its lease released)."""
        try:
            self.queue.close(self.wait)  # both staging sets, also when wait raised
        finally:
            self._stage.close()

    def wait(self) -> Path | None:
        """Wait for a pending ``save_async`` and its cleanup, then commit a queued one (COALESCE)
        and wait for it too; returns the last step directory, raises the first error."""
        pending, self._pending = self._pending, None
        path = pending.wait() if pending is not None and not pending.reported else None
        # Every rank's commit ended: agreed.
        started = self._start_queued(self.queue.take(self._healthy), pending)
        return self.wait() if started is not None else path

    def _published(self, path: Path, step: int, *, blocked_s: float, began: float) -> Path:
        """What follows a commit before the caller goes on: the log line, the save record (with the
        seconds the caller was held: ``ckptguard goodput``), trust, an ``s3://`` root's publish."""
        log.info("ckptguard: committed step %d at %s", step, path)
        self.core.proof.record(
            "save",
            step=step,
            path=str(path),
            world_size=self.world_size,
            blocked_s=round(blocked_s, 4),
            commit_s=round(time.monotonic() - began, 4),
        )
        self.core.committed(step)
        self.core.observe_held(publisher=self._ctx.node_publisher)
        # Node-local roots: every node keeps its own record.
        if self.rank == 0 or self._ctx.node_publisher:
            self.core.trust_committed(step)
        self._stage.published(step, path)
        return path

    def _cleanup_after(self, step: int) -> None:
        """Retention, proof pruning after ``step``'s commit (``Root.cleanup``; off the caller)."""
        self.core.cleanup(step, rotate=self.rank == 0 or self._ctx.node_publisher)

    def _healthy(self, step: int, healthy: bool | None, loss: Any, grad_norm: Any) -> bool:
        """A save's health agreement (``Root.health_round``); unhealthy: logged and recorded."""
        verdict = self.core.health_round(
            step,
            healthy,
            loss,
            grad_norm,
            key="save.health",
            node_publisher=lambda: self._ctx.node_publisher,
        )
        if verdict.skip:
            _events.skipped(self.core, step, verdict, self.world_size)
        return not verdict.skip

    def restore(
        self,
        state: StateDict,
        *,
        mode: ResumeMode = ResumeMode.AUTO,
        path: str | os.PathLike[str] | None = None,
        prefer: _trust.Prefer | str | None = None,
        break_lease: bool = False,
    ) -> int:
        """Load the resolved checkpoint into ``state`` in place; return its step (0: fresh).

        ``break_lease=True``: restore even while another live run holds the root's write lease (the
        next ``save(..., break_lease=True)`` takes it); otherwise such a restore is refused.

        Tensors are written into the existing tensors; plain values are replaced in ``state``. Logs
        one line with the resolved path and step before returning. ``prefer`` as in ``resolve``.
        """
        check_state(state, "restore")
        # An item no save could write: refused before the run trains on it.
        check_items(state, "restore")
        began = time.monotonic()
        self.wait()
        self.core.check_lease("restore", break_lease=break_lease)
        # An s3:// root: the store's lease, a lost node's proof records.
        self._stage.before_restore(break_lease)
        res = self.resolve(mode=mode, path=path, prefer=prefer)
        # A step on a store: downloaded into the local root, restored from there.
        if res.url is not None:
            fetched = self._stage.bring(res.step)
            res = dataclasses.replace(self.resolve(mode=mode, path=fetched), url=res.url)
        # ``ckptguard goodput`` splits the time to recover by: start-up, this restore, first step.
        timing: dict[str, Any] = {"process_start": process_start(), "began_mono": began}
        if res.fresh:
            _events.fresh_start(self.core.proof, res, self.world_size, began, timing)
            self.queue.known(state, self._ctx)  # the first save_async staging, ready ahead
            return 0
        log.info("ckptguard: %s", res.describe())
        seen: dict[str, dict[str, Any]] = {"digests": {}, "layout_free": {}, "replicas": {}}
        before = addresses(state)
        where: dict[str, Any] = {"world_size": self.world_size}
        try:
            done = _restore.restore(
                self._ctx, state, res, on_verified=lambda m, kind="digests": seen[kind].update(m)
            )
        except Exception as exc:
            _events.failed_restore(self.core.proof, res, seen, exc, where)
            raise
        # Old -> new world, the rules, this rank's RNG streams (prove shows them).
        if done.reshard is not None:
            where["reshard"] = done.reshard
        self.core.proof.record(
            "restore",
            step=done.step,
            path=str(res.path),
            digests_match=done.digests_match,
            layout_free_match=done.layout_free_match,
            replicas=done.replicas,
            source_rank=done.source_rank,
            saved_world_size=done.saved_world_size,
            format_version=done.format_version,
            addresses_changed=moved(before, addresses(state)),
            ok=True,
            seconds=round(time.monotonic() - began, 4),
            **timing,
            **where,
        )
        self.core.restarted_at(done.step)
        # Replicas again at the first step.
        self.core.proof.after_restore(state, self._ctx.keyfn(), done.replicas)
        if self.derived is not None:
            self.derived.mark_restored(done.step)
        # Staging prepared after the read: beside it, the read ran 0.85x (issue 41).
        self.queue.known(state, self._ctx)
        return done.step

    # ------------------------------------------------------------ proof records

    def record_export(
        self, step: int, payload: Any, *, scales: Any = None, **details: Any
    ) -> ExportFingerprint:
        """Record the weights exported for rollout at ``step`` (after ``step`` updates).

        ``payload`` is what the rollout receives (tensors or bytes); ``scales`` the quantization
        scales sent with it. The first export after a restore must equal the export the saving run
        recorded for the same step. ``details``: JSON fields kept with the record (an integration's
        per-tensor digests, read-back gates, LoRA probe ``integrations.peft.adapter_probe``).
        """
        return _events.record_export(self.core.proof, step, payload, scales, **details)

    def record_logprobs(
        self, step: int, trainer_logprobs: Any, rollout_logprobs: Any, **details: Any
    ) -> dict[str, float]:
        """Record the trainer's old-logprob against the rollout's for the same tokens. ``details``:
        JSON fields kept with the record (an integration's digests of sampled token ids, seeds)."""
        return _events.record_logprobs(
            self.core.proof, step, trainer_logprobs, rollout_logprobs, **details
        )

    def record_update(self, step: int, *, grad_norm: float, params_changed: bool) -> None:
        """Record an optimizer update: its gradient norm and whether the parameters moved."""
        _events.record_update(self.core.proof, step, grad_norm, params_changed)

    def record_step(
        self,
        step: int,
        *,
        sample_ids: Any = None,
        batch: Any = None,
        loss: Any = None,
        grad_norm: Any = None,
        **extra: Any,
    ) -> JsonObject:
        """Record what training step ``step`` consumed and produced, on this rank.

        ``step`` is the number the step's state is saved under (the first step after a restore
        of step k is k+1). ``sample_ids`` are the ids or indices of the samples or prompts it
        read; ``batch`` the tensors it read (hashed bitwise; a dict or list of tensors is
        fine); ``loss``, ``grad_norm`` and any ``extra`` scalar (reward, lr, ...) are kept
        exactly. After a resume, ``ckptguard prove`` compares the steps the resumed run replays
        with the killed run's records of the same steps: data order exactly, the values
        exactly where ``ProofPlan(deterministic=True)``. Returns the recorded fields.
        """
        return _events.record_step(self.core, step, sample_ids, batch, loss, grad_norm, extra)

    def adopt(self, path: str | os.PathLike[str], reason: str) -> Path:
        """Adopt the run chain of the checkpoint at ``path`` into this root (a new contract
        phase), so ``restore(path=...)`` may continue from it. Rank 0 writes; collective."""
        return _acts.adopt(self.core, path, reason, self.wait)

    def hold(self, step: int, reason: str) -> Path:
        """Pin a committed step against rotation (e.g. for evaluation); survives restarts."""
        return _acts.hold(self.core, step, reason, self.committed_steps())

    def release(self, step: int) -> bool:
        """Remove a hold; True if there was one."""
        return retention.release(self.root, step)

    def declare_phase(self, reason: str, changes: Iterable[str]) -> Path:
        """Append a contract phase: the only way to extend training or change data.

        ``changes`` names the contract items that changed (code, data, recipe,
        total_steps); it must equal the actual difference from the phase in force.
        """
        return _acts.declare_phase(self.core, reason, changes, self.wait)
