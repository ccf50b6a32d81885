"""Tiered checkpoints: a fast node-local tier often, a persistent shared one rarely, one manager.

Contract. ``TieredCheckpoint.save(step, state)`` commits ``step`` to the fast tier when
``step % fast_every == 0`` and to the persistent tier when ``step % persistent_every == 0``,
each a full ``CheckpointManager`` commit with its own retention. With ``replicas=1`` every
rank's files of a fast step are also sent to its peer on another node (``_commit.replica``),
so losing any one node leaves the whole step on the others. ``save_async`` snapshots each due
tier now (its manager's staging) and commits them in one background thread: the fast tier, then
its replica push (never of an uncommitted step), then the persistent tier; every later collective
call waits for it first. Rank 0 holds the persistent root's write lease from the first save of
any tier on, so a second live job on that root is refused at its first save or restore.

``restore`` is collective: every rank reports what it can load (fast steps complete on its
own disk, peer replicas it holds, the persistent tier's step), and rank 0 picks the newest
step that EVERY rank can load from some tier: from its own disk, from a peer's replica
(fetched over torch.distributed, checked against the manifest's xxh3, then loaded like any
local step), or from the persistent tier. A newer step that only part of the job can load is
never chosen; when the choice falls back past it, the log says which files were missing on
which rank. Nothing loadable but something committed somewhere is refused, naming the
missing files; a fresh start stays what it is for one manager (an absent root, tracker 0).

``persistent="s3://bucket/prefix"``: the persistent tier is a ``CheckpointManager`` on that root,
which commits into its staging root (``StorageOptions.object_staging``) and publishes each commit to
the store (in ``save_async``'s thread too); the store's lease is the one held, and the persistent
step a restore can load is the store's (downloaded into the staging root when chosen).
docs/objectstore.md. The tiers drive either kind of persistent root through its manager's stage
(``_core.rootstage.RootStage``: the lease, the restore's checks, the fetch), never by asking which.

The restore record (``ROOT/proof``) carries the tier it used (``tier``, ``tier_detail``) and
``ckptguard prove`` shows it. Proof records of both tiers go to one log: the persistent
root's when there is one (shared, so ``prove`` sees every rank), else the fast root's.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from ._agree import gather_decide
from ._commit import replica as _replica
from ._commit.busy import BusyRound
from ._context import Actions
from ._core.guard import GuardTarget
from ._core.parts import Parts
from ._core.root import ProofSink, check_state, check_step
from ._core.rootstage import RootStage, local_root
from ._core.tierargs import TierPlan, check_restore, fast_root, separate_roots
from ._core.tierleases import check as check_leases
from ._core.tierleases import hold
from ._core.tierrestore import Choice, Tier, TierRestore
from ._core.tiersave import TieredSave, durable, joined, push_replicas, start
from ._disk import layout as _layout
from ._dist import make_agreement
from ._records import trust as _trust
from ._records.exportdigest import ExportFingerprint
from ._records.retention import KeepLast, RetentionPolicy, default_policy
from ._resume.resolve_local import Resolution
from ._state.derived import DerivedState
from ._state.expert import ExpertParallel
from ._types import JsonObject, StateDict
from .config import CheckpointConfig, ResumeMode
from .errors import (
    CheckpointIncompleteError,
)
from .manager import CheckpointManager
from .storage.base import Storage

__all__ = ["TieredCheckpoint", "TieredSave"]

log = logging.getLogger("ckptguard")


class TieredCheckpoint:
    """A fast node-local tier and a persistent shared tier under one object.

    ``root`` (the fast tier) is a root on node-local storage (the same path on every node, e.g.
    ``/dev/shm/run1`` or NVMe) or, for a single node, any directory; ``persistent`` a root on the
    shared filesystem or an object store (``"s3://bucket/prefix"``, as ``CheckpointManager`` takes
    it: its staging root and store options are ``config.storage``'s), or None for a fast tier alone
    (then ``replicas=1`` is what survives a lost node). ``fast_retention`` and
    ``persistent_retention`` rotate each tier on its own. ``config`` is the base
    ``CheckpointConfig`` of both tiers (its ``retention`` is replaced per tier). Every method is
    collective, like ``CheckpointManager``'s.
    """

    _created = 0

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        persistent: str | os.PathLike[str] | None = None,
        fast_every: int = 1,
        persistent_every: int = 10,
        fast_retention: RetentionPolicy | None = None,
        persistent_retention: RetentionPolicy | None = None,
        replicas: int = 0,
        config: CheckpointConfig | None = None,
        process_group: Any | None = None,
        storage: Storage | None = None,
        derived: DerivedState | None = None,
        expert_parallel: ExpertParallel | None = None,
    ) -> None:
        fast = fast_root(root)
        plan = TierPlan.of(fast_every, persistent_every, replicas, config)
        base, self.on_busy = plan.base, plan.on_busy
        home = separate_roots(
            fast, persistent, local_root(persistent, base) if persistent is not None else None
        )
        self.fast_every, self.persistent_every = plan.fast_every, plan.persistent_every
        self.replicas = plan.replicas
        TieredCheckpoint._created += 1
        # The tiers' own agreement (hosts, persistent lease, restore's choice, replicas), created
        # collectively like the managers' own; never shared with a manager's background commit.
        self._agreement = make_agreement(
            process_group, timeout_s=base.timeout_s, namespace=f"tiers-{TieredCheckpoint._created}"
        )
        self._naming = _layout.StepNaming(base.storage.dir_template)
        # Passed to each tier's manager: one proof log, in the root every rank reads (prove sees the
        # whole run), and one health log (either tier's record_step is evidence for both).
        proof = ProofSink.open(home, self._agreement.info.rank, base)
        health = _trust.HealthLog()
        shared = plan.staging()  # one pool for both tiers, except under FAST_TIER
        self._parts = {
            tier: Parts(proof=proof.tagged({"tier": tier.value}), health=health, staging=shared)
            for tier in Tier
        }

        def manager(
            root: str | os.PathLike[str], retention: RetentionPolicy, tier: Tier
        ) -> CheckpointManager:
            return CheckpointManager(
                root,
                config=dataclasses.replace(base, retention=retention),
                process_group=process_group,
                storage=storage,
                derived=derived,
                expert_parallel=expert_parallel,
                parts=self._parts[tier],
            )

        self.fast = manager(fast, fast_retention or KeepLast(2), Tier.FAST)
        self.persistent: CheckpointManager | None = None
        # The persistent root's stage: its lease, restore checks, fetch.
        self._tier: RootStage | None = None
        if persistent is not None:
            self.persistent = manager(
                persistent, persistent_retention or default_policy(), Tier.PERSISTENT
            )
            self._tier = self._parts[Tier.PERSISTENT].bound_stage()
        self._pending: TieredSave | None = None
        self.last_saved: dict[Tier, Path] = {}
        """Each tier's directory of the last ``save`` (or ``save_async`` last ``wait`` joined)."""
        # Own agreement (collective): the busy round agrees while a commit agrees in its own thread.
        self.busy = BusyRound(
            make_agreement(
                process_group,
                timeout_s=base.timeout_s,
                namespace=f"tiers-{TieredCheckpoint._created}-busy",
            ),
            policy=self.on_busy,
        )
        """``save_async``'s ``on_busy`` choices: ``busy.skipped_total``, ``.redirected_total``."""
        agreement = self._agreement
        self._hosts = [str(h) for h in agreement.exchange("tiers.hosts", agreement.info.host)]
        self._peers = _replica.peers(self._hosts)
        self._restorer = TierRestore(
            self._parts[Tier.FAST].bound(),
            self._parts[Tier.PERSISTENT].bound() if self.persistent else None,
            replicas=replicas,
            hosts=self._hosts,
            stage=self._tier,
        )
        plan.check_peers(self._hosts, self._peers)

    def preemption_target(self) -> GuardTarget:
        """What a ``PreemptionGuard`` guards: a save of the step now, to the persistent tier when
        there is one (the node may not come back), else to the fast tier (with its peer replicas),
        whatever the tiers' intervals."""
        return dataclasses.replace(
            self._home().preemption_target(), save=self._save_now, wait=self.wait
        )

    def _save_now(self, step: int, state: StateDict, **save_kwargs: Any) -> Path | None:
        check_step(step, "save")
        self.wait()
        self._hold_persistent(bool(save_kwargs.get("break_lease", False)))
        path = self._home().save(step, state, **save_kwargs)
        if path is not None and self.persistent is None and self.replicas:
            self._push(step)
        return path

    @property
    def rank(self) -> int:
        return self.fast.rank

    # ------------------------------------------------------------ save

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
        """Commit ``step`` to the tiers whose interval it is on; returns its directory in the most
        durable tier it reached (the persistent tier's when it was saved there, else the fast
        tier's), as every front door's ``save`` returns one directory; None for a step on no tier's
        interval or one the health policy skipped on every rank. ``last_saved`` holds each tier's
        directory of the last save (or ``wait``).

        The fast tier first (and its peer replicas), then the persistent tier; a failure of either
        raises on every rank, like ``CheckpointManager.save`` (``overwrite`` and ``break_lease``
        too: one-shot actions of this call, for each tier it saves)."""
        check_step(step, "save")
        self.wait()
        out: dict[Tier, Path] = {}
        self.last_saved = out
        if not self._due(step):
            return None  # no collective, no lease write: a loop may call save at every step
        self._hold_persistent(break_lease)
        if step % self.fast_every == 0:
            fast = self.fast.save(
                step,
                state,
                healthy=healthy,
                loss=loss,
                grad_norm=grad_norm,
                overwrite=overwrite,
                break_lease=break_lease,
            )
            # None: an unhealthy step (CheckpointConfig.health), skipped on every rank, every tier.
            if fast is None:
                return None
            out[Tier.FAST] = fast
            if self.replicas:
                self._push(step)
        if self.persistent is not None and step % self.persistent_every == 0:
            persistent = self.persistent.save(
                step,
                state,
                healthy=healthy,
                loss=loss,
                grad_norm=grad_norm,
                overwrite=overwrite,
                break_lease=break_lease,
            )
            # An object store's: committed in the staging root, then on the store.
            if persistent is not None:
                out[Tier.PERSISTENT] = persistent
        return durable(out)

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
    ) -> TieredSave | None:
        """``save`` in the background. Each tier on its interval is snapshotted now as its manager's
        ``save_async`` does (the health agreement; copies queued into its pinned staging pool; the
        next optimizer step, the next forward of a module with buffers, or ``staged()`` waits for
        them), then one background thread commits the fast tier, pushes its peer replicas once that
        commit completed (a replica is never made of an uncommitted step), and commits the
        persistent tier, then the tiers' retention. Returns a ``TieredSave``; None for a step the
        health policy skipped on every rank, or one requested while the tiers still commit
        (``CheckpointConfig.async_save.on_busy``, as in ``CheckpointManager.save_async``;
        ``OnBusy.FAST_TIER``: one requested while only the persistent tier still commits is written
        to the fast tier alone, at once, beside that commit). ``save``, ``restore``, ``wait`` or
        ``close`` wait for it first and raise its error: a restore chooses its step with every
        pending save ended, on every rank."""
        check_step(step, "save_async")
        check_state(state, "save_async")
        began = time.monotonic()
        return start(
            step,
            state,
            [tier for tier, _ in self._due(step)],
            self._parts,
            health=(healthy, loss, grad_norm),
            actions=Actions(overwrite, break_lease),
            began=began,
            busy=self.busy,
            policy=self.on_busy,
            pending=self._pending,
            wait=self.wait,
            record=self._home_sink().record,
            hold=functools.partial(self._hold_persistent, break_lease),
            push=(lambda: self._push(step)) if self.replicas else None,
            adopt=self._adopt,
        )

    def _adopt(self, pending: TieredSave) -> None:
        self._pending = pending

    def _due(self, step: int) -> list[tuple[Tier, CheckpointManager]]:
        due = [(Tier.FAST, self.fast)] if step % self.fast_every == 0 else []
        if self.persistent is not None and step % self.persistent_every == 0:
            due.append((Tier.PERSISTENT, self.persistent))
        return due

    def wait(self) -> Path | None:
        """Wait for a pending ``save_async`` (both tiers, the replica push); returns its directory
        in the most durable tier it reached (``last_saved``: each tier's), raises its error."""
        pending, self._pending = self._pending, None
        if pending is None or pending.reported:
            return None
        pending.wait()
        self.last_saved = pending.outcome()
        return durable(self.last_saved)

    def prepare_async(self, state: StateDict) -> Future[int]:
        """``CheckpointManager.prepare_async`` for both tiers at once (after ``restore``): the
        tiers' host staging pool (one for both; a pool per tier under ``OnBusy.FAST_TIER``) mapped
        and pinned in the background, so the first ``save_async`` of each tier is as cheap as later
        ones. Local (no collective); a future of the bytes added (an error of either is its
        exception)."""
        # One pool for both tiers: prepared once.
        shared = self._parts[Tier.FAST].staging is not None
        futures = [
            m.prepare_async(state)
            for m in (self.fast, self.persistent)
            if m is not None and not (shared and m is self.persistent)
        ]
        return joined(futures)

    def staged(self) -> float:
        """``CheckpointManager.staged`` for both tiers of the last ``save_async``: call it before
        changing saved tensors outside an optimizer step. Returns the seconds it blocked."""
        pending = self._pending
        return (
            sum(f.before_mutation() for f in pending.all_fences()) if pending is not None else 0.0
        )

    def close(self) -> None:
        """Wait for a pending save (raising its error); release both tiers' host staging pools."""
        try:
            self.wait()
        finally:
            for closing in (self.fast, self.persistent):
                if closing is not None:
                    closing.close()

    def _hold_persistent(self, break_lease: bool = False) -> None:
        """Rank 0 takes (or renews) the persistent root's write lease at every save (``hold``)."""
        hold(self._agreement, self._tier, self.rank, break_lease)

    def _push(self, step: int) -> None:
        """Send this rank's files of ``step`` to its peer (``_core.tiersave.push_replicas``)."""
        push_replicas(
            self._restorer.fast,
            self._agreement,
            step,
            self._peers,
            set(self.fast.committed_steps()),
        )

    # ------------------------------------------------------------ restore

    def restore(
        self, state: StateDict, *, mode: ResumeMode = ResumeMode.AUTO, break_lease: bool = False
    ) -> int:
        """Load the newest step every rank can load from some tier; return it (0: fresh start).
        ``HealthPolicy(prefer="verified")`` is refused here: the tier choice takes the newest
        step."""
        check_restore(mode, self.fast.config.health.prefer)
        home = self.persistent or self.fast
        # a pending save_async ends first: the choice below sees its step, or its error is raised
        self.wait()
        # The first save_async ahead, per tier (one pool for both: armed after the load's read).
        for tier, known in ((Tier.FAST, self.fast), (Tier.PERSISTENT, self.persistent)):
            if known is not None and self._parts[tier].staging is None:
                known.queue.known(state, self._parts[tier].bound())
        if mode is ResumeMode.NEVER:
            return home.restore(state, mode=mode, break_lease=break_lease)
        roots = {
            t: self._parts[t].bound() for t in Tier if t is Tier.FAST or self.persistent is not None
        }
        check_leases(self._agreement, roots, self._tier, break_lease)
        # Fast steps whose fetch failed (the same on every rank: an agreed error).
        broken: dict[int, str] = {}
        while True:
            choice = self._choose(broken)
            if not choice.tier:
                # Nothing committed anywhere: the manager's own fresh start.
                return home.restore(state, mode=mode, break_lease=break_lease)
            if choice.fell_back:
                log.warning("ckptguard: %s", choice.detail)
            else:
                log.info("ckptguard: %s", choice.detail)
            if not choice.senders:
                break
            try:
                self._restorer.fetch(choice)
                break
            except CheckpointIncompleteError as exc:
                # A damaged replica: the next choice, never a guess.
                broken[choice.step] = str(exc)
                log.warning("ckptguard: %s; choosing again without fast step %d", exc, choice.step)
        tier = Tier(choice.tier)
        mgr = self.fast if tier is Tier.FAST else self.persistent
        assert mgr is not None
        path = mgr.root / self._naming.name(choice.step)
        if tier is Tier.PERSISTENT and self._tier is not None:
            # An object store's: downloaded into the staging root first.
            path = self._tier.bring(choice.step)
        where: dict[str, str | list[int]] = {
            "tier_detail": choice.detail,
            "replica_ranks": sorted(int(r) for r in choice.senders),
        }
        sink = self._parts[tier].proof
        assert sink is not None
        # This door's own sink: the restore record says which tier and replicas it read.
        with sink.adding(where):
            step = mgr.restore(state, path=path, break_lease=break_lease)
        self._restorer.align_fast(step, tier)
        for other in Tier:  # both tiers continue the restored trajectory (trust, retention)
            if other is not tier and (self.persistent is not None or other is Tier.FAST):
                self._parts[other].commits.resumed(step)
        return step

    def _choose(self, broken: dict[int, str]) -> Choice:
        """The newest step every rank can load from some tier, agreed (``TierRestore.choose``)."""
        return gather_decide(
            self._agreement,
            "tiers.choose",
            self._restorer.view(),
            lambda views: self._restorer.choose(views, broken),
            decision=Choice,
        )

    def resolve(self, *, mode: ResumeMode = ResumeMode.AUTO) -> Resolution:
        """Which step ``restore`` would load and from which tier, agreed by every rank; loads
        nothing (no peer replica is fetched, no object-store step downloaded): the newest step every
        rank can load from some tier, as ``restore`` chooses it. With nothing committed in any tier,
        or ``ResumeMode.NEVER``, the home tier's own answer (a declared fresh start, or MUST's
        refusal)."""
        check_restore(mode)
        self.wait()
        if mode is ResumeMode.NEVER:
            return self._home().resolve(mode=mode)
        choice = self._choose({})
        return (
            self._restorer.resolution(choice, mode)
            if choice.tier
            else self._home().resolve(mode=mode)
        )

    # ------------------------------------------------------------ proof records and queries

    def _home(self) -> CheckpointManager:
        return self.persistent or self.fast

    def _home_sink(self) -> ProofSink:
        return self._parts[  # type: ignore
            Tier.PERSISTENT if self.persistent is not None else Tier.FAST
        ].proof

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
        """``CheckpointManager.record_step`` into the one proof log of both tiers; both tiers'
        health checks see it (one health log: a NaN recorded at a step keeps that step out of either
        tier)."""
        return self._home().record_step(
            step, sample_ids=sample_ids, batch=batch, loss=loss, grad_norm=grad_norm, **extra
        )

    def record_export(self, step: int, payload: Any, *, scales: Any = None) -> ExportFingerprint:
        return self._home().record_export(step, payload, scales=scales)

    def record_logprobs(
        self, step: int, trainer_logprobs: Any, rollout_logprobs: Any
    ) -> dict[str, float]:
        return self._home().record_logprobs(step, trainer_logprobs, rollout_logprobs)

    def record_update(self, step: int, *, grad_norm: float, params_changed: bool) -> None:
        self._home().record_update(step, grad_norm=grad_norm, params_changed=params_changed)
