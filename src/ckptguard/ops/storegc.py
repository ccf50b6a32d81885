"""An object store's prefix as gc sees it (``StoreRoot``, a ``gc.GcRoot``): what ckptguard
created, no marker names, older than a minimum age, whose writer is gone.

The procedure is ``ops.gc.collect``'s, one for every root kind; the store
(``ckptguard.storage.s3.ObjectStore``) gives this module its primitives only: the listing, the
reads of the tracker and the markers, the deletes, the multipart uploads and their abort.

The survey calls removable the attempts that carry ckptguard's owner record, that no marker names,
whose newest object is older than ``min_age_s`` and whose writer is gone by the rule of every
writer of every root (``_disk.tempfiles.writer_gone``, which also judges a directory root's temp
directories and temp files and every lease): one whose process still runs on this host is kept
however old. The multipart uploads of such attempts are aborted; everything else under the prefix
is reported as foreign and left alone. A prefix without the root record is refused, and so is one
whose tracker's step has no readable marker: resolve then asks the operator to restore that step's
objects, which would look like a dead attempt's here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .._commit import storelease
from .._disk.layout import MANIFEST_NAME, TRACKER_NAME
from .._disk.tempfiles import writer_gone
from ..errors import CheckpointCorruptError, CheckpointError, ConfigError, LeaseHeldError
from ..storage.s3 import ObjectStore
from ..storage.s3 import _objrecords as rec
from ..storage.s3._bucket import Small, Upload
from .gc import Found, Progress

KEPT_LIVE = (
    "its writer may still write (younger than --min-age {age:g} s, or its process still runs on "
    "this host)"
)
FOREIGN = "not created by ckptguard: left alone"


@dataclass(frozen=True)
class _Probe:
    key: str


@dataclass(frozen=True)
class _Attempt:
    name: str
    attempt: str
    step: int | None
    keys: list[str]
    owner_key: str


@dataclass(frozen=True)
class _Abort:
    upload: Upload
    step: int | None


class StoreRoot:
    """An object store's prefix as gc sees it (``gc.GcRoot``)."""

    def __init__(self, store: ObjectStore, *, min_age_s: float = 3600.0) -> None:
        self.store, self.min_age_s = store, min_age_s

    def identify(self) -> None:
        root = self.store
        found = root.bucket.get(root.url.key(rec.ROOT_RECORD), what="root record")
        if found is None:
            raise ConfigError(
                f"{root.url} holds no {rec.ROOT_RECORD}: it is not a ckptguard root (or not yet); "
                f"gc removes only what ckptguard created under its own roots. Check the URL"
            )
        rec.RootRecord.from_bytes(found.data, root.where(rec.ROOT_RECORD))
        tracker_step_whole(root, "gc")

    def check_orphans(self) -> None:
        raise ConfigError(
            "--orphans works on local roots; on s3:// an orphan marker (newer than the tracker) "
            "is replaced by the next save of that step, and `ckptguard list` shows it"
        )

    def check_idle(self) -> None:
        try:
            storelease.check(self.store, "ckptguard-gc")
        except LeaseHeldError as exc:
            raise LeaseHeldError(
                f"gc refused: {exc}; its newest attempt may be a commit in flight. Stop the job, "
                f"or pass --force (attempts whose writer may still write are kept anyway)"
            ) from None

    def survey(self, *, orphans: bool, dry_run: bool, progress: Progress | None) -> list[Found]:
        root, now = self.store, time.time()
        out: list[Found] = []
        attempts: dict[tuple[str, str], list[str]] = {}
        newest: dict[tuple[str, str], float] = {}
        for obj in root.bucket.listing():
            rel = root.url.relative(obj.key) or ""
            parts = rel.split("/")
            if rel in (rec.ROOT_RECORD, TRACKER_NAME, rec.LEASE) or rec.is_proof(rel):
                continue
            where = f"s3://{root.url.bucket}/{obj.key}"
            if rel.startswith(".ckptguard-probe-") and "/" not in rel:
                # a probe whose process died before its delete
                if now - obj.modified_unix >= self.min_age_s:
                    note = "a conditional-write probe left behind"
                    out.append(Found(where, note, True, _Probe(obj.key)))
                continue
            if len(parts) >= 2 and root.naming.parse(parts[0]) is not None:
                if parts[1:] == [MANIFEST_NAME]:
                    continue
                if parts[1].startswith(rec.ATTEMPT_PREFIX) and len(parts) >= 3:
                    at = (parts[0], parts[1])
                    attempts.setdefault(at, []).append(obj.key)
                    newest[at] = max(newest.get(at, 0.0), obj.modified_unix)
                    continue
            out.append(Found(where, FOREIGN, False))
        # an attempt's uploads before the attempt: removed in this order, an interrupted gc never
        # leaves an upload whose owner record is gone (it would look foreign)
        out += [self._upload(u, now) for u in root.bucket.uploads()]
        for done, ((name, attempt), keys) in enumerate(sorted(attempts.items()), 1):
            if progress is not None:
                progress("attempts", done, len(attempts))
            out += self._attempt(name, attempt, keys, newest[(name, attempt)], now)
        return out

    def _attempt(
        self, name: str, attempt: str, keys: list[str], newest: float, now: float
    ) -> list[Found]:
        root = self.store
        owner_key = root.url.key(name, attempt, rec.OWNER)
        if owner_key not in keys:  # no owner record: not ckptguard's to delete
            return [Found(f"s3://{root.url.bucket}/{k}", FOREIGN, False) for k in keys]
        if _marked(root, name) == attempt:
            return []
        where = root.where(name, attempt)
        expired = now - newest >= self.min_age_s
        if _writer_gone(root, name, attempt, None, expired=expired) is None:
            return [Found(where, KEPT_LIVE.format(age=self.min_age_s), False)]
        what = f"an attempt no marker names, its writer gone ({len(keys)} objects)"
        return [
            Found(
                where, what, True, _Attempt(name, attempt, root.naming.parse(name), keys, owner_key)
            )
        ]

    def _upload(self, upload: Upload, now: float) -> Found:
        root = self.store
        parts = (root.url.relative(upload.key) or "").split("/")
        where = f"s3://{root.url.bucket}/{upload.key} (multipart upload {upload.upload_id})"
        if (
            len(parts) < 3
            or root.naming.parse(parts[0]) is None
            or not parts[1].startswith(rec.ATTEMPT_PREFIX)
        ):
            return Found(where, FOREIGN, False)
        owner_key = root.url.key(parts[0], parts[1], rec.OWNER)
        if (owner := root.bucket.get(owner_key, what="attempt owner record")) is None:
            return Found(where, FOREIGN, False)
        expired = now - upload.initiated_unix >= self.min_age_s
        if _writer_gone(root, parts[0], parts[1], owner, expired=expired) is None:
            return Found(where, KEPT_LIVE.format(age=self.min_age_s), False)
        step = root.naming.parse(parts[0])
        return Found(where, "a multipart upload of a dead attempt", True, _Abort(upload, step))

    def remove(self, found: Found) -> str | None:
        bucket, handle = self.store.bucket, found.handle
        if isinstance(handle, _Probe):
            bucket.delete(handle.key, what="conditional-write probe")
        elif isinstance(handle, _Attempt):
            # a marker published since the survey (a writer on another host that only looked gone,
            # under --force) makes it a committed step's objects: read it again, right before
            if handle.step is not None and _marked(self.store, handle.name) == handle.attempt:
                return "a marker names it now (committed since gc looked): kept"
            # the owner record last: an interrupted gc still knows the rest is ours
            bucket.delete_many([k for k in handle.keys if k != handle.owner_key], step=handle.step)
            bucket.delete(handle.owner_key, what="attempt owner record")
        elif isinstance(handle, _Abort):
            bucket.abort(handle.upload, step=handle.step)
        else:
            raise TypeError(f"gc of {self.store.url}: no way to remove {found.where} ({handle!r})")
        return None

    def finish(self) -> None:
        """Nothing to sync: a store's delete is durable when it returns."""


