"""CheckpointManager: the public face of the File and Resume-state contracts.

Every public method is collective: all ranks of the group call it in the same order.
The manager owns the cross-cutting guards (arguments, timeouts, logging); the protocol
itself lives in ``_commit`` (save) and ``_restore`` (resolve, restore).
"""

from __future__ import annotations

import datetime as _dt
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from . import _faults, _log
from ._commit import layout as _layout
from ._commit import lease as _lease
from ._commit import manifest as _manifest
from ._commit import pending as _async
from ._commit import protocol as _commit
from ._commit import retention
from ._commit import trust as _trust
from ._commit.pending import PendingSave
from ._dist import Wire, gather_decide, make_agreement, on_every_rank
from ._resume import contract as _contract
from ._resume import restore as _restore
from ._resume.derived import DerivedState
from ._resume.expert import ExpertParallel
from ._resume.prooflog import ProofLog
from ._resume.trajectory import fingerprint
from .config import CheckpointConfig, ResumeMode
from .errors import CheckpointError, ConfigError, UnsafeCheckpointError
from .storage._staging import Fence
from .storage.base import Storage, StorageContext
from .storage.streaming import StreamingStorage

log = _log.logger()


@dataclass(frozen=True)
class _Empty(Wire):
    """A rank's part of an agreement where only rank 0 acts."""


@dataclass(frozen=True)
class _Written(Wire):
    path: str


def _addresses(state: dict[str, Any]) -> dict[str, int]:
    """data_ptr of every parameter and buffer of the modules in ``state`` (local shard for DTensor).

    CUDA graphs and colocated rollout engines hold these addresses; a restore must copy into
    the existing storages, never swap in new tensors.
    """
    import torch

    out = {}
    for name, value in state.items():
        if isinstance(value, torch.nn.Module):
            for key, t in [*value.named_parameters(), *value.named_buffers()]:
                local = t.to_local() if hasattr(t, "to_local") else t
                out[f"{name}.{key}"] = local.data_ptr()
    return out


def _moved(before: dict[str, int], after: dict[str, int]) -> list[str]:
    return sorted(k for k in before if after.get(k) != before[k])


