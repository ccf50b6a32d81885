"""RunCheckpoint: every role of one run (actor, critic, ref, driver, ...) committed as one step.

An RL run is several models and a driver, each on its own ranks (colocated or disaggregated). Saved
by separate managers, a half-written step (the actor's files, not the critic's) could be picked as
the latest. Here every role's part is written by the single-role commit protocol into one run temp
directory, the role's ranks confirming its part (its manifest); then every rank of the run reports,
and rank 0 writes the run manifest listing every role (written last), renames the directory to the
step name and moves the one tracker. A crash anywhere before that leaves the previous step as the
resume target; a step missing a role is never restored. On-disk form: ``_records.runmanifest`` (each
role's part is a step directory that plain DCP reads).

As a CheckpointManager: healthy steps only (one verdict over every rank of every role), one trust
record for the run (``prefer="verified"`` resumes one step for every role), proof records per role
under ``ROOT/proof/<role>/`` (numbered by the role's ranks; ``ckptguard prove`` reads them role by
role). Node-local roots are refused at the first save, before anything of it is written.

Collective rules: every rank of the default process group creates the RunCheckpoint with the
same roles in the same order (each role gets its own gloo group, created by every rank as
``torch.distributed.new_group`` requires) and calls ``save``/``restore`` together, passing the
states of the roles it holds; a rank holding no role passes ``{}``. Inside Ray actors, form the
default group with ``ckptguard.integrations.ray.join_process_group`` first, as for a manager.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch.distributed as dist

from . import _log
from ._commit import pending as _async
from ._commit.busy import BusyRound, check_policy, may_start
from ._commit.publish_run import check_shared_root
from ._commit.savehandle import PendingSave
from ._commit.snapshot import Snapshot, snapshot
from ._context import Actions, Context
from ._core.guard import GuardTarget, recorded_run_save_seconds
from ._core.roles import (
    Fences,
    Role,
    RoleProofs,
    check_roles,
    check_states,
    role_budget,
    role_contexts,
    role_ranks,
)
from ._core.root import Root, check_step
from ._core.rootstage import is_store
from ._core.runrestore import resolve_run, restore_roles
from ._core.runsave import commit_roles, snapshots, staged_snapshots
from ._disk import layout as _layout
from ._dist import make_agreement
from ._records import checks as _checks
from ._records import trust as _trust
from ._records.exportdigest import ExportFingerprint
from ._resume.resolve_local import Resolution
from ._state.derived import DerivedState
from ._types import JsonObject, StateDict
from .config import CheckpointConfig, OnBusy, ResumeMode
from .errors import ConfigError
from .storage._staging import Fence
from .storage.streaming import StreamingStorage

log = _log.logger()


class RunCheckpoint:
    """Saves and restores every role of a run as one step under one checkpoint root.

    ``save(step, states)`` commits every role on every rank or raises on every rank; the
    tracker moves only after the run manifest, listing every role, is written. ``restore``
    restores every role or raises on every rank: every role's files, versions, topology and
    contract are checked before any role reads a tensor, and a step missing a role (or with a
    role's part damaged) is refused naming the role. ``root`` is never created by the
    constructor or by ``restore``; the first ``save`` creates it. Retention (the config's
    policy) deletes whole run steps, never one role's part.
    """

    _created = 0

    def __init__(
        self,
        root: str | os.PathLike[str],
        roles: Sequence[Role],
        *,
        config: CheckpointConfig | None = None,
    ) -> None:
        self.config = config or CheckpointConfig()
        if not isinstance(self.config, CheckpointConfig):
            raise ConfigError(
                f"config must be a CheckpointConfig, got {type(self.config).__name__}"
            )
        # COALESCE would queue each role's snapshot in a 2nd pool per role; FAST_TIER needs 2 tiers.
        check_policy(self.config.async_save.on_busy, "RunCheckpoint", (OnBusy.SKIP, OnBusy.WAIT))
        roles = check_roles(roles)
        if is_store(root):  # Path() would read it as a local directory named "s3:"
            raise ConfigError(
                f"RunCheckpoint({root!r}): give a directory; an s3:// root "
                f"takes a CheckpointManager"
            )
        self.root = Path(root).absolute()
        self._naming = _layout.StepNaming(self.config.storage.dir_template)
        distributed = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if distributed else 1
        self._ranks = role_ranks(roles, world)
        # Created collectively, in the same order on every rank: the counter names store keys alike.
        RunCheckpoint._created += 1
        ns = f"run-{RunCheckpoint._created}"
        run_agreement = make_agreement(None, timeout_s=self.config.timeout_s, namespace=ns)
        me = run_agreement.info.rank
        self._run = Context.of(
            self.root, self.config, self._naming, run_agreement, StreamingStorage(), None, None
        )
        # The roles this rank holds, and its rank in each: ROOT/proof/<role>/.
        self._roles, held = role_contexts(
            roles, self._ranks, self._run, ns, distributed=distributed
        )
        self._derived: dict[str, DerivedState] = {
            r.name: r.derived for r in roles if r.name in self._roles and r.derived is not None
        }
        self._proofs = RoleProofs.open(self.root, held, self.config, rank=me)
        # A run commits on one shared root only: probed at the first save.
        self._shared_root = world == 1
        self._pending: PendingSave | None = None
        # save_async: one host pool per role this rank holds.
        self._staging: dict[str, _async.AsyncStaging] = {}
        self._budget: tuple[int, str] | None = None
        # Own agreement: the busy round runs in the caller's thread, a commit's round in its own.
        self.busy = BusyRound(
            make_agreement(None, timeout_s=self.config.timeout_s, namespace=f"{ns}-busy"),
            label="run step",
            policy=self.config.async_save.on_busy,
        )
        """``save_async``'s ``on_busy`` choices (``busy.skipped_total``), as the manager's."""
        self.core = Root(
            self.root,
            self.config,
            self._naming,
            run_agreement,
            label="run step",
            lease_key="run.lease",
        )
        """The run root's bookkeeping (lease, health, trust, retention, trajectory): ``_core``."""
        self.core.check_lease("create")

    @property
    def last_health(self) -> _trust.HealthVerdict | None:
        """The health verdict of the last ``save`` (``.skip``: it was not committed)."""
        return self.core.last_health

    def preemption_target(self) -> GuardTarget:
        """What a ``PreemptionGuard`` guards: the run's save (all roles), commits, save times."""
        return GuardTarget(
            root=self.root,
            timeout_s=self.config.timeout_s,
            process_group=None,
            save=self.save,
            wait=self.wait,
            committed_here=lambda: list(self.core.committed_here),
            save_seconds=self._save_seconds,
        )

    @property
    def rank(self) -> int:
        """This process's rank in the run (the default process group)."""
        return self._run.rank

    @property
    def roles(self) -> dict[str, list[int]]:
        """Every role and the ranks that hold it."""
        return {name: list(ranks) for name, ranks in self._ranks.items()}

    @property
    def my_roles(self) -> list[str]:
        """The roles this rank holds, in declared order: the keys ``save``, ``restore`` expect."""
        return list(self._roles)

    # ------------------------------------------------------------ queries

    def committed_steps(self) -> list[int]:
        """Run steps with every role's part in place and no newer than the tracker, ascending."""
        return _layout.committed_steps(
            self.root,
            self._naming,
            lambda path: _checks.checked_run_step(path, roles=list(self._ranks)),
        )

    def resolve(
        self,
        *,
        mode: ResumeMode = ResumeMode.AUTO,
        path: str | os.PathLike[str] | None = None,
        prefer: _trust.Prefer | str | None = None,
    ) -> Resolution:
        """Which run step a restore would load and why, agreed by every rank; loads nothing.

        The tracker's step (or ``path``) must be a run step holding every declared role;
        otherwise every rank raises, naming the role that is missing. ``prefer="verified"`` (or
        ``HealthPolicy.prefer``) picks the newest verified run step, as for a CheckpointManager:
        one trust record for the whole run, so every role resumes the same step."""
        if not isinstance(mode, ResumeMode):
            raise ConfigError(f"mode must be a ResumeMode (AUTO, MUST, NEVER), got {mode!r}")
        chosen = self.config.health.prefer if prefer is None else _trust.as_prefer(prefer, "prefer")
        self.wait()  # the run's agreement is not shared with a background commit
        return resolve_run(self._run, list(self._ranks), mode, path, chosen)

    # ------------------------------------------------------------ save

    def save(
        self,
        step: int,
        states: dict[str, StateDict],
        *,
        healthy: bool | None = None,
        loss: Any = None,
        grad_norm: Any = None,
        overwrite: bool = False,
        break_lease: bool = False,
    ) -> Path | None:
        """Commit every role's state as run step ``step`` on every rank, or raise on every rank.

        ``states`` maps each role this rank holds (``my_roles``) to its state dict (the items
        a CheckpointManager takes). Returns the committed step directory.

        Healthy steps only, as ``CheckpointManager.save``: when, on any rank of any role, ``loss``
        or ``grad_norm`` (these arguments, else that rank's ``record_step`` of ``step``) is not
        finite, ``healthy=False`` was passed or the policy's check fails, no role commits on any
        rank: nothing is written, the tracker stays, every rank returns None (``last_health``).
        ``overwrite`` and ``break_lease`` act on this call only, as in
        ``CheckpointManager.save``."""
        if not self._begin(step, states, "save", healthy, loss, grad_norm):
            return None
        started = time.monotonic()
        actions = Actions(overwrite, break_lease)
        snaps = snapshots(
            self._run,
            self._roles,
            self._proofs,
            lambda n, ctx: snapshot(ctx, step, states[n], actions=actions),
            step,
        )
        path = self._commit_roles(step, snaps, started, actions)
        self._cleanup_after(step)
        return path

    def save_async(
        self,
        step: int,
        states: dict[str, StateDict],
        *,
        healthy: bool | None = None,
        loss: Any = None,
        grad_norm: Any = None,
        overwrite: bool = False,
        break_lease: bool = False,
    ) -> PendingSave | None:
        """Snapshot every role's state now and commit run step ``step`` in the background, as
        ``CheckpointManager.save_async`` does for one state: the copies go to spare GPU memory or to
        a pinned host pool per role (this rank's host budget split between the roles it holds), the
        next optimizer step or forward, or ``staged()``, waits for them; the tracker moves when the
        background commit of every role completed; its error is raised by ``wait()`` or by the next
        save, restore or wait, on every rank. The health agreement runs first, as in ``save``."""
        if not self._begin(step, states, "save_async", healthy, loss, grad_norm):
            return None
        started, actions = time.monotonic(), Actions(overwrite, break_lease)
        budget = self._budget = self._budget or role_budget(self.config, len(self._roles))
        skipped = self.busy.pending_cost()
        snaps, fences, pools = staged_snapshots(
            self._run,
            self._roles,
            self._proofs,
            self._staging,
            step,
            states,
            actions,
            budget=budget,
            cost=lambda: skipped,
        )
        resumed = time.monotonic()
        for snap in snaps.values():
            snap.resumed = resumed

        def run() -> Path:
            try:
                return self._commit_roles(step, snaps, started, actions)
            finally:
                for pool in pools:
                    pool.done()

        # PendingSave's and staged()'s fence (duck-typed): host_wait, live_read, before_mutation,
        # waited_s.
        self._pending = PendingSave(
            step,
            run,
            resumed - started,
            fence=cast(Fence, Fences(fences)),
            started=started,
            cleanup=lambda: self._cleanup_after(step),
        )
        return self._pending

    def staged(self) -> float:
        """As ``CheckpointManager.staged``: later changes of the saved tensors of every role are
        safe for the last ``save_async``. Returns the seconds it blocked."""
        pending = self._pending
        if pending is None or pending.fence is None:
            return 0.0
        return pending.fence.before_mutation()

    def wait(self) -> Path | None:
        """Wait for a pending ``save_async``; returns its run step directory, raises its error."""
        pending, self._pending = self._pending, None
        return pending.wait() if pending is not None and not pending.reported else None

    def close(self) -> None:
        """Wait for a pending save (raising its error); free every role's host staging pool now."""
        try:
            self.wait()
        finally:
            for staging in self._staging.values():
                staging.close()

    def _begin(
        self, step: Any, states: Any, where: str, healthy: bool | None, loss: Any, grad_norm: Any
    ) -> bool:
        """The checks of a save, a pending background save waited for, the shared-root probe and the
        health agreement; False: the step is unhealthy and not saved."""
        check_step(step, where)
        self._check_states(states, where)
        if where == "save_async" and not may_start(
            self.busy,
            step,
            self._pending,
            self.config.async_save.on_busy,
            wait=self.wait,
            record=self._record_all,
        ):
            # CheckpointConfig.async_save.on_busy: skipped on every rank, logged and recorded
            return False
        self.wait()
        self._check_shared_root(step)
        return self._healthy(step, healthy, loss, grad_norm)

    def _commit_roles(
        self, step: int, snaps: dict[str, Snapshot], started: float, actions: Actions
    ) -> Path:
        """Prepare the run step, write every role's part, publish (``_core.runsave``): in the
        caller's or a background thread; then the commit and its trust record are the run root's."""
        path = commit_roles(self._run, self._roles, self._ranks, self._proofs, step, snaps, actions)
        self.core.committed(step, seconds=time.monotonic() - started)
        if self.rank == 0:
            self.core.trust_committed(step)
        return path

    def _cleanup_after(self, step: int) -> None:
        """The core's retention (whole run steps: one missing a role is incomplete, ``verify_step``)
        and every role's proof records pruned, after the commit of ``step``: for ``save_async`` in
        its thread, off the caller's path."""
        self.core.cleanup(step, rotate=self.rank == 0, sinks=list(self._proofs.sinks.values()))

    # ------------------------------------------------------------ shared root, health, trust

    def _check_shared_root(self, step: int) -> None:
        """Node-local roots are refused at the first save, before anything of it is written."""
        if not self._shared_root:
            check_shared_root(self._run, step)
            self._shared_root = True

    def _save_seconds(self, step: int) -> float | None:
        """How long ``step``'s run save took: measured here, else from the run step's roles."""
        if step in self.core.save_times:
            return self.core.save_times[step]
        return recorded_run_save_seconds(self.root / self._naming.name(step))

    def _healthy(self, step: int, healthy: bool | None, loss: Any, grad_norm: Any) -> bool:
        """The health agreement of a save over every rank of the run (every role); rank 0 updates
        the trust record, one for the whole run."""
        verdict = self.core.health_round(step, healthy, loss, grad_norm, key="run.health")
        if not verdict.skip:
            return True
        log.error(
            "ckptguard: run step %d NOT committed (no role): unhealthy on %d of %d rank(s): %s. "
            "Nothing was written; the tracker stays under %s",
            step,
            len(verdict.reasons),
            self._run.world,
            verdict.describe(),
            self.root,
        )
        for name in self._roles:
            self._proofs.record(name, "skip", step=step, reasons=verdict.reasons)
        return False

    # ------------------------------------------------------------ proof records

    def _record_all(self, event: str, *, durable: bool = True, **fields: Any) -> None:
        for role in self._roles:
            self._proofs.record(role, event, durable=durable, **fields)

    def record_step(
        self,
        step: int,
        *,
        sample_ids: Any = None,
        batch: Any = None,
        loss: Any = None,
        grad_norm: Any = None,
        role: str | None = None,
        **extra: Any,
    ) -> JsonObject:
        """Record what training step ``step`` of ``role`` consumed and produced on this rank, as
        ``CheckpointManager.record_step`` (``ckptguard prove`` compares a resumed run's replayed
        steps with the killed run's, role by role); its loss and grad_norm are health evidence for
        the save. ``role``: which role's step (None: the one role this rank holds)."""
        return self._proofs.step(
            role,
            step,
            self.core.health,
            sample_ids=sample_ids,
            batch=batch,
            loss=loss,
            grad_norm=grad_norm,
            **extra,
        )

    def record_update(
        self, step: int, *, grad_norm: float, params_changed: bool, role: str | None = None
    ) -> None:
        """Record an optimizer update of ``role``: its gradient norm, whether parameters moved."""
        self._proofs.update(role, step, grad_norm=grad_norm, params_changed=params_changed)

    def record_export(
        self, step: int, payload: Any, *, scales: Any = None, role: str | None = None
    ) -> ExportFingerprint:
        """Record the weights ``role`` exported for rollout at ``step`` (as CheckpointManager's)."""
        return self._proofs.export(role, step, payload, scales=scales)

    def record_logprobs(
        self, step: int, trainer_logprobs: Any, rollout_logprobs: Any, *, role: str | None = None
    ) -> dict[str, float]:
        """Record ``role``'s old-logprob against the rollout's for the same tokens."""
        return self._proofs.logprobs(role, step, trainer_logprobs, rollout_logprobs)

    # ------------------------------------------------------------ restore

    def restore(
        self,
        states: dict[str, StateDict],
        *,
        mode: ResumeMode = ResumeMode.AUTO,
        path: str | os.PathLike[str] | None = None,
        prefer: _trust.Prefer | str | None = None,
        break_lease: bool = False,
    ) -> int:
        """Load the resolved run step into every role's state in place; return its step (0: fresh).

        ``states`` as for ``save``. Every role's files, versions, topology, contract, items and
        keys are checked on every rank before any role reads a tensor; a failure after that (a
        damaged shard, a digest that differs) raises on every rank of the run, so no rank trains
        on a partly restored run. ``prefer`` as in ``resolve``."""
        # An item no save could write too, before anything is read.
        self._check_states(states, "restore")
        self.wait()
        self.core.check_lease("restore", break_lease=break_lease)
        res = self.resolve(mode=mode, path=path, prefer=prefer)
        if res.fresh:
            log.warning("ckptguard: %s", res.describe())
            for name, ctx in self._roles.items():
                self._proofs.record(
                    name, "restore", step=0, fresh=True, reason=res.reason, world_size=ctx.world
                )
            return 0
        log.info("ckptguard: %s (roles %s)", res.describe(), ", ".join(self._ranks))
        restore_roles(
            self._run,
            self._roles,
            res,
            states,
            names=list(self._ranks),
            derived=self._derived,
            proofs=self._proofs,
        )
        self.core.restarted_at(res.step)
        return res.step

    # ------------------------------------------------------------ guards

    def _check_states(self, states: Any, where: str) -> None:
        check_states(states, mine=set(self._roles), ranks=self._ranks, rank=self.rank, where=where)
