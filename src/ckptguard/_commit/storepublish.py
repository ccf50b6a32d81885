"""A committed step of the local staging root published to an object-store root (``publish``).

Contract: every rank calls ``publish`` with the same step, whose directory is committed in the
staging root (its manifest is read and checked as a restore checks it: the store gets a committed
step only). Rank 0 creates the store's root record and tracker 0 if absent, takes or renews the
write lease and opens an attempt; every rank uploads its own files of the manifest; once every rank
reported success rank 0 commits by the root's one rule (``rootcommit``, ``BucketRoot`` here: the
lease still this job's, an orphan marker of that step, left by a writer killed between marker and
tracker, uncommitted, the marker created with the contract phases of the staging root, the chain a
restore continues, the tracker moved forward), then applies the retention policy on the store (a
failed rotation is a warning, retried at the next publish). Any failure raises on every rank;
nothing of the step is visible on the store unless its marker was created.

``replaces`` is the staging side of a kill inside the upload window: a staging root whose tracker is
at or past the step being saved while the store's is behind it holds a commit the store never made,
and the staging save of that step replaces it (the store alone says what is committed).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._agree import Agreement, Wire, gather_decide, on_every_rank
from .._disk import layout as _layout
from .._disk.layout import MANIFEST_NAME, TRACKER_NAME, read_json
from .._records import contract as _contract
from .._records import manifest as _manifest
from .._records.entries import FileEntry
from .._records.retention import RetentionPolicy, kept
from .._types import JsonObject
from ..errors import CheckpointCorruptError, CheckpointError, CommitConflictError, ObjectStoreError
from ..storage.s3 import Marker, ObjectStore, StoredObject, Writer
from . import rootcommit, storelease

__all__ = [
    "BEFORE_MARKER",
    "BEFORE_TRACKER",
    "BucketRoot",
    "Publisher",
    "begin",
    "commit",
    "hold",
    "replaces",
    "rotate",
]

log = logging.getLogger("ckptguard")

BEFORE_MARKER = "store.before_marker"
BEFORE_TRACKER = "store.before_tracker"
_TRACKER_TRIES = 32


@dataclass(frozen=True)
class _Empty(Wire):
    pass


@dataclass(frozen=True)
class _Begun(Wire):
    attempt: str


@dataclass(frozen=True)
class _Uploaded(Wire):
    objects: dict[str, dict[str, Any]] = field(
        default_factory=dict
    )  # relative path -> {size, xxh3, etag}


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
    """Rank 0's part (not collective): the root record and tracker 0 created if absent, then the
    store's write lease taken or renewed for ``holder`` (``LeaseHeldError`` while another live job
    holds it)."""
    store.ensure_root()
    note = storelease.acquire(store, holder, override=break_lease)
    if note:
        log.warning("ckptguard: %s: %s", store.url, note)


def replaces(agreement: Agreement, store: ObjectStore, staging: Path, step: int) -> bool:
    """Whether the staging save of ``step`` must replace staging steps the store never committed
    (collective): a job killed after its staging commit of step N and before the store's marker
    leaves the staging root at N and the store at an older step; the relaunch restores the store's
    step, and its staging save of any step up to N (N itself included) replaces the staging root's
    copy instead of refusing it as committed."""
    try:
        mine = _Staged(_layout.read_tracker(staging) or 0)
    except (
        OSError,
        CheckpointError,
    ):  # never raised on one rank alone; the staging save reports it on all
        mine = _Staged(0)

    def decide(views: list[_Staged]) -> _Replace:
        if max(v.tracker for v in views) < step:
            return _Replace(False)  # the usual case: nothing in the way, no read of the store
        stored = store.tracker()[0] or 0
        if stored < step:
            log.warning(
                "ckptguard: %s holds a staging commit at or past step %d that %s never "
                "committed (the store's tracker says %d: a save killed before its upload "
                "finished); step %d replaces it",
                staging,
                step,
                store.url,
                stored,
                step,
            )
        return _Replace(stored < step)

    return gather_decide(agreement, "store.replaces", mine, decide, decision=_Replace).replace


def begin(store: ObjectStore, step: int) -> str:
    """Open an attempt at ``step`` in the store's temporary area; returns its name. A committed
    step, or one behind the tracker, is refused (``rootcommit.admit``: never overwritten on a store,
    never resumable)."""
    rootcommit.admit(BucketRoot(store), step)
    return store.open_attempt(step)


def commit(
    store: ObjectStore,
    step: int,
    attempt: str,
    objects: dict[str, StoredObject],
    manifest: JsonObject,
    *,
    phases: dict[str, JsonObject] | None = None,
    lease: str | None = None,
) -> str:
    """Create the marker (the commit point), then move the tracker forward (``rootcommit.publish``);
    returns the marker's URL. ``lease``: the holder of the store's write lease, confirmed first;
    only a holder replaces an orphan marker of ``step`` (a writer killed between marker and
    tracker)."""
    marker = Marker(step, attempt, Writer.here(lease), objects, manifest, phases or {})
    rootcommit.publish(BucketRoot(store, lease), step, marker)
    return store.where(store.naming.name(step), MANIFEST_NAME)


class BucketRoot:
    """``rootcommit.RootStore`` of an object-store root: a step is committed when its marker object
    exists and the tracker covers it; the tracker moves by compare-and-set, the marker is created
    only if absent."""

    BEFORE_VISIBLE: str | None = BEFORE_MARKER
    BEFORE_TRACKER = BEFORE_TRACKER
    ROLLBACK = (
        False  # a committed step on a store is never overwritten, the tracker never moves back
    )

    def __init__(self, store: ObjectStore, holder: str | None = None) -> None:
        self.store, self.holder = store, holder
        self._attempt: str | None = None

    def tracker(self) -> int | None:
        return self.store.tracker()[0]

    def visible(self, step: int) -> bool:
        return self.store.marker(step) is not None

    def refuse(self, why: rootcommit.Refusal, step: int, tracker: int | None) -> Exception:
        store = self.store
        if why is rootcommit.Refusal.COMMITTED:
            found = store.marker(step)
            whose = f" (attempt {found.attempt}, {found.writer.describe()})" if found else ""
            return CommitConflictError(
                f"step {step} is already committed at "
                f"{store.where(store.naming.name(step))}{whose}; a committed step on an object "
                f"store is never overwritten: save a newer step",
                step=step,
            )
        if why is rootcommit.Refusal.BEHIND:
            return CommitConflictError(
                f"step {step} is older than the tracker ({tracker}) at {store.url}: the tracker "
                f"never moves backwards and an object store never rolls back (save(..., "
                f"overwrite=True) rolls back a local root only), so this step could never be "
                f"resumed; save a step >= the tracker",
                step=step,
            )
        if why is rootcommit.Refusal.RESERVED:
            return CommitConflictError(
                f"step {step} at {store.url}: step 0 is reserved for 'fresh start' (the tracker of "
                f"a new root); save steps >= 1",
                step=step,
            )
        return CommitConflictError(
            f"step {step} at {store.url} is not committed: the tracker moved to step "
            f"{tracker} while it was uploaded (another writer on this root); stop the "
            f"other writer, then save a newer step",
            step=step,
        )

    def confirm_lease(self, step: int) -> None:
        if self.holder is not None:  # still ours (renewed at begin): a lost lease never commits
            storelease.confirm(self.store, self.holder, step=step)

    def uncommit(self, step: int) -> None:
        store = self.store
        existing = store.marker(step)
        if existing is None:
            return None
        tracker = self.tracker()
        if self.holder is None:
            raise CommitConflictError(
                f"step {step} at {store.url} has a marker newer than the tracker ({tracker}): "
                f"another writer ({existing.writer.describe()}) is committing it now or died "
                f"before moving the tracker; only the lease holder replaces such a marker: commit "
                f"with the lease (storelease.acquire, then commit(..., lease=holder)), or leave "
                f"this step to the job that holds it",
                step=step,
            )
        log.warning(
            "ckptguard: %s: step %d holds an orphan marker (attempt %s, %s; the tracker "
            "says %s): its writer died between marker and tracker; uncommitting it (marker "
            "first) to save the step again",
            store.url,
            step,
            existing.attempt,
            existing.writer.describe(),
            tracker,
        )
        # Never committed (the tracker never covered it): nothing to put back.
        store.drop_marker(step)
        return None

    def put_back(self, step: int, undo: object) -> None:
        raise AssertionError("an object store's uncommit leaves nothing to put back")

    def make_visible(self, step: int, staged: object) -> None:
        assert isinstance(staged, Marker)
        self._attempt = staged.attempt
        # Refused (maybe our own retried request that had landed), or written unconditionally: read
        # it back.
        if not self.store.create_marker(staged):
            self._check_won(step)

    def sealed(self, step: int, undo: object | None) -> None:
        return None

    def move_tracker(self, step: int, *, back: bool) -> None:
        """The tracker moved to ``step`` by compare-and-set, only forward (``admit`` refused every
        rollback)."""
        store = self.store
        for _ in range(_TRACKER_TRIES):
            current, etag = store.tracker()
            if current is not None and current >= step:
                if current > step:
                    log.warning(
                        "ckptguard: %s: the tracker is at %d already; step %d is committed but the "
                        "tracker stays (it never moves backwards)",
                        store.url,
                        current,
                        step,
                    )
                return
            if store.swap_tracker(step, None if current is None else etag):
                return
        raise ObjectStoreError(
            f"moving the tracker {store.where(TRACKER_NAME)} to step {step}: "
            f"{_TRACKER_TRIES} conditional writes in a row lost to other writers. Step "
            f"{step}'s marker is written (the step is an orphan until the tracker covers "
            f"it); two jobs write this root: stop one",
            bucket=store.url.bucket,
            key=store.url.key(TRACKER_NAME),
            step=step,
        )

    def finish(self, step: int, undo: object | None) -> None:
        self._check_won(step)  # an orphan replacement racing this commit is reported, never silent

    def _check_won(self, step: int) -> None:
        # A refused create may be our own retried request that had landed: the marker's attempt
        # decides.
        store, attempt = self.store, self._attempt
        found = store.marker(step)
        if found is not None and found.attempt == attempt:
            return
        who = found.writer.describe() if found is not None else "a writer that then deleted it"
        raise CommitConflictError(
            f"step {step} at {store.url} was committed by another writer ({who}, attempt "
            f"{found.attempt if found else '?'}), not by this one (attempt {attempt}): exactly one "
            f"writer commits a step. Two jobs write this root: stop one (the lease should have "
            f"refused it; see its log)",
            step=step,
        )


def rotate(store: ObjectStore, policy: RetentionPolicy, protect: set[int]) -> list[int]:
    """Delete committed steps the policy does not keep (never the tracker's or a protected one: the
    decision is ``_records.retention.kept``'s, as on a directory root), each marker first (a
    half-deleted step is invisible)."""
    tracker, _ = store.tracker()
    steps = store.committed_steps()
    keep = kept(steps, policy, tracker=tracker or None, protect=protect)
    gone = [s for s in steps if s not in keep]
    for step in gone:
        store.delete_step(step)
    return gone


class Publisher:
    """The publish of staging steps to one store, for one job (``holder``: rank 0's lease id)."""

    def __init__(
        self,
        agreement: Agreement,
        store: ObjectStore,
        staging: Path,
        holder: str,
        retention: RetentionPolicy | None,
    ) -> None:
        self.agreement = agreement
        self.store = store
        self.staging = staging
        self.holder = holder
        self.retention = retention

    def publish(
        self, step: int, step_dir: Path, *, protect: set[int], break_lease: bool = False
    ) -> str:
        """Publish the committed staging directory ``step_dir`` as ``step`` (collective); returns
        the marker's URL. ``protect``: steps the store's rotation keeps besides the policy's (the
        restored one)."""
        rank = self.agreement.info.rank
        begun = gather_decide(
            self.agreement,
            "store.begin",
            _Empty(),
            lambda _: self._begin(step, break_lease),
            decision=_Begun,
        )
        typed = _manifest.read(
            step_dir
        )  # checked as a restore checks it: the store gets a committed step only
        manifest, files = typed.to_json(), typed.files
        mine = [f for f in files if (f.rank or 0) == rank]

        def upload() -> _Uploaded:
            etags = self.store.upload(
                step, begun.attempt, [(f.path, step_dir / f.path, f.size) for f in mine]
            )
            return _Uploaded(
                {f.path: {"size": f.size, "xxh3": f.xxh3, "etag": etags[f.path]} for f in mine}
            )

        uploaded = on_every_rank(self.agreement, "store.upload", upload)
        done = gather_decide(
            self.agreement,
            "store.commit",
            uploaded,
            lambda views: self._commit(step, begun.attempt, views, files, manifest, protect),
            decision=_Committed,
        )
        log.info("ckptguard: committed step %d on the object store at %s", step, done.url)
        return done.url

    def _begin(self, step: int, break_lease: bool) -> _Begun:
        hold(self.store, self.holder, break_lease)
        return _Begun(begin(self.store, step))

    def _commit(
        self,
        step: int,
        attempt: str,
        views: list[_Uploaded],
        files: Sequence[FileEntry],
        manifest: JsonObject,
        protect: set[int],
    ) -> _Committed:
        objects = {
            path: StoredObject(int(o["size"]), str(o["xxh3"]), str(o["etag"]))
            for view in views
            for path, o in view.objects.items()
        }
        missing = sorted({f.path for f in files} - set(objects))
        if missing:
            raise CheckpointCorruptError(
                f"step {step}: no rank uploaded {missing[:5]} ({len(missing)} files of the "
                f"manifest); the manifest names a rank that is not in this group: publish from "
                f"the job that wrote the step"
            )
        phases = {
            p.name: read_json(p, what="contract phase") for p in _contract.phase_files(self.staging)
        }
        url = commit(self.store, step, attempt, objects, manifest, phases=phases, lease=self.holder)
        self._rotate(step, protect)
        return _Committed(url)

    def _rotate(self, step: int, protect: set[int]) -> None:
        if self.retention is None:
            return
        try:
            gone = rotate(self.store, self.retention, {step} | protect)
        except (
            CheckpointError,
            OSError,
        ) as exc:  # rotation never stops training; retried at the next save
            log.warning(
                "ckptguard: rotation on %s after step %d failed (%s: %s); retried at the next save",
                self.store.url,
                step,
                type(exc).__name__,
                exc,
            )
            return
        if gone:
            log.info("ckptguard: retention deleted steps %s on %s", gone, self.store.url)
