"""A committed step of the local staging root published to an object-store root (``publish``).

Contract: every rank calls ``publish`` with the same step, whose directory is committed in the staging
root (its manifest is read and checked as a restore checks it: the store gets a committed step only).
Rank 0 creates the store's root record and tracker 0 if absent, takes or renews the write lease and
opens an attempt (an orphan marker of that step, left by a writer killed between marker and tracker,
is uncommitted first); every rank uploads its own files of the manifest; once every rank reported
success rank 0 checks the lease is still this job's, creates the marker (with the contract phases of
the staging root: the chain a restore continues) and moves the tracker forward, then applies the
retention policy on the store (a failed rotation is a warning, retried at the next publish). Any failure
raises on every rank; nothing of the step is visible on the store unless its marker was created.

``replaces`` is the staging side of a kill inside the upload window: a staging root whose tracker is at
or past the step being saved while the store's is behind it holds a commit the store never made, and
the staging save of that step replaces it (the store alone says what is committed).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._agree import Agreement, Wire, gather_decide, on_every_rank
from .._disk import layout as _layout
from .._disk.layout import read_json
from .._records import contract as _contract
from .._records import manifest as _manifest
from .._records.entries import FileEntry
from .._records.retention import RetentionPolicy
from .._types import JsonObject
from ..errors import CheckpointCorruptError, CheckpointError
from ..storage.s3 import ObjectStore, StoredObject

__all__ = ["Publisher", "hold", "replaces"]

log = logging.getLogger("ckptguard")


@dataclass(frozen=True)
class _Empty(Wire):
    pass


@dataclass(frozen=True)
class _Begun(Wire):
    attempt: str


@dataclass(frozen=True)
class _Uploaded(Wire):
    objects: dict[str, dict[str, Any]] = field(default_factory=dict)  # relative path -> {size, xxh3, etag}


@dataclass(frozen=True)
class _Committed(Wire):
    url: str


@dataclass(frozen=True)
class _Staged(Wire):
    tracker: int  # this rank's staging root's tracker (0: none)


@dataclass(frozen=True)
class _Replace(Wire):
    replace: bool


def hold(store: ObjectStore, holder: str, break_lease: bool = False) -> None:
    """Rank 0's part (not collective): the root record and tracker 0 created if absent, then the store's write
    lease taken or renewed for ``holder`` (``LeaseHeldError`` while another live job holds it)."""
    store.ensure_root()
    note = store.acquire_lease(holder, override=break_lease)
    if note:
        log.warning("ckptguard: %s: %s", store.url, note)


def replaces(agreement: Agreement, store: ObjectStore, staging: Path, step: int) -> bool:
    """Whether the staging save of ``step`` must replace staging steps the store never committed (collective):
    a job killed after its staging commit of step N and before the store's marker leaves the staging root at
    N and the store at an older step; the relaunch restores the store's step, and its staging save of any
    step up to N (N itself included) replaces the staging root's copy instead of refusing it as committed."""
    try:
        mine = _Staged(_layout.read_tracker(staging) or 0)
    except (OSError, CheckpointError):  # never raised on one rank alone; the staging save reports it on all
        mine = _Staged(0)

    def decide(views: list[_Staged]) -> _Replace:
        if max(v.tracker for v in views) < step:
            return _Replace(False)  # the usual case: nothing in the way, no read of the store
        stored = store.tracker()[0] or 0
        if stored < step:
            log.warning("ckptguard: %s holds a staging commit at or past step %d that %s never committed (the "
                        "store's tracker says %d: a save killed before its upload finished); step %d replaces it",
                        staging, step, store.url, stored, step)
        return _Replace(stored < step)

    return gather_decide(agreement, "store.replaces", mine, decide, decision=_Replace).replace


class Publisher:
    """The publish of staging steps to one store, for one job (``holder``: rank 0's lease id)."""

    def __init__(self, agreement: Agreement, store: ObjectStore, staging: Path, holder: str,
                 retention: RetentionPolicy | None) -> None:
        self.agreement = agreement
        self.store = store
        self.staging = staging
        self.holder = holder
        self.retention = retention

    def publish(self, step: int, step_dir: Path, *, protect: set[int], break_lease: bool = False) -> str:
        """Publish the committed staging directory ``step_dir`` as ``step`` (collective); returns the marker's
        URL. ``protect``: steps the store's rotation keeps besides the policy's (the restored one)."""
        rank = self.agreement.info.rank
        begun = gather_decide(self.agreement, "store.begin", _Empty(), lambda _: self._begin(step, break_lease),
                              decision=_Begun)
        typed = _manifest.read(step_dir)  # checked as a restore checks it: the store gets a committed step only
        manifest, files = typed.to_json(), typed.files
        mine = [f for f in files if (f.rank or 0) == rank]

        def upload() -> _Uploaded:
            etags = self.store.upload(step, begun.attempt, [(f.path, step_dir / f.path, f.size) for f in mine])
            return _Uploaded({f.path: {"size": f.size, "xxh3": f.xxh3, "etag": etags[f.path]} for f in mine})

        uploaded = on_every_rank(self.agreement, "store.upload", upload)
        done = gather_decide(self.agreement, "store.commit", uploaded,
                             lambda views: self._commit(step, begun.attempt, views, files, manifest, protect),
                             decision=_Committed)
        log.info("ckptguard: committed step %d on the object store at %s", step, done.url)
        return done.url

    def _begin(self, step: int, break_lease: bool) -> _Begun:
        hold(self.store, self.holder, break_lease)
        return _Begun(self.store.begin(step, replace_orphan=True))

    def _commit(self, step: int, attempt: str, views: list[_Uploaded], files: Sequence[FileEntry],
                manifest: JsonObject, protect: set[int]) -> _Committed:
        objects = {path: StoredObject(int(o["size"]), str(o["xxh3"]), str(o["etag"]))
                   for view in views for path, o in view.objects.items()}
        missing = sorted({f.path for f in files} - set(objects))
        if missing:
            raise CheckpointCorruptError(
                f"step {step}: no rank uploaded {missing[:5]} ({len(missing)} files of the manifest); the manifest "
                "names a rank that is not in this group: publish from the job that wrote the step")
        self.store.check_lease(self.holder)  # still ours (renewed at begin): a lost lease never commits
        phases = {p.name: read_json(p, what="contract phase") for p in _contract.phase_files(self.staging)}
        url = self.store.commit(step, attempt, objects, manifest, phases=phases, lease=self.holder)
        self._rotate(step, protect)
        return _Committed(url)

    def _rotate(self, step: int, protect: set[int]) -> None:
        if self.retention is None:
            return
        try:
            gone = self.store.rotate(self.retention.keep, {step} | protect)
        except (CheckpointError, OSError) as exc:  # rotation never stops training; retried at the next save
            log.warning("ckptguard: rotation on %s after step %d failed (%s: %s); retried at the next save",
                        self.store.url, step, type(exc).__name__, exc)
            return
        if gone:
            log.info("ckptguard: retention deleted steps %s on %s", gone, self.store.url)
