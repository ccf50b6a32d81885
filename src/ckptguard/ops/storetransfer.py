"""``ckptguard transfer`` between a local root and an object-store root, both directions.

Each direction follows the DESTINATION's commit rules, so a transfer killed anywhere leaves
nothing half-visible:

- local -> store (``to_store``): the step's files are uploaded under an attempt of the transfer's
  own (multipart, CRC32 per part), the marker created last with ``If-None-Match: *``, the tracker
  moved by ``If-Match`` and never backwards, under the store's write lease (a live job writing the
  store refuses the transfer). A step at or below the store's tracker is refused
  (``CommitConflictError``): a committed step on a store is never overwritten. A killed transfer
  leaves an unmarked attempt (``ckptguard gc s3://...`` removes it).
- store -> local (``from_store``): the marker's objects are downloaded into a temp directory of the
  destination (each checked against the marker's size and xxh3, fsynced), the contract phases
  copied in, the manifest written last, the directory renamed to the step name and only then the
  tracker moved, under the destination's lease, and a transfer record written (``transfers/``, as a
  local transfer's). A killed transfer leaves a temp directory the destination's sweep
  (``ckptguard gc``) removes.

The contract chain must match on both sides (a store's chain is in its markers' phases).
"""

from __future__ import annotations

import getpass
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import _faults
from .._commit import storelease, storepublish
from .._disk import layout as _layout
from .._disk import lease as _lease
from .._records import contract as _contract
from .._records import manifest as _manifest
from .._records import readers as _readers
from .._records.checks import verify_step
from .._resume.storefetch import resolve
from ..errors import CheckpointCorruptError, CheckpointError, ConfigError, ResumeError
from ..storage.s3 import Marker, ObjectStore, ObjectStoreOptions, StoredObject
from .transfer import TRANSFERS_DIR, publishing

log = logging.getLogger("ckptguard")

__all__ = ["from_store", "to_store"]

BEFORE_RENAME = "transfer.before_rename"


def _chain(phases: dict[str, dict[str, Any]]) -> str | None:
    first = phases.get(min(phases)) if phases else None
    return str(first.get("chain_id")) if isinstance(first, dict) and first.get("chain_id") else None


