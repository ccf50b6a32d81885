"""What ``ckptguard list``, ``verify``, ``preflight``, ``gc`` and ``prove`` do on an object-store
root (``s3://bucket/prefix``); ``transfer`` is ``ops.storetransfer``.

``list_remote``: the tracker and every step prefix under the root with its state (committed,
orphan: a marker newer than the tracker, or not committed: objects without a marker).
``verify_remote``: every committed step's marker against the store (each object present with the
size and ETag the marker recorded, the marker's objects equal to the manifest's files), the
tracker's step committed; ``deep`` also downloads each step (xxh3 of every object checked) and
runs the local step checks on the copy. ``preflight_remote``: the step a launch would resume
(tracker and marker), its objects present as the marker recorded, the write lease (a live job's is
said). ``gc_remote``: the one gc procedure (``ops.gc.collect``) over the store's survey
(``ops.storegc.StoreRoot``: unmarked attempts with ckptguard's owner record, older than
``min_age_s``, whose writer is gone, and their multipart uploads), refused while a live job holds
the lease unless ``force`` or ``dry_run``.
``fetch_proof``: every rank's proof log copied from the store's ``proof/`` (each rank's copy is
updated at every save and at close) into a local directory ``prove`` judges. Endpoint and
credentials come from boto3's configuration (``AWS_ENDPOINT_URL``, ``AWS_PROFILE``, ...).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .._commit import storelease
from .._disk.layout import PROOF_DIR, TRACKER_NAME
from .._records.checks import verify_step
from .._records.findings import Finding, Severity
from .._resume.storefetch import resolve
from ..errors import CheckpointError, LeaseHeldError
from ..storage.s3 import Marker, ObjectStore, ObjectStoreOptions
from .gc import GcReport, Progress, collect
from .storegc import StoreRoot

__all__ = [
    "RemoteEntry",
    "RemoteListing",
    "RemotePreflight",
    "fetch_proof",
    "gc_remote",
    "is_remote",
    "list_remote",
    "preflight_remote",
    "verify_remote",
]


def is_remote(root: str) -> bool:
    return root.startswith("s3://")


@dataclass(frozen=True)
class RemoteEntry:
    step: int
    state: str
    name: str


@dataclass(frozen=True)
class RemoteListing:
    tracker: int | None
    entries: list[RemoteEntry]


def _store(url: str, template: str) -> ObjectStore:
    return ObjectStore(url, ObjectStoreOptions(), dir_template=template)


def list_remote(url: str, template: str) -> RemoteListing:
    store = _store(url, template)
    tracker, _ = store.tracker()
    entries = []
    for name in sorted(store.bucket.children()):
        step = store.naming.parse(name)
        if step is None:
            continue
        try:
            marker = store.marker(step)
        except CheckpointError as exc:
            entries.append(
                RemoteEntry(
                    step, f"NOT committed: marker unreadable ({str(exc).split(';')[0]})", name
                )
            )
            continue
        if marker is None:
            state = "NOT committed: no marker (an interrupted save; `gc` removes it)"
        elif tracker is not None and step <= tracker:
            state = f"committed (attempt {marker.attempt}, {marker.writer.describe()})"
        else:
            state = "orphan (marker newer than the tracker)"
        entries.append(RemoteEntry(step, state, name))
    return RemoteListing(tracker, entries)


def _err(code: str, where: str, message: str, fix: str) -> Finding:
    return Finding(Severity.ERROR, code, where, message, fix)


def _check_objects(store: ObjectStore, marker: Marker) -> list[Finding]:
    base = (store.naming.name(marker.step), marker.attempt)
    found: list[Finding] = []
    files = {str(f.get("path")): f for f in marker.manifest.get("files", []) if isinstance(f, dict)}
    if set(files) != set(marker.objects):
        found.append(
            _err(
                "marker-files",
                store.where(base[0], "manifest.json"),
                f"the marker's objects {sorted(set(marker.objects) ^ set(files))[:5]} differ "
                f"from its manifest's files",
                "the marker is not ckptguard's: restore an earlier step",
            )
        )
    for rel, obj in sorted(marker.objects.items()):
        where = store.where(*base, rel)
        entry = files.get(rel, {})
        if (entry.get("size"), entry.get("xxh3")) != (obj.size, obj.xxh3):
            found.append(
                _err(
                    "manifest-mismatch",
                    where,
                    "size/xxh3 differ between marker and manifest",
                    "restore an earlier step",
                )
            )
        head = store.bucket.head(store.url.key(*base, rel), step=marker.step)
        if head is None:
            found.append(
                _err(
                    "missing-object",
                    where,
                    f"absent (step {marker.step} names it)",
                    "restore an earlier committed step; something outside ckptguard deleted it",
                )
            )
        elif head != (obj.size, obj.etag):
            found.append(
                _err(
                    "object-changed",
                    where,
                    f"size/ETag {head} but the marker recorded ({obj.size}, {obj.etag})",
                    "restore an earlier step; the object was rewritten",
                )
            )
    return found


def _no_tracker(store: ObjectStore) -> Finding:
    """A root without a tracker: nothing there (a mistyped URL), or a root whose tracker was
    deleted."""
    if store.empty():
        return _err(
            "no-root",
            str(store.url),
            f"no checkpoint root at {store.url}: nothing under the prefix",
            "check the URL and AWS_ENDPOINT_URL (a root is created by its first save)",
        )
    parent, _, last = store.url.prefix.rpartition("/")
    if parent and store.naming.parse(last) is not None:  # a step's prefix given for its root's
        root = f"s3://{store.url.bucket}/{parent}"
        return _err(
            "step-not-root",
            str(store.url),
            f"names step {store.naming.parse(last)} of the root {root}, not a root",
            f"give the root: `ckptguard verify {root}` (never create a "
            f"tracker under a step's prefix)",
        )
    return _err(
        "no-tracker",
        store.where(TRACKER_NAME),
        "absent, but the prefix holds objects: no step is committed without it",
        "restore the tracker, or set it by hand to the newest committed step "
        "(`ckptguard list` shows the markers)",
    )


def _unreadable_markers(store: ObjectStore, tracker: int) -> list[Finding]:
    """Steps at or below the tracker whose marker exists but does not parse: ``committed_steps``
    leaves them out (with a warning), so verify says them instead of passing over them."""
    found = []
    for name in sorted(store.bucket.children()):
        step = store.naming.parse(name)
        if step is None or step > tracker:
            continue
        try:
            store.marker(step)
        except CheckpointError as exc:
            found.append(
                _err(
                    "marker-unreadable",
                    store.where(name, "manifest.json"),
                    str(exc)[:300],
                    "the step cannot be restored: restore its marker from a copy, or resume an "
                    "earlier committed step",
                )
            )
    return found


def verify_remote(
    url: str, template: str, *, deep: bool = False
) -> tuple[list[str], list[Finding]]:
    """Check every committed step of the root; returns the steps' marker URLs and the findings."""
    store = _store(url, template)
    tracker, _ = store.tracker()
    if tracker is None:
        return [], [_no_tracker(store)]
    steps = store.committed_steps()
    findings: list[Finding] = []
    if tracker and tracker not in steps:
        findings.append(
            _err(
                "tracker-target",
                store.where("latest_checkpointed_iteration.txt"),
                f"says {tracker}, which is not committed",
                "set the tracker to a committed step",
            )
        )
    findings += _unreadable_markers(store, tracker)
    checked = []
    for step in steps:
        marker = store.marker(step)
        if marker is None:
            continue
        checked.append(store.where(store.naming.name(step), "manifest.json"))
        problems = _check_objects(store, marker)
        findings += problems
        if deep and not problems:
            with tempfile.TemporaryDirectory(prefix="ckptguard-verify-") as tmp:
                step_dir = Path(tmp) / store.naming.name(step)
                try:
                    store.fetch(marker, step_dir)
                except CheckpointError as exc:
                    findings.append(
                        _err(
                            "download",
                            store.where(store.naming.name(step)),
                            str(exc).split(";")[0],
                            "restore an earlier committed step",
                        )
                    )
                    continue
                store.write_manifest(marker, step_dir)
                for f in verify_step(step_dir, deep=True):
                    findings.append(
                        Finding(
                            f.severity,
                            f.code,
                            f.path.replace(
                                str(step_dir), store.where(store.naming.name(step), marker.attempt)
                            ),
                            f.message,
                            f.fix,
                        )
                    )
    return checked, findings


