"""ObjectStoreCheckpoint: a CheckpointManager whose committed steps are published to an object store.

Contract. ``save(step, state)`` first commits ``step`` to a local staging root with the ordinary
protocol (every rank's files, digests, manifest, tracker: ``CheckpointManager``), then publishes
that committed directory to ``s3://bucket/prefix`` (``ckptguard.storage.s3``): rank 0
takes the store's write lease and opens an attempt, every rank uploads its own files of the step
(multipart, checksummed parts), and once every rank reported success rank 0 creates the marker
(``If-None-Match: *``) and moves the tracker (``If-Match``, never backwards). Any failure raises on
every rank; nothing of the step is visible on the store unless its marker was created.

``restore(state)`` resolves on the store (the tracker and that step's marker, nothing else), has
each host's ranks download the step's objects into the staging root (a share each; skipped when
the staging root already holds that exact step), and restores from there with the local manager,
so every check of a local restore (files, digests, contract, topology) applies unchanged.

``save_async`` snapshots as ``CheckpointManager.save_async`` does and runs the staging commit and
the store's publish in one background thread; ``save``, ``save_async`` (``OnBusy.WAIT``),
``restore``, ``resolve``, ``wait`` and ``close`` wait for it first and raise its error.

The one door shape (``ckptguard.Checkpointer``) holds here with two readings a store imposes:
``save``/``wait``/``PendingCommit.wait`` return the step's directory in the staging root (committed
there and on the store; ``last_url`` is the store's marker URL), and ``resolve`` returns a
``Resolution`` whose ``url`` is the marker and whose ``path`` is where ``restore`` loads the step
(the staging root's directory, downloaded there by ``restore`` when absent). The ``record_*`` calls
go to the staging root's proof log, copied to the store's ``proof/`` at every publish and at close.

``publish(step, step_dir)`` is the seam a ``Publisher`` calls: it takes a committed local step
directory and does the store part alone. The door composes; the rounds over the ranks are the commit
side's (``_commit.storepublish``: the lease, the attempt, the uploads, marker and tracker, rotation, a
staging commit the store never made) and the restore side's (``_resume.storefetch``: the download).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._agree import Wire, gather_decide
from ._commit import storepublish as _publish
from ._commit.busy import BusyRound, check_policy, may_start
from ._commit.pending import PendingSave
from ._context import Actions
from ._core.guard import GuardTarget
from ._core.parts import Parts
from ._core.root import ProofSink, check_state, check_step
from ._disk.layout import MANIFEST_NAME, atomic_write_bytes
from ._dist import make_agreement
from ._records.proofreader import records_dir
from ._records.proofwriter import ExportFingerprint
from ._records.retention import KeepLast, RetentionPolicy
from ._resume.resolve_local import Resolution
from ._resume.storefetch import fetch_step, resolve
from ._types import JsonObject, StateDict
from .config import BlockingBudget, CheckpointConfig, OnBusy, ResumeMode
from .errors import CheckpointError, ConfigError
from .manager import CheckpointManager
from .storage.base import Storage
from .storage.s3 import Consistency, ObjectStore, ObjectStoreOptions, StoreURL

__all__ = ["Consistency", "ObjectStoreCheckpoint", "ObjectStoreOptions", "StoreURL"]

log = logging.getLogger("ckptguard")


@dataclass(frozen=True)
class _Empty(Wire):
    pass


@dataclass(frozen=True)
class _Chosen(Wire):
    step: int
    reason: str


class ObjectStoreCheckpoint:
    """Checkpoints on an S3-compatible object store, written through a local staging root.

    ``url`` is ``s3://bucket/prefix``; ``staging`` a local directory (node-local or shared; the
    same path on every node) that holds the newest step written or restored here. ``config``
    is the ``CheckpointConfig`` of the staging manager, whose ``retention`` is applied on the
    store (the staging root keeps its newest step; ``async_save.on_busy``: ``SKIP`` or ``WAIT``).
    ``parts``: what a composing door shares with the staging manager (``TieredCheckpoint``'s
    persistent tier). Every method is collective.
    """

    _created = 0

    def __init__(
        self,
        url: str,
        *,
        staging: str | os.PathLike[str],
        options: ObjectStoreOptions | None = None,
        config: CheckpointConfig | None = None,
        process_group: Any | None = None,
        storage: Storage | None = None,
        parts: Parts | None = None,
        **manager_kw: Any,
    ) -> None:
        base = config or CheckpointConfig()
        if not isinstance(base, CheckpointConfig):
            raise ConfigError(f"config must be a CheckpointConfig, got {type(base).__name__}")
        check_policy(base.async_save.on_busy, "ObjectStoreCheckpoint", (OnBusy.SKIP, OnBusy.WAIT))
        self.store = ObjectStore(StoreURL.parse(url), options, dir_template=base.storage.dir_template)
        self.retention: RetentionPolicy | None = base.retention
        self.config = base
        # No blocking budget in the staging manager: a save it moved to the background would return None
        # and never be published; ObjectStoreCheckpoint.save is synchronous, upload included.
        staged = dataclasses.replace(base, retention=KeepLast(1), blocking=BlockingBudget(fraction=None))
        ObjectStoreCheckpoint._created += 1
        name = f"objectstore-{ObjectStoreCheckpoint._created}"
        self._agreement = make_agreement(process_group, timeout_s=base.timeout_s, namespace=name)
        # The publish agrees over its own keys: it runs in save_async's thread while the caller's agree here.
        self._publishing = make_agreement(process_group, timeout_s=base.timeout_s, namespace=f"{name}-publish")
        self.busy = BusyRound(make_agreement(process_group, timeout_s=base.timeout_s, namespace=f"{name}-busy"),
                              policy=base.async_save.on_busy)
        """The ``on_busy`` decisions of ``save_async`` (``busy.skipped_total``)."""
        info = self._agreement.info
        self._parts = parts or Parts(proof=ProofSink.open(Path(staging).absolute(), info.rank, base))
        self.local = CheckpointManager(staging, config=staged, process_group=process_group, storage=storage,
                                       parts=self._parts, **manager_kw)
        self._pending: PendingSave | None = None
        self.last_url: str | None = None
        """The store's marker URL of the last step this job committed there."""
        self.rank = info.rank
        self._host = info.host  # ranks of one host share its staging root (CKPTGUARD_NODE where tests fake nodes)
        self._holder = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"  # rank 0's lease id
        self._restored: int | None = None
        self._publisher = _publish.Publisher(self._publishing, self.store, self.local.root, self._holder,
                                             self.retention)
        self._rooted = False  # this job published or restored a step: the root exists, proof copies may go there

    @property
    def url(self) -> str:
        return str(self.store.url)

    # ------------------------------------------------------------ save

    def save(
        self, step: int, state: StateDict, /, *, healthy: bool | None = None, loss: Any = None, grad_norm: Any = None,
        overwrite: bool = False, break_lease: bool = False,
    ) -> Path | None:
        """Commit ``step`` locally, then on the store; returns its directory in the staging root, committed
        there and on the store (``last_url``: the store's marker); None: the health policy skipped the step on
        every rank, nothing was written. ``healthy``, ``loss``, ``grad_norm``, ``overwrite`` as in
        ``CheckpointManager.save``; ``break_lease``: take the store's write lease from another live job."""
        check_step(step, "save")
        self.wait()
        # The store's lease first: a job refused by it changes nothing, not even its staging root.
        self.check_lease(break_lease)
        again = overwrite or self.replaces(step)
        local = self.local.save(step, state, healthy=healthy, loss=loss, grad_norm=grad_norm, overwrite=again,
                                break_lease=break_lease)
        if local is not None:
            self.publish(step, local, break_lease=break_lease)
        return local

    def save_async(
        self, step: int, state: StateDict, /, *, healthy: bool | None = None, loss: Any = None, grad_norm: Any = None,
        overwrite: bool = False, break_lease: bool = False,
    ) -> PendingSave | None:
        """``save`` in the background: the snapshot is taken now (``CheckpointManager.save_async``'s staging),
        then one thread commits the staging root and publishes the step to the store; the pending save's
        ``wait()`` returns the staging directory once both ended, or raises. Requested while the previous one
        still runs, ``CheckpointConfig.async_save.on_busy`` decides: ``SKIP`` returns None, ``WAIT`` waits."""
        check_step(step, "save_async")
        check_state(state, "save_async")
        previous = self._pending
        if not may_start(self.busy, step, previous, self.busy.policy, wait=self.wait, record=self._record):
            return None
        self.check_lease(break_lease)
        again = overwrite or self.replaces(step)
        staged = self._parts.commits.stage(step, state, healthy, loss, grad_norm, Actions(again, break_lease),
                                           busy=self.busy)
        if staged is None:  # unhealthy on some rank: skipped on every rank, nothing written
            return None
        run, fence, began = staged
        self._pending = self._parts.commits.start(
            step, (self.then_publish(step, run, after=previous, break_lease=break_lease), fence, began),
            time.monotonic())
        return self._pending

    def then_publish(self, step: int, run: Callable[[], Path], *, after: PendingSave | None = None,
                     break_lease: bool = False) -> Callable[[], Path]:
        """A background commit of the staging root followed by the store's publish (``save_async``'s, the
        tiers'): ``after``'s cleanup ended first (it may rotate the staging root)."""
        def commit() -> Path:
            if after is not None:
                after.join()
            path = run()
            self.publish(step, path, break_lease=break_lease)
            return path

        return commit

    def published(self, step: int, path: Path) -> None:
        """The staging root's commit of ``step`` at ``path`` published to the store (collective; the tiers')."""
        self.publish(step, path)

    def wait(self) -> Path | None:
        """Wait for a pending ``save_async`` (staging commit and publish); its staging directory, or its error
        raised (once); None when nothing was pending."""
        pending, self._pending = self._pending, None
        return pending.wait() if pending is not None and not pending.reported else None

    def _record(self, event: str, *, durable: bool = True, **fields: Any) -> None:
        if self._parts.proof is not None:
            self._parts.proof.record(event, durable=durable, **fields)

    def replaces(self, step: int) -> bool:
        """Whether the staging save of ``step`` must replace a staging commit the store never made (a job killed
        inside the upload window; collective, ``_commit.storepublish.replaces``). The staging root is this
        job's scratch space: the store alone says what is committed."""
        return _publish.replaces(self._agreement, self.store, self.local.root, step)

    def publish(self, step: int, step_dir: Path, *, break_lease: bool = False) -> str:
        """Publish the committed local step directory ``step_dir`` as ``step`` on the store (collective,
        ``_commit.storepublish``); returns the marker's URL. The store's rotation keeps the restored step."""
        protect = {self._restored} if self._restored else set()
        url = self._publisher.publish(step, step_dir, protect=protect, break_lease=break_lease)
        self._rooted, self.last_url = True, url
        self.copy_proof()
        return url

    def hold(self, break_lease: bool = False) -> None:
        """Rank 0's part (not collective): create the root record and tracker 0 if absent, then take or
        renew the store's write lease for this job (``LeaseHeldError`` while another live job holds it)."""
        _publish.hold(self.store, self._holder, break_lease)

    def check_lease(self, break_lease: bool = False) -> None:
        """Raise ``LeaseHeldError`` on every rank while another live job holds the store's lease (collective)."""
        def check(_: list[_Empty]) -> _Empty:
            self.store.check_lease(self._holder, override=break_lease)
            return _Empty()

        gather_decide(self._agreement, "store.check_lease", _Empty(), check, decision=_Empty)

    def _proof_path(self) -> Path:
        """This rank's proof log in the staging root (the staging manager's, ``ROOT/proof/rank_NNNNN.jsonl``)."""
        return records_dir(self.local.root) / f"rank_{self.rank:05d}.jsonl"

    def before_restore(self, break_lease: bool = False) -> None:
        """The store's lease checked on every rank (``LeaseHeldError`` while another live job holds it), and
        this rank's proof log seeded from the store's copy (collective; ``restore``'s and the tiers')."""
        self.check_lease(break_lease)
        self.seed_proof()

    def seed_proof(self) -> None:
        """This rank's proof log comes back from the store's copy when the staging root lost it (a lost
        node), so its next copy continues the killed run's records instead of replacing them (no collective)."""
        path = self._proof_path()
        if path.exists():
            return
        try:
            data = self.store.get_proof(path.name)
            if data is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_bytes(path, data)
                self._rooted = True
                log.info("ckptguard: %s: the proof records of rank %d restored from %s/proof", path, self.rank,
                         self.store.url)
        except (OSError, CheckpointError) as exc:
            log.warning("ckptguard: reading the store's copy of %s failed (%s: %s); the records start anew here",
                        path, type(exc).__name__, exc)

    def copy_proof(self) -> None:
        """This rank's proof log (in the staging root) copied whole to ``proof/`` on the store, where
        ``ckptguard prove s3://...`` reads every rank's; a failed copy is a warning (the step is committed)."""
        path = self._proof_path()
        if not self._rooted:  # a proof copy never creates anything under a prefix this job did not write
            return
        try:
            if path.is_file():
                self.store.put_proof(path.name, path.read_bytes())
        except (OSError, CheckpointError) as exc:
            log.warning("ckptguard: copying the proof records %s to %s/proof failed (%s: %s); the copy is retried "
                        "at the next save; `ckptguard prove %s` reads them meanwhile", path, self.store.url,
                        type(exc).__name__, exc, self.local.root)

    # ------------------------------------------------------------ restore

    def resolve(self, *, mode: ResumeMode = ResumeMode.AUTO, break_lease: bool = False) -> Resolution:
        """The step a restore would load from the store and why (agreed by all ranks); loads nothing.
        Its ``url`` is the step's marker on the store, its ``path`` where ``restore`` loads the step: the
        staging root's directory (downloaded there first when absent; None: a fresh start).
        ``break_lease``: go on while another live job holds the store's lease."""
        if not isinstance(mode, ResumeMode):
            raise ConfigError(f"mode must be a ResumeMode (AUTO, MUST, NEVER), got {mode!r}")
        self.wait()
        chosen = gather_decide(self._agreement, "store.resolve", _Empty(),
                               lambda _: self._choose(mode, break_lease), decision=_Chosen)
        if chosen.step == 0:
            return Resolution(0, None, chosen.reason, mode)
        name = self.store.naming.name(chosen.step)
        return Resolution(chosen.step, self.local.root / name, chosen.reason, mode,
                          url=self.store.where(name, MANIFEST_NAME))

    def _choose(self, mode: ResumeMode, break_lease: bool = False) -> _Chosen:
        self.store.check_lease(self._holder, override=break_lease)
        if mode is ResumeMode.NEVER:
            return _Chosen(0, "ResumeMode.NEVER")
        found = resolve(self.store, must=mode is ResumeMode.MUST)
        return _Chosen(found.step, found.reason)

    def restore(self, state: StateDict, /, *, mode: ResumeMode = ResumeMode.AUTO, break_lease: bool = False) -> int:
        """Restore the store's tracker step into ``state``; returns it (0: a fresh start). ``break_lease``:
        restore while another live job holds the store's lease (as ``CheckpointManager.restore``'s)."""
        if not isinstance(mode, ResumeMode):
            raise ConfigError(f"mode must be a ResumeMode (AUTO, MUST, NEVER), got {mode!r}")
        self.wait()
        self.seed_proof()
        chosen = self.resolve(mode=mode, break_lease=break_lease)
        if chosen.step == 0:
            log.warning("ckptguard: FRESH START: %s", chosen.reason)
            return self.local.restore(state, mode=ResumeMode.NEVER, break_lease=break_lease)
        log.info("ckptguard: resuming from step %d on %s (%s)", chosen.step, self.store.url, chosen.reason)
        step_dir = self.bring(chosen.step)
        return self.local.restore(state, path=step_dir, break_lease=break_lease)

    def tracker_step(self) -> int:
        """The store's committed step a restore would load (the tracker, its marker checked; 0: none).
        This process's reads; no collective."""
        return resolve(self.store).step

    def bring(self, step: int) -> Path:
        """The committed ``step`` in the staging root: downloaded, each host's ranks a share, unless there
        already (collective, ``_resume.storefetch``); returns its directory. Rotation on the store keeps it
        from now on."""
        self._restored, self._rooted = step, True
        return fetch_step(self._agreement, self.store, self.local.root, step, host=self._host)

    # ------------------------------------------------------------ queries

    def committed_steps(self) -> list[int]:
        """The store's committed steps, ascending (this process's reads; no collective)."""
        return self.store.committed_steps()

    def preemption_target(self) -> GuardTarget:
        """What a ``PreemptionGuard`` guards: this door's save (staging commit and publish) and wait; the root
        it names is the staging root (its tracker is never behind the store's)."""
        return dataclasses.replace(self.local.preemption_target(), save=self.save, wait=self.wait)

    def record_step(
        self, step: int, *, sample_ids: Any = None, batch: Any = None, loss: Any = None, grad_norm: Any = None,
        **extra: Any,
    ) -> JsonObject:
        """``CheckpointManager.record_step`` into the staging root's proof log (copied to the store's)."""
        return self.local.record_step(step, sample_ids=sample_ids, batch=batch, loss=loss, grad_norm=grad_norm,
                                      **extra)

    def record_update(self, step: int, /, *, grad_norm: float, params_changed: bool) -> None:
        self.local.record_update(step, grad_norm=grad_norm, params_changed=params_changed)

    def record_export(self, step: int, payload: Any, /, *, scales: Any = None) -> ExportFingerprint:
        return self.local.record_export(step, payload, scales=scales)

    def record_logprobs(self, step: int, trainer_logprobs: Any, rollout_logprobs: Any, /) -> dict[str, float]:
        return self.local.record_logprobs(step, trainer_logprobs, rollout_logprobs)

    def close(self) -> None:
        """Wait for a pending ``save_async`` (raising its error), release the store's write lease (rank 0) and
        the staging manager's pools."""
        try:
            self.wait()
        finally:
            try:
                self.copy_proof()  # the records since the last save (a restore's) reach the store's copy
                if self.rank == 0:
                    self.store.release_lease(self._holder)
            finally:
                self.local.close()

