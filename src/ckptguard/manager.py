"""CheckpointManager: the public face of the File and Resume-state contracts.

Every public method is collective: all ranks of the group call it in the same order.
The manager owns the cross-cutting guards (arguments, timeouts, logging); the protocol
itself lives in ``_commit`` (save) and ``_restore`` (resolve, restore).
"""

from __future__ import annotations

import datetime as _dt
import os
import time
from collections.abc import Iterable
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
from ._commit.pending import PendingSave
from ._dist import Wire, gather_decide, make_agreement
from ._resume import contract as _contract
from ._resume import restore as _restore
from ._resume.derived import DerivedState
from ._resume.expert import ExpertParallel
from ._resume.prooflog import ProofLog
from ._resume.trajectory import fingerprint
from .config import CheckpointConfig, ResumeMode
from .errors import CheckpointError, ConfigError, LeaseHeldError, UnsafeCheckpointError
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
        self.derived = derived
        """Parameter-derived caches; a restore invalidates them (``DerivedState.mark_restored``)."""
        self._proof = ProofLog(self.root, agreement.info.rank)
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

        def decide(_: list[_Empty]) -> _Empty:
            if not self.root.is_dir():
                return _Empty()
            try:
                _lease.check_free(self.root, ttl_s=self.config.lease_ttl_s)
            except LeaseHeldError as exc:
                if where != "create":
                    raise
                log.warning("ckptguard: %s (restore and save will refuse)", exc)
            return _Empty()

        gather_decide(self._ctx.agreement, f"lease.{where}", _Empty(), decide, decision=_Empty)

    @property
    def rank(self) -> int:
        return self._ctx.rank

    @property
    def world_size(self) -> int:
        return self._ctx.world

    # ------------------------------------------------------------ queries

    def committed_steps(self) -> list[int]:
        """Steps with a valid manifest and no newer than the tracker, ascending."""
        tracker = _layout.read_tracker(self.root)
        if tracker is None:
            return []
        out = []
        for step, path in sorted(_layout.step_dirs(self.root, self._ctx.naming).items()):
            if step > tracker:
                continue
            try:
                _manifest.read(path)
            except CheckpointError:
                continue
            out.append(step)
        return out

    def resolve(
        self, *, mode: ResumeMode = ResumeMode.AUTO, path: str | os.PathLike[str] | None = None
    ) -> _restore.Resolution:
        """Which step a restore would load and why, agreed by all ranks; loads nothing."""
        if not isinstance(mode, ResumeMode):
            raise ConfigError(f"mode must be a ResumeMode (AUTO, MUST, NEVER), got {mode!r}")
        self.wait()  # the agreement is not shared with a background commit
        return _restore.resolve(self._ctx, mode, Path(path) if path is not None else None)

    # ------------------------------------------------------------ save / restore

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Commit ``state`` as step ``step`` on every rank, or raise on every rank.

        Returns the committed step directory. On any failure the tracker does not
        move and the previous committed step stays the resume target.
        """
        self._check_step(step, "save")
        self._check_state(state, "save")
        self.wait()
        return self._committed(_commit.save(self._ctx, step, state), step)

    def save_async(self, step: int, state: dict[str, Any]) -> PendingSave:
        """Snapshot ``state`` now and commit step ``step`` in the background.

        The caller blocks only for the snapshot (into spare GPU memory within
        ``async_gpu_bytes``, else host memory within ``async_host_bytes``; a snapshot that
        fits neither is saved synchronously). The tracker moves when the background commit
        completes; its error is raised by ``wait()``, or by the next save, restore or wait.
        """
        self._check_step(step, "save_async")
        self._check_state(state, "save_async")
        self.wait()
        start = time.monotonic()
        snap = _commit.snapshot(self._ctx, step, state)
        cfg = self.config
        if not _async.stage(snap, gpu_bytes=cfg.async_gpu_bytes, host_bytes=cfg.async_host_bytes):
            log.warning("ckptguard: step %d does not fit the async budgets (gpu %d B, host %d B): saving "
                        "synchronously", step, cfg.async_gpu_bytes, cfg.async_host_bytes)
            path = self._committed(_commit.commit(self._ctx, snap), step)
            self._pending = _async.PendingSave.completed(step, path, time.monotonic() - start)
        else:
            run = lambda: self._committed(_commit.commit(self._ctx, snap), step)  # noqa: E731
            self._pending = _async.PendingSave(step, run, time.monotonic() - start)
        return self._pending

    def wait(self) -> Path | None:
        """Wait for a pending ``save_async``; returns its step directory, raises its error."""
        pending, self._pending = self._pending, None
        return pending.wait() if pending is not None and not pending.reported else None

    def _committed(self, path: Path, step: int) -> Path:
        log.info("ckptguard: committed step %d at %s", step, path)
        self._record("save", step=step, path=str(path), plan=self.config.proof.as_dict(), world_size=self.world_size)
        self._rotate(step)
        self._proof.prune(self._ctx.naming)  # proof records no retained checkpoint's proof reads again
        return path

    @staticmethod
    def _check_step(step: Any, where: str) -> None:
        if not isinstance(step, int) or isinstance(step, bool) or step < 1:
            raise ConfigError(f"{where}(step={step!r}): step must be an int >= 1 (0 is reserved for 'fresh start')")

    def _rotate(self, step: int) -> None:
        """Rank 0 applies retention after the commit; a failure is logged, never raised."""
        policy = self.config.retention
        if policy is None or self.rank != 0:
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
    ) -> int:
        """Load the resolved checkpoint into ``state`` in place; return its step (0: fresh).

        Tensors are written into the existing tensors; plain values are replaced in
        ``state``. Logs one line with the resolved path and step before returning.
        """
        self._check_state(state, "restore")
        self.wait()
        self._check_lease("restore")
        res = self.resolve(mode=mode, path=path)
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
        self._record("step", durable=False, step=step, **fields)
        return fields

    def _record(self, event: str, *, durable: bool = True, **fields: Any) -> None:
        if not self.config.record_proof:
            return
        record = self._proof.build(event, **fields)
        # Never create the root for a record: a mistyped path must stay visible. Until the first
        # save creates it, records are held and then written ahead of the save's.
        if not self.root.is_dir():
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