def tracker_step_whole(root: ObjectStore, doing: str) -> None:
    """Refuse ``doing`` while the tracker's step has no readable marker: resolve then tells the
    operator to restore that step's objects, and gc would delete them as attempts no marker
    names."""
    step, _ = root.tracker()
    if not step:
        return
    marker_at = root.where(root.naming.name(step), MANIFEST_NAME)
    try:
        if root.marker(step) is not None:
            return
        why = "does not exist"
    except CheckpointError as exc:
        why = f"is unreadable ({str(exc)[:300]})"
    raise CheckpointCorruptError(
        f"{doing} refused on {root.url}: the tracker says {step}, but its marker {marker_at} "
        f"{why}; restoring needs that step's objects, which {doing} would delete as attempts no "
        f"marker names. Restore the marker (or set the tracker to an older committed step by hand: "
        f"`ckptguard list` shows them), then run {doing} again"
    )


def _marked(root: ObjectStore, name: str) -> str | None:
    step = root.naming.parse(name)
    marker = root.marker(step) if step is not None else None
    return marker.attempt if marker is not None else None


def _writer_gone(
    root: ObjectStore, name: str, attempt: str, found: Small | None, *, expired: bool
) -> str | None:
    """Whether the attempt's writer is gone: never before ``min_age_s`` (``expired``), and then by
    the rule of every writer (``_disk.tempfiles.writer_gone``), which keeps it while its process
    lives on this host. Its liveness only lengthens an attempt's life, never shortens it: a writer
    in another PID namespace of a host of the same name (a container with the host's network, a
    sidecar) looks dead from here while it uploads. An owner record that cannot be read is judged by
    age alone."""
    if not expired:
        return None
    if found is None:  # ``found``: the owner record, where the caller has read it already
        found = root.bucket.get(root.url.key(name, attempt, rec.OWNER), what="attempt owner record")
    if found is None:
        return "it expired"
    try:
        writer = rec.Owner.from_bytes(found.data, root.where(name, attempt, rec.OWNER)).writer
    except CheckpointError:
        return "it expired"
    return writer_gone(writer.host, writer.pid, writer.start, expired=True)