class CheckpointManager:
    """Saves and restores a dict of named state items under one checkpoint root.

    ``root`` is never created by the constructor or by ``restore``: a mistyped path must
    not turn into a silent fresh start. The first ``save`` creates it.

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
    ) -> None:
        self.config = config or CheckpointConfig()
        if not isinstance(self.config, CheckpointConfig):
            raise ConfigError(f"config must be a CheckpointConfig, got {type(self.config).__name__}")
        self.root = Path(root).absolute()
        # Managers are created collectively, in the same order on every rank, so a
        # counter names this one's store keys alike everywhere; the root path would not
        # (node-local roots may differ per node).
        CheckpointManager._created += 1
        agreement = make_agreement(
            process_group, timeout_s=self.config.timeout_s, namespace=f"manager-{CheckpointManager._created}"
        )
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
        self._restored_step: int | None = None
        self._pending: _async.PendingSave | None = None
        self._group = process_group  # a PreemptionGuard agrees over the same ranks
        self._health = _trust.HealthLog()
        self._committed_here: list[int] = []  # this process's commits: its trajectory, with the restored step
        self._unobserved: list[tuple[Any, Any]] = []  # health verdicts a node's publisher has still to record
        self._skipped: dict[int, str] = {}  # steps a save skipped as unhealthy (on any rank), with the reasons
        self.last_health: _trust.HealthVerdict | None = None
        """The health verdict of the last ``save``/``save_async`` call (``.skip``: it was not committed)."""
        self._staging = _async.AsyncStaging()
        self.derived = derived
        """Parameter-derived caches; a restore invalidates them (``DerivedState.mark_restored``)."""
        self._proof = ProofLog(self.root, agreement.info.rank)
        # A TieredCheckpoint sends both tiers' records to one root (the one prove reads) and tags the
        # save and restore records with their tier.
        self._proof_root = self.root
        self._proof_fields: dict[str, Any] = {}
        _faults.arm_pause_from_env(info.rank)  # only under `ckptguard rehearse`
        self._ctx = _commit.Context(
            root=self.root,
            config=self.config,
            naming=_layout.StepNaming(self.config.dir_template),
            agreement=agreement,
            storage=storage or StreamingStorage(),
            storage_ctx=StorageContext(rank=info.rank, world_size=info.world_size, process_group=group),
            expert=expert_parallel,
        )
        self._check_lease("create")

    def _check_lease(self, where: str) -> None:
        """Look for another live run holding the root's write lease: at creation a loud warning
        (a manager that only reads, ``committed_steps`` or ``resolve``, stays usable), at
        ``restore`` a refusal on every rank, so a duplicate launch stops before its first training
        step instead of at its first save. Rank 0 looks and never writes. ``break_lease`` leaves
        it to the save."""
        if self.config.break_lease:
            return
        _lease.check_on_every_rank(
            self._ctx.agreement, self.root, ttl_s=self.config.lease_ttl_s, where=where, key=f"lease.{where}"
        )

    @property
    def rank(self) -> int:
        return self._ctx.rank

    @property
    def world_size(self) -> int:
        return self._ctx.world

    # ------------------------------------------------------------ queries

    def committed_steps(self) -> list[int]:
        """Steps with a valid manifest and no newer than the tracker, ascending."""
        return _layout.committed_steps(self.root, self._ctx.naming, _manifest.read)

    def resolve(
        self,
        *,
        mode: ResumeMode = ResumeMode.AUTO,
        path: str | os.PathLike[str] | None = None,
        prefer: _trust.Prefer | str | None = None,
    ) -> _restore.Resolution:
        """Which step a restore would load and why, agreed by all ranks; loads nothing.

        ``prefer="verified"`` (or ``HealthPolicy.prefer``) makes AUTO and MUST pick the newest
        verified step no newer than the tracker (``ckptguard._commit.trust``); resuming it while
        newer candidates exist is a rollback: saving their steps again needs ``overwrite=True``.
        """
        if not isinstance(mode, ResumeMode):
            raise ConfigError(f"mode must be a ResumeMode (AUTO, MUST, NEVER), got {mode!r}")
        chosen = self.config.health.prefer if prefer is None else _trust.as_prefer(prefer, "prefer")
        self.wait()  # the agreement is not shared with a background commit
        return _restore.resolve(self._ctx, mode, Path(path) if path is not None else None, prefer=chosen)

    # ------------------------------------------------------------ save / restore

    def save(
        self, step: int, state: dict[str, Any], *, healthy: bool | None = None, loss: Any = None, grad_norm: Any = None
    ) -> Path | None:
        """Commit ``state`` as step ``step`` on every rank, or raise on every rank.

        Returns the committed step directory. On any failure the tracker does not
        move and the previous committed step stays the resume target.

        Healthy steps only (``CheckpointConfig.health``): when, on any rank, ``loss`` or
        ``grad_norm`` (these arguments, else that rank's ``record_step`` of ``step``) is not
        finite, ``healthy=False`` was passed or the policy's check fails, no rank commits: the
        reasons are logged as an error, nothing is written, the tracker stays, and every rank
        returns None (``last_health`` holds the verdict). It returns rather than raises: a
        skipped step is the policy working, not a failed save, and the loop decides whether to
        go on to its next save or roll back; ``if mgr.save(...) is None`` tells it.
        """
        self._check_step(step, "save")
        self._check_state(state, "save")
        self.wait()
        if not self._healthy(step, healthy, loss, grad_norm):
            return None
        return self._committed(_commit.save(self._ctx, step, state), step)

    def save_async(
        self, step: int, state: dict[str, Any], *, healthy: bool | None = None, loss: Any = None, grad_norm: Any = None
    ) -> PendingSave | None:
        """Snapshot ``state`` now and commit step ``step`` in the background.

        The caller blocks only until the snapshot's copies are queued: into spare GPU memory
        within ``async_gpu_bytes``, else into the reusable pinned host pool within
        ``async_host_bytes`` (None: the budget the memory contract leaves), on a side stream.
        The next optimizer step (any optimizer: a step pre-hook), the next forward of a module
        with buffers, or ``staged()`` waits for the copies; what does not fit the pool is read
        live by the background writer and that wait lasts until it was read (reported, never a
        silent synchronous save). The tracker moves when the background commit completes; its
        error is raised by ``wait()``, or by the next save, restore or wait.
        The health agreement runs before the snapshot, as in ``save``: an unhealthy step
        snapshots nothing and returns None.
        """
        self._check_step(step, "save_async")
        self._check_state(state, "save_async")
        self.wait()
        prepared = self._prepare_async(step, state, healthy, loss, grad_norm)
        if prepared is None:
            return None
        run, fence, start = prepared
        self._pending = _async.PendingSave(step, run, time.monotonic() - start, fence=fence, started=start)
        return self._pending

    def _prepare_async(
        self, step: int, state: dict[str, Any], healthy: bool | None, loss: Any, grad_norm: Any
    ) -> tuple[Callable[[], Path], Fence, float] | None:
        """The caller's part of ``save_async`` (the health agreement, the snapshot, the staged copies
        queued): returns the background commit, the mutation fence and the start time, or None for
        an unhealthy step. A ``TieredCheckpoint`` runs several managers' commits in one thread: one
        process's c10d store client serves one blocking wait at a time, so two commits' agreements
        in two threads hold each other's ranks until the timeout."""
        if not self._healthy(step, healthy, loss, grad_norm):
            return None
        start = time.monotonic()
        # The divergence guard hashes every tensor: on the staged copies, in the background.
        snap = _commit.snapshot(self._ctx, step, state, guard=False)
        staged = self._staging.stage(snap, state, self.config)
        if staged.live_bytes:
            log.warning(
                "ckptguard: step %d: %d of %d B do not fit the host staging budget (%d B): the background writer "
                "reads them from the live tensors, and the next optimizer step waits until it has (see "
                "PendingSave.mutation_wait_seconds); raise CheckpointConfig.async_host_bytes to stage them",
                step, staged.live_bytes, staged.live_bytes + snap.staged_bytes, staged.host_budget,
            )
        pool = self._staging.pool

        def run() -> Path:
            try:
                return self._committed(_commit.commit(self._ctx, snap), step)
            finally:
                if pool is not None:
                    pool.done()

        snap.resumed = time.monotonic()
        return run, staged.fence, start

    def staged(self) -> float:
        """Make later changes of the saved tensors safe for the last ``save_async``: work queued on the
        current CUDA stream from now on runs after its copies (the CPU is not held for them), and what
        did not fit the pool has been read (the CPU waits for that). Call it before changing saved
        tensors outside an optimizer step (a manual ``p.add_()``, a weight sync into the model).
        Returns the seconds it blocked."""
        pending = self._pending
        if pending is None or pending.fence is None:
            return 0.0
        return pending.fence.before_mutation()

    def close(self) -> None:
        """Wait for a pending save (raising its error) and release the host staging pool now."""
        try:
            self.wait()
        finally:
            self._staging.close()

    def wait(self) -> Path | None:
        """Wait for a pending ``save_async``; returns its step directory, raises its error."""
        pending, self._pending = self._pending, None
        return pending.wait() if pending is not None and not pending.reported else None

    def _committed(self, path: Path, step: int) -> Path:
        log.info("ckptguard: committed step %d at %s", step, path)
        self._record("save", step=step, path=str(path), plan=self.config.proof.as_dict(), world_size=self.world_size)
        self._committed_here.append(step)
        self._observe_held()
        if self.rank == 0 or self._ctx.node_publisher:  # node-local roots: every node keeps its own record
            self._trust_write("commit", lambda: _trust.committed(
                self.root, step, self.config.health.verify_after,
                on_disk=_layout.step_dirs(self.root, self._ctx.naming)))
        self._rotate(step)
        self._proof.prune(self._ctx.naming)  # proof records no retained checkpoint's proof reads again
        return path

    def _healthy(self, step: int, healthy: bool | None, loss: Any, grad_norm: Any) -> bool:
        """The health agreement of a save: every rank's view, one verdict; rank 0 updates the trust record."""
        policy = self.config.health

        def local() -> _trust.HealthView:  # a bad argument or a raising check fails the save on every rank
            return self._health.save_view(policy, step, healthy, loss, grad_norm, self._skipped.get(step))

        view = on_every_rank(self._ctx.agreement, "save.health.local", local)

        def decide(views: list[_trust.HealthView]) -> _trust.HealthVerdict:
            verdict = _trust.agree(views, step)
            mine = set(self._committed_here)
            restored = self._restored_step or 0

            def eligible(k: int) -> bool:
                return k in mine or k <= restored

            promoted = self._trust_write(
                "observe", lambda: _trust.observe(self.root, verdict.healthy, verdict.unhealthy, eligible))
            if promoted:
                log.debug("ckptguard: steps %s are verified (%d healthy steps after each)", promoted,
                          policy.verify_after)
            return verdict

        verdict = gather_decide(self._ctx.agreement, "save.health", view, decide, decision=_trust.HealthVerdict)
        if self.rank != 0:
            # Node-local roots: each node's publisher keeps its node's trust record as rank 0 keeps its own,
            # so prefer="verified" resolves the same step on every node. Whether this rank publishes a node
            # is known only after a commit (the first save of a process included): held until then.
            mine, restored = set(self._committed_here), self._restored_step or 0
            self._unobserved.append((verdict, lambda k: k in mine or k <= restored))
            if self._ctx.node_publisher:  # known from this process's last commit: record it now
                self._observe_held()
        self.last_health = verdict
        if not verdict.skip:
            return True
        tracker = self._safe_tracker()
        log.error("ckptguard: step %d NOT committed: unhealthy on %d of %d rank(s): %s. Nothing was written; the "
                  "tracker stays at %s under %s", step, len(verdict.reasons), self.world_size, verdict.describe(),
                  tracker, self.root)
        self._record("skip", step=step, reasons=verdict.reasons)
        self._skipped[step] = verdict.describe()
        return False

    def _observe_held(self) -> None:
        """A node's publisher (rank != 0, node-local roots) records the health verdicts rank 0 recorded,
        in the same order; on a shared root (not a publisher) they are dropped."""
        held, self._unobserved = self._unobserved, []
        if self.rank == 0 or not self._ctx.node_publisher:
            return
        for verdict, eligible in held:
            self._trust_write("observe", lambda v=verdict, e=eligible: _trust.observe(
                self.root, v.healthy, v.unhealthy, e))

    def _safe_tracker(self) -> str:
        try:
            tracker = _layout.read_tracker(self.root)
            return "no step (nothing committed yet)" if tracker is None else str(tracker)
        except CheckpointError as exc:
            return f"? ({exc})"

    def _trust_write(self, what: str, write: Any) -> Any:
        """Rank 0's sidecar updates; a failure is logged, never raised (the commit is what matters)."""
        try:
            return write()
        except (OSError, CheckpointError) as exc:
            log.warning("ckptguard: could not update the trust record %s/%s at %s (%s: %s); the steps it "
                        "concerns stay candidates", self.root, _trust.TRUST_NAME, what, type(exc).__name__, exc)
            return None

    @staticmethod
    def _check_step(step: Any, where: str) -> None:
        if not isinstance(step, int) or isinstance(step, bool) or step < 1:
            raise ConfigError(f"{where}(step={step!r}): step must be an int >= 1 (0 is reserved for 'fresh start')")

    def _rotate(self, step: int) -> None:
        """Rank 0 applies retention after the commit (on node-local roots, each node's publishing rank
        on its node's root); a failure is logged, never raised."""
        policy = self.config.retention
        if policy is None or not (self.rank == 0 or self._ctx.node_publisher):
            return
        protect = {step} | ({self._restored_step} if self._restored_step else set())
        try:
            report = retention.apply(self.root, self._ctx.naming, policy, protect=protect)
        except Exception as exc:  # rotation must never stop training
            log.warning(
                "ckptguard: retention after step %d failed (%s: %s); retried at the next save",
                step,
                type(exc).__name__,
                exc,
            )
            return
        if report.deleted:
            log.info("ckptguard: retention deleted steps %s, kept %s", report.deleted, report.kept)
        for name, why in report.not_counted.items():
            log.warning("ckptguard: %s is not counted as a kept checkpoint: %s", name, why)

    def restore(
        self,
        state: dict[str, Any],
        *,
        mode: ResumeMode = ResumeMode.AUTO,
        path: str | os.PathLike[str] | None = None,
        prefer: _trust.Prefer | str | None = None,
    ) -> int:
        """Load the resolved checkpoint into ``state`` in place; return its step (0: fresh).

        Tensors are written into the existing tensors; plain values are replaced in
        ``state``. Logs one line with the resolved path and step before returning.
        ``prefer`` as in ``resolve``.
        """
        self._check_state(state, "restore")
        self.wait()
        self._check_lease("restore")
        res = self.resolve(mode=mode, path=path, prefer=prefer)
        if res.fresh:
            log.warning("ckptguard: %s", res.describe())
            self._record("restore", step=0, fresh=True, reason=res.reason, world_size=self.world_size)
            return 0
        log.info("ckptguard: %s", res.describe())
        seen: dict[str, dict[str, bool]] = {"digests": {}, "layout_free": {}}
        before = _addresses(state)
        where: dict[str, Any] = {"world_size": self.world_size, "plan": self.config.proof.as_dict()}
        try:
            done = _restore.restore(
                self._ctx, state, res, on_verified=lambda m, kind="digests": seen[kind].update(m)
            )
        except Exception as exc:  # recorded as a failed restore (prove shows it as FAIL), then raised
            self._record("restore", step=res.step, path=str(res.path), digests_match=seen["digests"],
                         layout_free_match=seen["layout_free"], ok=False,
                         error=f"{type(exc).__name__}: {exc}"[:2000], **where)
            raise
        if done.reshard is not None:  # old -> new world, the rules, this rank's RNG streams (prove shows them)
            where["reshard"] = done.reshard
        self._record(
            "restore",
            step=done.step,
            path=str(res.path),
            digests_match=done.digests_match,
            layout_free_match=done.layout_free_match,
            source_rank=done.source_rank,
            saved_world_size=done.saved_world_size,
            format_version=done.format_version,
            addresses_changed=_moved(before, _addresses(state)),
            ok=True,
            **where,
        )
        self._restored_step = done.step
        # A restore (a rollback within this process included) starts a new trajectory from done.step: the
        # commits and skips above it belong to the abandoned one (a preemption save must not take step N
        # as "committed already", and trust must not promote those steps).
        self._committed_here = [s for s in self._committed_here if s <= done.step]
        self._skipped = {s: why for s, why in self._skipped.items() if s <= done.step}
        if self.derived is not None:
            self.derived.mark_restored(done.step)
        return done.step

    # ------------------------------------------------------------ proof records

    def record_export(self, step: int, payload: Any, *, scales: Any = None) -> dict[str, str]:
        """Record the weights exported for rollout at ``step`` (after ``step`` updates).

        ``payload`` is what the rollout receives (tensors or bytes); ``scales`` the
        quantization scales sent with it. The first export after a restore must equal
        the export the saving run recorded for the same step.
        """
        from ._resume.prooflog import export_fingerprint

        fp = export_fingerprint(payload, scales)
        self._record("export", step=step, fingerprint=fp)
        return fp

    def record_logprobs(self, step: int, trainer_logprobs: Any, rollout_logprobs: Any) -> dict[str, float]:
        """Record the trainer's old-logprob against the rollout's for the same tokens."""
        from ._resume.prooflog import logprob_diff

        diff = logprob_diff(trainer_logprobs, rollout_logprobs)
        self._record("logprobs", step=step, **dict[str, Any](diff))
        return diff

    def record_update(self, step: int, *, grad_norm: float, params_changed: bool) -> None:
        """Record an optimizer update: its gradient norm and whether the parameters moved."""
        self._record("update", step=step, grad_norm=float(grad_norm), params_changed=bool(params_changed))

    def record_step(
        self,
        step: int,
        *,
        sample_ids: Any = None,
        batch: Any = None,
        loss: Any = None,
        grad_norm: Any = None,
        **extra: Any,
    ) -> dict[str, Any]:
        """Record what training step ``step`` consumed and produced, on this rank.

        ``step`` is the number the step's state is saved under (the first step after a restore
        of step k is k+1). ``sample_ids`` are the ids or indices of the samples or prompts it
        read; ``batch`` the tensors it read (hashed bitwise; a dict or list of tensors is
        fine); ``loss``, ``grad_norm`` and any ``extra`` scalar (reward, lr, ...) are kept
        exactly. After a resume, ``ckptguard prove`` compares the steps the resumed run replays
        with the killed run's records of the same steps: data order exactly, the values
        exactly where ``ProofPlan(deterministic=True)``. Returns the recorded fields.
        """
        self._check_step(step, "record_step")
        fields = fingerprint(sample_ids, batch, loss, grad_norm, extra)
        # Judged now, shipped with the next save: the evidence of healthy and unhealthy steps.
        metrics: dict[str, Any] = dict(fields.get("extra", {}))
        metrics.update({k: fields[k] for k in ("loss", "grad_norm") if k in fields})
        self._health.note(self.config.health, step, metrics)
        self._record("step", durable=False, step=step, **fields)
        return fields

    def _record(self, event: str, *, durable: bool = True, **fields: Any) -> None:
        if not self.config.record_proof:
            return
        tagged = self._proof_fields if event in ("save", "restore") else {}
        record = self._proof.build(event, **{**tagged, **fields})
        # Never create the root for a record: a mistyped path must stay visible. Until the first
        # save creates it, records are held and then written ahead of the save's.
        if not self._proof_root.is_dir():
            self._proof.hold(record)
            return
        try:
            self._proof.write(record, durable=durable)
        except (OSError, UnsafeCheckpointError) as exc:  # read-only/full root or symlinked proof/: never fatal
            log.warning("ckptguard: could not append the %s proof record under %s (%s)", event, self.root, exc)
        if self._proof.dropped:
            log.warning("ckptguard: %d proof records made before %s existed were dropped (more than %d held)",
                        self._proof.dropped, self.root, self._proof.HELD_MAX)
            self._proof.dropped = 0

    def adopt(self, path: str | os.PathLike[str], reason: str) -> Path:
        """Adopt the run chain of the checkpoint at ``path`` into this root (a new contract
        phase), so ``restore(path=...)`` may continue from it. Rank 0 writes; collective."""
        from ._commit import manifest as manifest_mod

        chain = manifest_mod.read(Path(path)).chain_id

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

    def _on_rank0(self, phase: str, write: Any) -> Path:
        """Rank 0 writes a root-level file; every rank returns its path or raises its error."""
        self.wait()

        def decide(_: list[_Empty]) -> _Written:
            return _Written(str(write()))

        return Path(gather_decide(self._ctx.agreement, phase, _Empty(), decide, decision=_Written).path)

    @staticmethod
    def _check_state(state: Any, where: str) -> None:
        if not isinstance(state, dict) or not state:
            raise ConfigError(
                f"{where}(state): state must be a non-empty dict of named items, got {type(state).__name__}"
            )