def to_store(
    step_dir: str | os.PathLike[str],
    url: str,
    *,
    template: str = "step_{step:08d}",
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Commit the committed local ``step_dir`` as its step on the store at ``url`` (the local root's
    rotation and gc keep the step meanwhile: a reader lease)."""
    step_dir = Path(os.fspath(step_dir)).absolute()
    with _readers.reading(step_dir, who=f"transfer to {url} in pid {os.getpid()}") as unheld:
        if unheld is not None:
            log.warning(
                "ckptguard: transfer reads %s without a reader lease (%s)", step_dir, unheld
            )
        return _to_store_read(step_dir, url, template, progress)


def _to_store_read(
    step_dir: Path, url: str, template: str, progress: Callable[[int, int], None] | None
) -> dict[str, Any]:
    errors = [f for f in verify_step(step_dir) if f.severity.value == "ERROR"]
    if errors:
        raise CheckpointCorruptError(
            f"transfer: {step_dir} is not a complete checkpoint: {errors[0].line()}"
        )
    manifest = _manifest.read(step_dir)
    if manifest.nodes:
        raise ConfigError(
            f"transfer: {step_dir} was saved on node-local roots and holds only this "
            f"node's part of step {manifest.step}; the store needs the whole step: restore "
            f"it once (every node), or transfer each node's part into one shared root "
            f"first, then transfer that step"
        )
    raw = _layout.read_json(step_dir / _layout.MANIFEST_NAME, what="manifest")
    store = ObjectStore(url, ObjectStoreOptions(), dir_template=template)
    phases = {
        p.name: _layout.read_json(p, what="contract phase")
        for p in _contract.phase_files(step_dir.parent)
    }
    started = time.time()
    holder = f"transfer:{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
    store.ensure_root()
    note = storelease.acquire(store, holder)
    try:
        _same_chain_on_store(store, phases, step_dir)
        attempt = storepublish.begin(store, manifest.step)
        files = [(f.path, step_dir / f.path, f.size) for f in manifest.files]
        total = sum(size for _, _, size in files)
        if progress is not None:
            progress(0, total)
        etags = store.upload(manifest.step, attempt, files)
        if progress is not None:
            progress(total, total)
        objects = {f.path: StoredObject(f.size, f.xxh3, etags[f.path]) for f in manifest.files}
        marker = storepublish.commit(
            store, manifest.step, attempt, objects, raw, phases=phases, lease=holder
        )
    finally:
        storelease.release(store, holder)
    return {
        "source": str(step_dir),
        "destination": marker,
        "step": manifest.step,
        "files": len(files),
        "bytes": total,
        "attempt": attempt,
        "tracker_set_to": store.tracker()[0],
        "started_unix": started,
        "finished_unix": time.time(),
        "who": holder,
        **({"lease": note} if note else {}),
    }


def _same_chain_on_store(
    store: ObjectStore, phases: dict[str, dict[str, Any]], step_dir: Path
) -> None:
    tracker, _ = store.tracker()
    marker = store.marker(tracker) if tracker else None
    theirs, ours = _chain(marker.phases) if marker else None, _chain(phases)
    if theirs and ours and theirs != ours:
        raise ConfigError(
            f"transfer: {store.url} holds run chain {theirs} (step {tracker}), {step_dir} belongs "
            f"to chain {ours}; transfer into an empty prefix"
        )


def from_store(
    url: str,
    dest_root: str | os.PathLike[str],
    *,
    step: int | None = None,
    template: str = "step_{step:08d}",
    record: str | os.PathLike[str] | None = None,
    ttl_s: float = 6 * 3600.0,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Copy the store's committed ``step`` (None: the tracker's) into the local root ``dest_root``;
    the transfer record goes to ``record`` (default ``dest_root/transfers/``), as a local transfer's
    does."""
    store = ObjectStore(url, ObjectStoreOptions(), dir_template=template)
    marker = _committed(store, step)
    dest_root = Path(os.fspath(dest_root)).absolute()
    final = dest_root / store.naming.name(marker.step)
    dest_root.mkdir(parents=True, exist_ok=True)
    started = time.time()
    ours = _lease.is_mine(dest_root)
    note = _lease.acquire(dest_root, ttl_s=ttl_s)
    try:
        resumed = _into(store, marker, dest_root, final, progress)
        current = _layout.read_tracker(dest_root) or 0
        if marker.step >= current:
            _layout.write_tracker(dest_root, marker.step)
    finally:
        if not ours:
            _lease.release(dest_root)
    info = {
        "source": store.where(store.naming.name(marker.step), "manifest.json"),
        "destination": str(final),
        "step": marker.step,
        "files": len(marker.objects),
        "bytes": sum(o.size for o in marker.objects.values()),
        "attempt": marker.attempt,
        "tracker_set_to": max(marker.step, current),
        "resumed": resumed,
        "who": f"{getpass.getuser()}@{socket.gethostname()} pid {os.getpid()}",
        "started_unix": started,
        "finished_unix": time.time(),
        **({"lease": note} if note else {}),
    }
    default = dest_root / TRANSFERS_DIR / f"{int(started)}-step{marker.step}.json"
    rec_path = Path(os.fspath(record)) if record is not None else default
    rec_path.parent.mkdir(parents=True, exist_ok=True)
    _layout.atomic_write_json(rec_path, info)
    return {**info, "record": str(rec_path)}


def _committed(store: ObjectStore, step: int | None) -> Marker:
    tracker, _ = store.tracker()
    if tracker is None:
        raise ConfigError(
            f"transfer: no checkpoint root at {store.url} (no tracker); check the URL and "
            "AWS_ENDPOINT_URL"
        )
    if step is None:
        found = resolve(store, must=True)
        assert found.marker is not None
        return found.marker
    marker = store.marker(step)
    if marker is None or step > tracker:
        what = (
            "has no marker"
            if marker is None
            else f"is newer than the tracker ({tracker}): not committed"
        )
        raise ResumeError(
            f"transfer: step {step} at {store.url} {what}; `ckptguard list {store.url}` shows the "
            "committed steps"
        )
    return marker


def _into(
    store: ObjectStore,
    marker: Marker,
    dest_root: Path,
    final: Path,
    progress: Callable[[int, int], None] | None,
) -> bool:
    if final.exists() or final.is_symlink():
        try:
            same = (
                _layout.read_json(final / _layout.MANIFEST_NAME, what="manifest") == marker.manifest
            )
        except (OSError, CheckpointError):
            same = False
        if not same or any(f.severity.value == "ERROR" for f in verify_step(final, deep=True)):
            raise ConfigError(
                f"transfer: {final} already exists and is not a complete copy of step "
                f"{marker.step} of {store.url}; remove it or pick another destination root"
            )
        _phases(store, marker, dest_root)
        return True  # killed between its rename and the tracker: only the tracker is left
    _phases(store, marker, dest_root)
    total, done = sum(o.size for o in marker.objects.values()), [0]

    def fetched(size: int) -> None:
        done[0] += size
        if progress is not None:
            progress(done[0], total)

    with publishing(dest_root, final) as tmp:
        store.fetch(marker, tmp, progress=fetched)
        store.write_manifest(
            marker, tmp
        )  # the manifest last: the copy is complete before it says so
        errors = [
            f
            for f in verify_step(tmp)
            if f.severity.value == "ERROR" and not f.path.endswith(_layout.OWNER_NAME)
        ]  # the owner record goes right before the rename
        if errors:
            raise CheckpointCorruptError(
                f"transfer: the copy of step {marker.step} from {store.url} fails its "
                f"check: {errors[0].line()}"
            )
        _faults.reached(BEFORE_RENAME)
    return False


def _phases(store: ObjectStore, marker: Marker, dest_root: Path) -> None:
    """The destination continues the marker's run chain: its phases must be the marker's."""
    own = _contract.read_phases(dest_root)
    theirs = _chain(marker.phases)
    if own and theirs and str(own[0].chain_id) != theirs:
        raise ConfigError(
            f"transfer: {dest_root} belongs to run chain {own[0].chain_id}, step {marker.step} of "
            f"{store.url} to {theirs}; transfer into an empty root"
        )
    for name, record in sorted(marker.phases.items()):
        target = dest_root / _layout.CONTRACT_DIR / name
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            _layout.atomic_write_json(target, record)
