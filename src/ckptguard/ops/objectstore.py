"""What ``ckptguard list`` and ``ckptguard verify`` do on an object-store root (``s3://bucket/prefix``).

``list_remote``: the tracker and every step prefix under the root with its state (committed,
orphan: a marker newer than the tracker, or not committed: objects without a marker).
``verify_remote``: every committed step's marker against the store (each object present with the
size and ETag the marker recorded, the marker's objects equal to the manifest's files), the
tracker's step committed; ``deep`` also downloads each step (xxh3 of every object checked) and
runs the local step checks on the copy. Reads only; endpoint and credentials come from boto3's
configuration (``AWS_ENDPOINT_URL``, ``AWS_PROFILE``, ...).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from .._records.checks import verify_step
from .._records.findings import Finding, Severity
from ..errors import CheckpointError
from ..storage.objectstore import Marker, ObjectStore, ObjectStoreOptions

__all__ = ["RemoteEntry", "RemoteListing", "is_remote", "list_remote", "verify_remote"]


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
            entries.append(RemoteEntry(step, f"NOT committed: marker unreadable ({str(exc).split(';')[0]})", name))
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
        found.append(_err("marker-files", store.where(base[0], "manifest.json"),
                          f"the marker's objects {sorted(set(marker.objects) ^ set(files))[:5]} differ from its "
                          "manifest's files", "the marker is not ckptguard's: restore an earlier step"))
    for rel, obj in sorted(marker.objects.items()):
        where = store.where(*base, rel)
        entry = files.get(rel, {})
        if (entry.get("size"), entry.get("xxh3")) != (obj.size, obj.xxh3):
            found.append(_err("manifest-mismatch", where, "size/xxh3 differ between marker and manifest",
                              "restore an earlier step"))
        head = store.bucket.head(store.url.key(*base, rel), step=marker.step)
        if head is None:
            found.append(_err("missing-object", where, f"absent (step {marker.step} names it)",
                              "restore an earlier committed step; something outside ckptguard deleted it"))
        elif head != (obj.size, obj.etag):
            found.append(_err("object-changed", where, f"size/ETag {head} but the marker recorded "
                              f"({obj.size}, {obj.etag})", "restore an earlier step; the object was rewritten"))
    return found


def verify_remote(url: str, template: str, *, deep: bool = False) -> tuple[list[str], list[Finding]]:
    """Check every committed step of the root; returns the steps' marker URLs and the findings."""
    store = _store(url, template)
    tracker, _ = store.tracker()
    steps = store.committed_steps()
    findings: list[Finding] = []
    if tracker and tracker not in steps:
        findings.append(_err("tracker-target", store.where("latest_checkpointed_iteration.txt"),
                             f"says {tracker}, which is not committed", "set the tracker to a committed step"))
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
                    findings.append(_err("download", store.where(store.naming.name(step)), str(exc).split(";")[0],
                                         "restore an earlier committed step"))
                    continue
                store.write_manifest(marker, step_dir)
                for f in verify_step(step_dir, deep=True):
                    findings.append(Finding(f.severity, f.code, f.path.replace(str(step_dir), store.where(
                        store.naming.name(step), marker.attempt)), f.message, f.fix))
    return checked, findings
