"""CheckpointManager: the public face of the File and Resume-state contracts.

Every public method is collective: all ranks of the group call it in the same order.
The manager owns the cross-cutting guards (arguments, timeouts, logging); the protocol
itself lives in ``_commit`` (save) and ``_restore`` (resolve, restore).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch.distributed as dist

from . import _faults, _log
from ._agree import rank0_does
from ._commit import pending as _async
from ._commit import protocol as _commit
from ._commit.budget import BudgetRound
from ._commit.busy import BusyRound, check_policy
from ._commit.coalesce import Queued, SaveQueue
from ._commit.savehandle import PendingSave, committer
from ._commit.snapshot import snapshot
from ._context import NO_ACTIONS, Actions, Context
from ._core.guard import GuardTarget, recorded_save_seconds
from ._core.parts import Parts
from ._core.root import Root, check_state, check_step
from ._core.rootstage import open_stage
from ._disk import layout as _layout
from ._dist import make_agreement
from ._records import contract as _contract
from ._records import manifest as _manifest
from ._records import retention
from ._records import trust as _trust
from ._records.exportdigest import ExportFingerprint, export_fingerprint, logprob_diff
from ._records.proofwriter import process_start
from ._resume import resolve_agreed as _resolve
from ._resume import restore as _restore
from ._resume.resolve_local import Resolution
from ._state.derived import DerivedState
from ._state.expert import ExpertParallel
from ._state.state import addresses, capture, check_items, moved
from ._state.trajectory import fingerprint, step_metrics
from ._types import JsonObject, StateDict
from .config import CheckpointConfig, OnBusy, ResumeMode
from .errors import ConfigError
from .storage._staging import Fence
from .storage.base import Storage
from .storage.streaming import StreamingStorage

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
        self, root: str | os.PathLike[str], *, config: CheckpointConfig | None = None, process_group: Any | None = None,
        storage: Storage | None = None, derived: DerivedState | None = None,
        expert_parallel: ExpertParallel | None = None, parts: Parts | None = None,
    ) -> None:
        base = config or CheckpointConfig()
        if not isinstance(base, CheckpointConfig):
            raise ConfigError(f"config must be a CheckpointConfig, got {type(base).__name__}")
        check_policy(base.async_save.on_busy, "CheckpointManager", (OnBusy.SKIP, OnBusy.WAIT, OnBusy.COALESCE))
        # Managers are created collectively, in the same order on every rank, so a counter names this one's
        # store keys alike everywhere; the root path would not (node-local roots may differ per node).
        CheckpointManager._created += 1
        name = f"manager-{CheckpointManager._created}"
        # Its local root and stage: an s3:// root commits into a staging root, then publishes (_core.rootstage).
        self.root, self.config, self._stage = open_stage(root, base, process_group=process_group, namespace=name)
        agreement = make_agreement(process_group, timeout_s=self.config.timeout_s, namespace=name)
        info = agreement.info
        group = None
        if dist.is_available() and dist.is_initialized():
            ranks = dist.get_process_group_ranks(process_group) if process_group else list(range(dist.get_world_size()))
            # DCP's own collectives get our timeout too: a dedicated gloo group, created by
            # the group's members only, so a stalled peer fails this save within timeout_s.
            group = dist.new_group(
                ranks,
                backend="gloo",
                timeout=_dt.timedelta(seconds=self.config.timeout_s),
                use_local_synchronization=True,
            )
        self._pending: PendingSave | None = None
        # Its own agreement: the busy round runs in the caller's thread while a commit agrees in its own.
        self.busy = BusyRound(make_agreement(process_group, timeout_s=self.config.timeout_s, namespace=f"{name}-busy"),
                              policy=self.config.async_save.on_busy)
        """The ``on_busy`` decisions of ``save_async``: ``busy.skipped_total``, ``busy.last_commit_s``."""
        self.process_group = process_group
        """The group this manager agrees over (None: the default group); a PreemptionGuard agrees over it too."""
        self._staging = parts.staging if parts is not None and parts.staging is not None else _async.AsyncStaging()
        self.queue = SaveQueue(self.busy, self._staging, self._record)
        """``OnBusy.COALESCE``'s queued save (``queue.queued_step``) and its second staging set."""
        self.derived = derived
        """Parameter-derived caches; a restore invalidates them (``DerivedState.mark_restored``)."""
        _faults.arm_pause_from_env(info.rank)  # only under `ckptguard rehearse`
        self._ctx = Context.of(self.root, self.config, _layout.StepNaming(self.config.storage.dir_template), agreement,
                               storage or StreamingStorage(), group, expert_parallel)
        self.core = Root(self.root, self.config, self._ctx.naming, agreement, proof=parts.proof if parts else None,
                         health=parts.health if parts else None)
        """The bookkeeping of this root (lease, health, trust, retention, trajectory): ``ckptguard._core``."""
        if parts is not None:  # the door that made this manager (the tiers, Megatron's async save) drives these
            parts.bind(self._ctx, self._stage, self._stage_commit, self._start_commit, self._cleanup_after,
                       self.core.restarted_at)
        self.core.check_lease("create")
        # On the busy agreement: a save over the budget runs its round beside the commit in flight (issue 41).
        self.blocking = BudgetRound(self.busy.agreement, info.world_size, process_group, self.config.blocking,
                                    self.root, storage)
        """How long a synchronous ``save`` may hold the caller (``CheckpointConfig.blocking``)."""

    @property
    def last_health(self) -> _trust.HealthVerdict | None:
        """The health verdict of the last ``save``/``save_async`` call (``.skip``: it was not committed)."""
        return self.core.last_health

    @property
    def context(self) -> Context:
        """What the commit protocol and the restore run on for this root (``ckptguard._context``)."""
        return self._ctx

    def preemption_target(self) -> GuardTarget:
        """What a ``PreemptionGuard`` guards: this manager's save, wait, commits and save times."""
        return GuardTarget(
            root=self.root, timeout_s=self.config.timeout_s, process_group=self.process_group, save=self.save,
            wait=self.wait, committed_here=lambda: list(self.core.committed_here),
            save_seconds=lambda step: recorded_save_seconds(self.root / self._ctx.naming.name(step)),
        )

    @property
    def rank(self) -> int:
        return self._ctx.rank

    @property
    def world_size(self) -> int:
        return self._ctx.world

    # ------------------------------------------------------------ queries

    def committed_steps(self) -> list[int]:
        """Steps with a valid manifest and no newer than the tracker, ascending: this rank's reading of
        the disk now, not agreed. While a rotation deletes (after a commit, in the background) two ranks
        can list different steps; ``resolve()`` is the agreed answer of which step a restore loads. An ``s3://``
        root's are the store's."""
        stored = self._stage.committed_steps()
        return stored if stored is not None else _layout.committed_steps(self.root, self._ctx.naming, _manifest.read)

    def resolve(
        self, *, mode: ResumeMode = ResumeMode.AUTO, path: str | os.PathLike[str] | None = None,
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
        stored = self._stage.resolve(mode, chosen) if path is None else None  # an s3:// root's: on the store
        return stored or _resolve.resolve(self._ctx, mode, Path(path) if path is not None else None, prefer=chosen)

    # ------------------------------------------------------------ save / restore

    def save(
        self, step: int, state: StateDict, *, healthy: bool | None = None, loss: Any = None, grad_norm: Any = None,
        overwrite: bool = False, break_lease: bool = False,
    ) -> Path | None:
        """Commit ``state`` as step ``step`` on every rank, or raise on every rank.

        Returns the committed step directory. On any failure the tracker does not move and the previous
        committed step stays the resume target. Healthy steps only (``CheckpointConfig.health``): when, on any
        rank, ``loss`` or ``grad_norm`` (these arguments, else that rank's ``record_step`` of ``step``) is not
        finite, ``healthy=False`` was passed or the policy's check fails, no rank commits: the reasons are
        logged as an error, nothing is written, the tracker stays, and every rank returns None (``last_health``
        holds the verdict): a skipped step is the policy working, not a failed save (``if mgr.save(...) is
        None`` tells the loop). ``overwrite=True`` replaces a committed step or saves one older than the
        tracker (a deliberate rollback); ``break_lease=True`` takes the root's write lease from a live owner.
        Both act on this call only (one-shot actions, never config that would act again on every restart).
        With several ranks, a save estimated to hold the slowest one longer than ``CheckpointConfig.blocking``
        (half the collective timeout) is warned about (``OverBudget.WARN``), committed in the background (None;
        ``wait()`` joins it) or refused on every rank (``SaveBudgetError``), before anything is captured.
        """
        check_step(step, "save")
        check_state(state, "save")
        actions, previous = Actions(overwrite, break_lease), self._pending
        if self.blocking.over(step, state):  # over CheckpointConfig.blocking: as save_async (on_busy: never held)
            if self.queue.admit(step, previous, self._ctx, state, actions, (healthy, loss, grad_norm), wait=self.wait):
                prepared = self._stage_commit(step, state, healthy, loss, grad_norm, actions, measure=True)
                if prepared is not None:
                    self._start_commit(step, prepared, time.monotonic(), after=previous)
            return None
        self.wait()
        actions = self._stage.before_save(step, actions)  # an s3:// root: the store's lease, what it never committed
        if not self._healthy(step, healthy, loss, grad_norm):
            return None
        start = time.monotonic()
        with self.core.proof.divergence(step):  # in the proof records: prove names the tensor under its replica gate
            snap = snapshot(self._ctx, step, state, actions=actions)
        snap.cost.update(self.busy.pending_cost())
        path = self._published(_commit.commit(self._ctx, snap), step, blocked_s=time.monotonic() - start, began=start)
        self.blocking.observe(snap, time.monotonic() - start)
        self._cleanup_after(step)
        return path

    def save_async(
        self, step: int, state: StateDict, *, healthy: bool | None = None, loss: Any = None, grad_norm: Any = None,
        overwrite: bool = False, break_lease: bool = False,
    ) -> PendingSave | None:
        """Snapshot ``state`` now and commit step ``step`` in the background.

        Requested while the previous commit still runs (on any rank), it follows
        ``CheckpointConfig.async_save.on_busy``: ``SKIP`` (the default) returns None at once, logged with the
        interval that fits the measured commit time, counted (``busy.skipped_total``) and recorded in the next
        step's cost block (so a final save is ``wait()`` first); ``WAIT`` waits; ``COALESCE`` queues it
        (``poll()``, ``wait()`` start it). The caller blocks only until the snapshot's copies are queued: into
        spare GPU memory within ``AsyncOptions.gpu_bytes``, else into the reusable pinned host pool within
        ``AsyncOptions.host_bytes`` (None: the budget the memory contract leaves), on a side stream. The next
        optimizer step (a step pre-hook), the next forward of a module with buffers, or ``staged()`` waits for the
        copies; what does not fit the pool is read live by the background writer and that wait lasts until it
        was read (reported, never a silent synchronous save). The tracker moves when the commit completes; its error
        is raised by ``wait()`` or the next save, save_async, restore or wait. The health agreement runs first, as in
        ``save`` (for a queued save: when it starts). ``overwrite``, ``break_lease`` as in ``save``; ``prepare_async``
        pins ahead. Retention runs after a commit, in its thread, and never holds the next ``save_async``.
        """
        check_step(step, "save_async")
        check_state(state, "save_async")
        previous, actions = self._pending, Actions(overwrite, break_lease)
        if not self.queue.admit(step, previous, self._ctx, state, actions, (healthy, loss, grad_norm), wait=self.wait):
            return None  # skipped or queued (CheckpointConfig.async_save.on_busy), alike on every rank
        prepared = self._stage_commit(step, state, healthy, loss, grad_norm, actions)
        return None if prepared is None else self._start_commit(step, prepared, time.monotonic(), after=previous)

    def poll(self) -> PendingSave | None:
        """``OnBusy.COALESCE``: start the queued save once every rank's commit ended (collective: every step, say)."""
        return self._start_queued(self.queue.poll(self._pending, self._healthy), self._pending)

    def _start_queued(self, queued: Queued | None, after: PendingSave | None) -> PendingSave | None:
        """The commit of a queued save whose health agreement passed, in the background."""
        if queued is None:
            return None
        return self._start_commit(queued.step, queued.prepared(self.busy.pending_cost(), self._commit_snap),
                                 queued.resumed, after=after)

    def _start_commit(self, step: int, prepared: tuple[Callable[[], Path], Fence, float], resumed: float, *,
                     after: PendingSave | None = None) -> PendingSave:
        """Start in the background the commit ``_stage_commit`` prepared (``resumed``: when the caller got control
        back); an integration whose own writer finishes later (Megatron's async save) starts it then."""
        run, fence, start = prepared
        self._pending = PendingSave(step, run, resumed - start, fence=fence, started=start,
                                    cleanup=lambda: self._cleanup_after(step), after=after)
        return self._pending

    def _stage_commit(
        self, step: int, state: StateDict, healthy: bool | None, loss: Any, grad_norm: Any,
        actions: Actions = NO_ACTIONS, *, busy: BusyRound | None = None, measure: bool = False,
    ) -> tuple[Callable[[], Path], Fence, float] | None:
        """The caller's part of ``save_async`` (health agreement, snapshot, copies queued): the background commit, its
        fence, its start; None: unhealthy. ``busy``: whose skips the cost block reports; ``measure``: see budget.py."""
        actions = self._stage.before_save(step, actions)
        if not self._healthy(step, healthy, loss, grad_norm):
            return None
        start = time.monotonic()
        snap, fence = _async.staged_snapshot(self._ctx, self._staging, step, state, actions,
                                             (busy or self.busy).pending_cost)
        return committer(self._commit_snap, snap, start, self._staging.pool, measure), fence, start

    def _commit_snap(self, snap: Any, start: float, blocked_s: float, measure: bool = False) -> Path:
        with self.core.proof.divergence(snap.step):  # save_async's divergence guard runs in its commit
            path = self._published(_commit.commit(self._ctx, snap), snap.step, blocked_s=blocked_s, began=start)
        if measure:  # what a synchronous save would have held the caller: the next estimate's speed
            self.blocking.observe(snap, time.monotonic() - start, by="background")
        return path

    def prepare_async(self, state: StateDict) -> Future[int]:
        """Optional (``restore`` does it): pin the staging pool(s) for ``state`` in the background; no collective."""
        check_state(state, "prepare_async")
        return self.queue.prepare(capture(state, self._ctx.keyfn()), self.config)

    def staged(self) -> float:
        """Make later changes of the saved tensors safe for the last ``save_async`` (and a queued one): later work on
        the current CUDA stream runs after its copies, and what did not fit the pool has been read (the CPU waits
        for that). Call it before changing saved tensors outside an optimizer step (a manual ``p.add_()``, a weight
        sync into the model). Returns the seconds it blocked."""
        return self.queue.staged(self._pending)

    def close(self) -> None:
        """Wait for a pending save (raising its error) and release the host staging pools now (an ``s3://`` root:
        the proof records copied to the store, its lease released)."""
        try:
            self.queue.close(self.wait)  # both staging sets, also when wait raised
        finally:
            self._stage.close()

    def wait(self) -> Path | None:
        """Wait for a pending ``save_async`` and its cleanup, then commit a queued one (``OnBusy.COALESCE``) and
        wait for it too; returns the last step directory, raises the first error."""
        pending, self._pending = self._pending, None
        path = pending.wait() if pending is not None and not pending.reported else None
        started = self._start_queued(self.queue.take(self._healthy), pending)  # every rank's commit ended: agreed
        return self.wait() if started is not None else path

    def _published(self, path: Path, step: int, *, blocked_s: float, began: float) -> Path:
        """What follows a commit before the caller may go on: the log line, the save record (with the
        seconds the caller was held, ``ckptguard goodput``), trust, and an ``s3://`` root's publish to the store."""
        log.info("ckptguard: committed step %d at %s", step, path)
        self._record("save", step=step, path=str(path), world_size=self.world_size,
                     blocked_s=round(blocked_s, 4), commit_s=round(time.monotonic() - began, 4))
        self.core.committed(step)
        self.core.observe_held(publisher=self._ctx.node_publisher)
        if self.rank == 0 or self._ctx.node_publisher:  # node-local roots: every node keeps its own record
            self.core.trust_committed(step)
        self._stage.published(step, path)
        return path

    def _cleanup_after(self, step: int) -> None:
        """Retention and proof pruning after the commit of ``step`` (``Root.cleanup``; off the caller's path)."""
        self.core.cleanup(step, rotate=self.rank == 0 or self._ctx.node_publisher)

    def _healthy(self, step: int, healthy: bool | None, loss: Any, grad_norm: Any) -> bool:
        """The health agreement of a save (``Root.health_round``); an unhealthy step is logged and recorded."""
        verdict = self.core.health_round(step, healthy, loss, grad_norm, key="save.health",
                                         node_publisher=lambda: self._ctx.node_publisher)
        if not verdict.skip:
            return True
        log.error("ckptguard: step %d NOT committed: unhealthy on %d of %d rank(s): %s. Nothing was written; the "
                  "tracker stays at %s under %s", step, len(verdict.reasons), self.world_size, verdict.describe(),
                  self.core.safe_tracker(), self.root)
        self._record("skip", step=step, reasons=verdict.reasons)
        return False

    def restore(
        self, state: StateDict, *, mode: ResumeMode = ResumeMode.AUTO, path: str | os.PathLike[str] | None = None,
        prefer: _trust.Prefer | str | None = None, break_lease: bool = False,
    ) -> int:
        """Load the resolved checkpoint into ``state`` in place; return its step (0: fresh).

        ``break_lease=True``: restore even while another live run holds the root's write lease (the
        next ``save(..., break_lease=True)`` takes it); otherwise such a restore is refused.

        Tensors are written into the existing tensors; plain values are replaced in
        ``state``. Logs one line with the resolved path and step before returning.
        ``prefer`` as in ``resolve``.
        """
        check_state(state, "restore")
        check_items(state, "restore")  # an item no save could write: refused before the run trains on it
        began = time.monotonic()
        self.wait()
        self.core.check_lease("restore", break_lease=break_lease)
        self._stage.before_restore(break_lease)  # an s3:// root: the store's lease, a lost node's proof records
        res = self.resolve(mode=mode, path=path, prefer=prefer)
        if res.url is not None:  # a step on a store: downloaded into the local root, restored from there
            res = dataclasses.replace(self.resolve(mode=mode, path=self._stage.bring(res.step)), url=res.url)
        # What ``ckptguard goodput`` splits the time to recover by: start-up, this restore, the first step.
        timing: dict[str, Any] = {"process_start": process_start(), "began_mono": began}
        if res.fresh:
            log.warning("ckptguard: %s", res.describe())
            self._record("restore", step=0, fresh=True, reason=res.reason, world_size=self.world_size,
                         seconds=round(time.monotonic() - began, 4), **timing)
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
        except Exception as exc:  # recorded as a failed restore (prove shows it as FAIL), then raised
            self._record("restore", step=res.step, path=str(res.path), digests_match=seen["digests"],
                         layout_free_match=seen["layout_free"], replicas=seen["replicas"], ok=False,
                         error=f"{type(exc).__name__}: {exc}"[:2000], **where)
            raise
        if done.reshard is not None:  # old -> new world, the rules, this rank's RNG streams (prove shows them)
            where["reshard"] = done.reshard
        self._record("restore", step=done.step, path=str(res.path), digests_match=done.digests_match,
                     layout_free_match=done.layout_free_match, replicas=done.replicas, source_rank=done.source_rank,
                     saved_world_size=done.saved_world_size, format_version=done.format_version,
                     addresses_changed=moved(before, addresses(state)), ok=True,
                     seconds=round(time.monotonic() - began, 4), **timing, **where)
        self.core.restarted_at(done.step)
        self.core.proof.after_restore(state, self._ctx.keyfn(), done.replicas)  # replicas again at the first step
        if self.derived is not None:
            self.derived.mark_restored(done.step)
        self.queue.known(state, self._ctx)  # staging prepared after the read: beside it, the read ran 0.85x (issue 41)
        return done.step

    # ------------------------------------------------------------ proof records

    def record_export(self, step: int, payload: Any, *, scales: Any = None, **details: Any) -> ExportFingerprint:
        """Record the weights exported for rollout at ``step`` (after ``step`` updates).

        ``payload`` is what the rollout receives (tensors or bytes); ``scales`` the quantization scales sent
        with it. The first export after a restore must equal the export the saving run recorded for the same
        step. ``details``: JSON fields kept with the record (an integration's per-tensor digests, its
        read-back gates, the LoRA probe ``integrations.peft.adapter_probe``).
        """
        fp = export_fingerprint(payload, scales)
        self._record("export", step=step, fingerprint=fp, **details)
        return fp

    def record_logprobs(self, step: int, trainer_logprobs: Any, rollout_logprobs: Any, **details: Any
                        ) -> dict[str, float]:
        """Record the trainer's old-logprob against the rollout's for the same tokens. ``details``: JSON
        fields kept with the record (an integration's digests of the sampled token ids and seeds)."""
        diff = logprob_diff(trainer_logprobs, rollout_logprobs)
        self._record("logprobs", step=step, **details, **dict[str, Any](diff))
        return diff

    def record_update(self, step: int, *, grad_norm: float, params_changed: bool) -> None:
        """Record an optimizer update: its gradient norm and whether the parameters moved."""
        self._record("update", step=step, grad_norm=float(grad_norm), params_changed=bool(params_changed))

    def record_step(
        self, step: int, *, sample_ids: Any = None, batch: Any = None, loss: Any = None, grad_norm: Any = None,
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
        check_step(step, "record_step")
        fields = fingerprint(sample_ids, batch, loss, grad_norm, extra)
        # Judged now, shipped with the next save: the evidence of healthy and unhealthy steps.
        self.core.health.note(self.config.health, step, step_metrics(fields))
        self._record("step", durable=False, step=step, **fields)
        return fields

    def _record(self, event: str, *, durable: bool = True, **fields: Any) -> None:
        self.core.proof.record(event, durable=durable, **fields)

    def adopt(self, path: str | os.PathLike[str], reason: str) -> Path:
        """Adopt the run chain of the checkpoint at ``path`` into this root (a new contract
        phase), so ``restore(path=...)`` may continue from it. Rank 0 writes; collective."""
        chain = _manifest.read(Path(path)).chain_id

        def write() -> Path:
            self.root.mkdir(parents=True, exist_ok=True)  # adopting is an explicit act of creating a run
            return _contract.adopt(self.root, self.config.contract, chain, reason)

        written = self._on_rank0("adopt", write)
        log.warning("ckptguard: %s adopted chain %s from %s (%s)", self.root, chain, path, reason)
        return written

    def hold(self, step: int, reason: str) -> Path:
        """Pin a committed step against rotation (e.g. for evaluation); survives restarts."""
        if step not in self.committed_steps():
            raise ConfigError(f"hold({step}): step {step} is not committed under {self.root}")
        return retention.hold(self.root, step, reason)

    def release(self, step: int) -> bool:
        """Remove a hold; True if there was one."""
        return retention.release(self.root, step)

    def declare_phase(self, reason: str, changes: Iterable[str]) -> Path:
        """Append a contract phase: the only way to extend training or change data.

        ``changes`` names the contract items that changed (code, data, recipe,
        total_steps); it must equal the actual difference from the phase in force.
        """
        changes = sorted(changes)
        written = self._on_rank0(
            "declare_phase", lambda: _contract.declare(self.root, self.config.contract, reason, changes)
        )
        log.warning("ckptguard: declared contract phase %s (%s): %s", written, reason, changes)
        return written

    def _on_rank0(self, phase: str, write: Callable[[], Path]) -> Path:
        """Rank 0 writes a root-level file; every rank returns its path or raises its error."""
        self.wait()
        return Path(rank0_does(self._ctx.agreement, phase, lambda: str(write())))