@dataclass(frozen=True)
class RemotePreflight:
    step: int | None
    url: str | None  # the step's marker (None: a fresh start, or unresolved)
    reason: str
    findings: list[Finding]

    @property
    def ok(self) -> bool:
        return not any(f.severity is Severity.ERROR for f in self.findings)


def preflight_remote(url: str, template: str, *, expect_step: int | None = None) -> RemotePreflight:
    """Before a launch on an object-store root: what it resumes and whether every object is
    there."""
    store = _store(url, template)
    tracker, _ = store.tracker()
    if tracker is None:
        return RemotePreflight(
            None,
            None,
            "no tracker",
            [
                _err(
                    "no-root",
                    store.where(TRACKER_NAME),
                    f"no checkpoint root at {store.url} (no tracker)",
                    "check the URL and AWS_ENDPOINT_URL; a first launch needs no preflight (its "
                    "first save creates the root)",
                )
            ],
        )
    try:
        found = resolve(store)
    except CheckpointError as exc:
        return RemotePreflight(
            tracker,
            None,
            "unresolved",
            [
                _err(
                    "resolve",
                    store.where(TRACKER_NAME),
                    str(exc),
                    "`ckptguard list` shows the committed steps",
                )
            ],
        )
    findings = [] if found.marker is None else _check_objects(store, found.marker)
    if expect_step is not None and found.step != expect_step:
        findings.append(
            _err(
                "expect-step",
                store.where(TRACKER_NAME),
                f"resumes step {found.step}, expected {expect_step}",
                "check which job wrote the newer step before launching",
            )
        )
    try:
        storelease.check(store, "ckptguard-preflight")
    except LeaseHeldError as exc:
        findings.append(
            Finding(
                Severity.WARNING,
                "lease-held",
                store.where("lease.json"),
                str(exc).split(": ", 1)[-1],
                "a launch now is refused at its first save or restore while that job lives",
            )
        )
    where = store.where(store.naming.name(found.step), "manifest.json") if found.step else None
    return RemotePreflight(found.step, where, found.reason, findings)


def gc_remote(
    url: str,
    template: str,
    *,
    min_age_s: float,
    dry_run: bool,
    force: bool,
    orphans: bool = False,
    progress: Progress | None = None,
) -> GcReport:
    """``gc.collect`` on the object store's root at ``url`` (``storegc.StoreRoot``)."""
    target = StoreRoot(_store(url, template), min_age_s=min_age_s)
    return collect(target, dry_run=dry_run, orphans=orphans, force=force, progress=progress)


def fetch_proof(url: str, template: str, dest: str | os.PathLike[str]) -> list[str]:
    """Every rank's proof log from ``<url>/proof/`` into ``dest/proof``; raises when there is
    none."""
    store = _store(url, template)
    names = store.fetch_proof(Path(os.fspath(dest)))
    if not names:
        raise CheckpointError(
            f"{store.where(PROOF_DIR)}/ holds no proof records: each rank copies its log there at "
            f"every save and at close (ckptguard >= this version); `ckptguard prove STAGING` reads "
            f"a staging root's own records"
        )
    return names
