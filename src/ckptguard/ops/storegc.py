"""gc on an object-store root: what ckptguard created, no marker names, older than a minimum age,
whose writer is gone.

The decision is the operator side's (``ckptguard gc s3://...``, ``ops.remote.gc_remote``); the store
(``ckptguard.storage.s3.ObjectStore``) gives it its primitives only: the listing, the reads of the
tracker and the markers, the deletes, the multipart uploads and their abort.

``collect`` removes attempts that carry ckptguard's owner record, that no marker names, whose newest
object is older than ``min_age_s`` and whose writer is gone by the rule of every writer of every
root (``_disk.tempfiles.writer_gone``, which also judges a directory root's temp directories and
temp files and every lease): one whose process still runs on this host is kept however old. It
aborts the multipart uploads of such attempts, and reports everything else under the prefix as
foreign without touching it. It refuses a prefix without the root record, and one whose tracker's
step has no readable marker: resolve then asks the operator to restore that step's objects, which
would look like a dead attempt's here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from .._disk.layout import MANIFEST_NAME, TRACKER_NAME, StepNaming
from .._disk.tempfiles import writer_gone
from ..errors import CheckpointCorruptError, CheckpointError, ConfigError
from ..storage.s3 import StoreURL
from ..storage.s3 import _objrecords as rec
from ..storage.s3._bucket import Bucket, Small


@dataclass
class GcReport:
    removed_attempts: list[str] = field(default_factory=list)
    removed_objects: int = 0
    aborted_uploads: list[str] = field(default_factory=list)
    foreign: list[str] = field(
        default_factory=list
    )  # keys under the prefix that ckptguard did not create
    kept_live: list[str] = field(default_factory=list)
    """Unmarked attempts whose writer may still write: its process alive on this host, or,
    elsewhere, younger than ``min_age_s``."""


class Root(Protocol):
    """What gc uses of an ``ObjectStore``: its bucket prefix's primitives and the reads of its
    records."""

    bucket: Bucket
    url: StoreURL
    naming: StepNaming

    def where(self, *parts: str) -> str: ...

    def tracker(self) -> tuple[int | None, str | None]: ...

    def marker(self, step: int) -> rec.Marker | None: ...


def collect(root: Root, *, min_age_s: float = 3600.0, dry_run: bool = False) -> GcReport:
    """gc of ``root`` (the module docstring says what it removes, aborts and reports); ``dry_run``:
    only report."""
    found = root.bucket.get(root.url.key(rec.ROOT_RECORD), what="root record")
    if found is None:
        raise ConfigError(
            f"{root.url} holds no {rec.ROOT_RECORD}: it is not a ckptguard root (or not yet); gc "
            f"removes only what ckptguard created under its own roots. Check the URL"
        )
    rec.RootRecord.from_bytes(found.data, root.where(rec.ROOT_RECORD))
    tracker_step_whole(root, "gc")
    report, now = GcReport(), time.time()
    attempts: dict[tuple[str, str], list[str]] = {}
    newest: dict[tuple[str, str], float] = {}
    for obj in root.bucket.listing():
        rel = root.url.relative(obj.key) or ""
        parts = rel.split("/")
        if rel in (rec.ROOT_RECORD, TRACKER_NAME, rec.LEASE) or rec.is_proof(rel):
            continue
        if (
            rel.startswith(".ckptguard-probe-") and "/" not in rel
        ):  # a probe whose process died before its delete
            if now - obj.modified_unix >= min_age_s:
                report.removed_objects += 1
                if not dry_run:
                    root.bucket.delete(obj.key, what="conditional-write probe")
            continue
        if len(parts) >= 2 and root.naming.parse(parts[0]) is not None:
            if parts[1:] == [MANIFEST_NAME]:
                continue
            if parts[1].startswith(rec.ATTEMPT_PREFIX) and len(parts) >= 3:
                attempts.setdefault((parts[0], parts[1]), []).append(obj.key)
                newest[(parts[0], parts[1])] = max(
                    newest.get((parts[0], parts[1]), 0.0), obj.modified_unix
                )
                continue
        report.foreign.append(obj.key)
    _uploads(
        root, now, min_age_s, dry_run, report
    )  # first: an attempt's owner record still says it is ours
    for (name, attempt), keys in sorted(attempts.items()):
        _attempt(
            root, name, attempt, keys, newest[(name, attempt)], now, min_age_s, dry_run, report
        )
    return report


def tracker_step_whole(root: Root, doing: str) -> None:
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


def _marked(root: Root, name: str) -> str | None:
    step = root.naming.parse(name)
    marker = root.marker(step) if step is not None else None
    return marker.attempt if marker is not None else None


def _attempt(
    root: Root,
    name: str,
    attempt: str,
    keys: list[str],
    newest: float,
    now: float,
    min_age_s: float,
    dry_run: bool,
    report: GcReport,
) -> None:
    owner_key = root.url.key(name, attempt, rec.OWNER)
    if owner_key not in keys:
        report.foreign += keys  # no owner record: not ckptguard's to delete
        return
    if _marked(root, name) == attempt:
        return
    if _writer_gone(root, name, attempt, None, expired=now - newest >= min_age_s) is None:
        report.kept_live.append(f"{name}/{attempt}")
        return
    report.removed_attempts.append(f"{name}/{attempt}")
    report.removed_objects += len(keys)
    if not dry_run:  # the owner record last: an interrupted gc still knows the rest is ours
        root.bucket.delete_many([k for k in keys if k != owner_key], step=root.naming.parse(name))
        root.bucket.delete(owner_key, what="attempt owner record")


def _writer_gone(
    root: Root, name: str, attempt: str, found: Small | None, *, expired: bool
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


def _uploads(root: Root, now: float, min_age_s: float, dry_run: bool, report: GcReport) -> None:
    for upload in root.bucket.uploads():
        parts = (root.url.relative(upload.key) or "").split("/")
        if (
            len(parts) < 3
            or root.naming.parse(parts[0]) is None
            or not parts[1].startswith(rec.ATTEMPT_PREFIX)
        ):
            report.foreign.append(f"{upload.key} (multipart upload {upload.upload_id})")
            continue
        if (
            owner := root.bucket.get(
                root.url.key(parts[0], parts[1], rec.OWNER), what="attempt owner record"
            )
        ) is None:
            report.foreign.append(f"{upload.key} (multipart upload {upload.upload_id})")
            continue
        expired = now - upload.initiated_unix >= min_age_s
        if _writer_gone(root, parts[0], parts[1], owner, expired=expired) is None:
            continue
        report.aborted_uploads.append(f"{upload.key} ({upload.upload_id})")
        if not dry_run:
            root.bucket.abort(upload, step=root.naming.parse(parts[0]))
