"""ObjectStore: one checkpoint root on an S3-compatible store, the primitives its commit runs on.

The commit's order (an attempt opened, its files uploaded, the marker created, the tracker moved
forward, rotation) is ``_commit.storepublish``'s; this class gives it the store's primitives, each
one process's part: the temporary area (``open_attempt``, ``upload``), create-if-absent of a marker
(``create_marker``), compare-and-set of the tracker (``swap_tracker``), the reads, the deletes, the
lease, and the reads a restore needs (``resolve``, ``fetch``).

Contract (``Consistency.CONDITIONAL``, the default):

- A step is committed when its marker ``<step>/manifest.json`` exists, parses, names the step, and
  the step is no newer than the tracker. The marker is created last (``If-None-Match: *``), after
  every file of its attempt is uploaded, so two writers can never both commit step N: the store
  refuses the second create with 412 and that writer raises ``CommitConflictError``.
- The tracker moves after the marker, by ``If-Match`` on the ETag it was read with, and only
  forward: a writer that finds it at or past its step leaves it. It never names an uncommitted step.
- ``_resume.storefetch.resolve`` reads the tracker and that step's marker; nothing is decided from a
  listing.
- Rotation deletes a step's marker first, then its objects: a half-deleted step is invisible.
- gc (``ckptguard.ops.gc.collect`` over ``ops.storegc.StoreRoot``'s survey of these primitives)
  removes only attempts that carry ckptguard's owner record, that no marker names, that are older
  than ``min_age_s`` and whose writer is gone (``_disk.tempfiles.writer_gone``), aborts multipart
  uploads of such attempts, and never runs on a prefix without the root record or while the
  tracker's step has no readable marker.
- Every size a marker declares is checked (``_objrecords``: an int up to 5 TiB; ``fetch``: equal to
  its manifest's; ``_transfer``: equal to the object's HEAD) before anything is allocated or
  requested.
- A created marker is created again with the same bytes, which the store must refuse: a store that
  honours the probe's key but not the markers' never lets two writers both commit a step.
- The write lease ``lease.json`` is created by conditional create and renewed by ``If-Match``.

A marker newer than the tracker is an orphan (its writer died between marker and tracker): ignored
by resolve, and replaced (marker deleted first) only by a writer that holds the lease.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ..._disk.layout import (
    MANIFEST_NAME,
    PROOF_DIR,
    TRACKER_NAME,
    StepNaming,
    atomic_write_bytes,
    atomic_write_json,
)
from ...errors import (
    CheckpointCorruptError,
    ConditionalWriteUnsupportedError,
    ConfigError,
)
from . import _objrecords as rec
from . import _transfer
from ._bucket import PROOF_LOG_BYTES, Bucket
from ._options import Consistency, ObjectStoreOptions, StoreURL

log = logging.getLogger("ckptguard")

_probed: dict[
    tuple[str, str], bool
] = {}  # (endpoint, bucket) -> conditional writes checked in this process


class ObjectStore:
    """One checkpoint root ``s3://bucket/prefix``; every method is one process's part, without
    collectives."""

    def __init__(
        self,
        url: str | StoreURL,
        options: ObjectStoreOptions | None = None,
        *,
        dir_template: str = "step_{step:08d}",
    ) -> None:
        self.url = url if isinstance(url, StoreURL) else StoreURL.parse(url)
        self.options = options or ObjectStoreOptions()
        if not isinstance(self.options, ObjectStoreOptions):
            raise ConfigError(
                f"options must be an ObjectStoreOptions, got {type(self.options).__name__}"
            )
        self.naming = StepNaming(dir_template)
        self.bucket = Bucket(self.url, self.options)
        self.conditional = self.options.consistency is Consistency.CONDITIONAL
        self._rooted = False  # ensure_root done by this object (the root record and tracker exist)
        self._lease_verified = (
            False  # the store refused a repeated conditional write of lease.json once
        )

    def __str__(self) -> str:
        return str(self.url)

    def where(self, *parts: str) -> str:
        return f"s3://{self.url.bucket}/{self.url.key(*parts)}"

    # ------------------------------------------------------------ the store's promises

    def probe(self) -> None:
        """Check once per process that the store refuses a second conditional create and a stale
        If-Match (412); raise ConditionalWriteUnsupportedError where it accepts them."""
        ident = (self.bucket.endpoint, self.url.bucket)
        if not self.conditional or _probed.get(ident):
            return
        key = self.url.key(f".ckptguard-probe-{secrets.token_hex(6)}")
        try:
            first = self.bucket.create(key, b"probe\n", what="conditional-write probe")
            again = self.bucket.create(key, b"again\n", what="conditional-write probe")
            stale = self.bucket.replace(
                key,
                b"stale\n",
                '"00000000000000000000000000000000"',
                what="conditional-write probe",
            )
        finally:
            self.bucket.delete(key, what="conditional-write probe")
        if first is None or again is not None or stale is not None:
            ignored = "If-None-Match: *" if again is not None else "If-Match"
            raise ConditionalWriteUnsupportedError(
                f"the store at {self.bucket.endpoint} accepted a write to "
                f"s3://{self.url.bucket}/{key} that {ignored} should have refused (HTTP 412): two "
                f"writers could both commit a step there. Use a store with conditional writes (S3, "
                f"GCS, MinIO, R2, recent Ceph), or, with exactly one writer guaranteed by you, "
                f"ObjectStoreOptions(consistency=Consistency.SINGLE_WRITER_UNSAFE) "
                f"(docs/objectstore.md)",
                bucket=self.url.bucket,
                key=key,
            )
        _probed[ident] = True

    def ensure_root(self) -> None:
        """The root record, then tracker 0 (a declared fresh start), each created only if absent."""
        if self._rooted:
            return
        self.probe()
        key = self.url.key(rec.ROOT_RECORD)
        found = self.bucket.get(key, what="root record")
        if found is None:
            record = rec.RootRecord(time.time(), rec.Writer.here(), self.options.consistency.value)
            self.bucket.create(
                key, record.to_bytes(), what="root record", conditional=self.conditional
            )
        else:
            rec.RootRecord.from_bytes(
                found.data, self.where(rec.ROOT_RECORD)
            )  # a foreign record raises
        if (
            self.conditional or self.tracker()[0] is None
        ):  # a plain PUT must never reset a tracker that exists
            self.bucket.create(
                self.url.key(TRACKER_NAME), b"0\n", what="tracker", conditional=self.conditional
            )
        self._rooted = True

    # ------------------------------------------------------------ reads

    def tracker(self) -> tuple[int | None, str | None]:
        """The tracker's step and ETag; (None, None) when there is none."""
        found = self.bucket.get(self.url.key(TRACKER_NAME), what="tracker")
        if found is None:
            return None, None
        return rec.parse_tracker(found.data, self.where(TRACKER_NAME)), found.etag

    def marker(self, step: int) -> rec.Marker | None:
        name = self.naming.name(step)
        found = self.bucket.get(self.url.key(name, MANIFEST_NAME), step=step, what="commit marker")
        if found is None:
            return None
        marker = rec.Marker.from_bytes(found.data, self.where(name, MANIFEST_NAME))
        if marker.step != step:
            raise CheckpointCorruptError(
                f"{self.where(name, MANIFEST_NAME)} says step {marker.step}, its key {step}"
            )
        return marker

    def has_root(self) -> bool:
        """Whether the root record exists (a ckptguard root was created under this prefix)."""
        return self.bucket.get(self.url.key(rec.ROOT_RECORD), what="root record") is not None

    def empty(self) -> bool:
        """Nothing under the prefix (no root record, no object at all): a mistyped URL, or a root
        not created yet."""
        if self.has_root():
            return False
        return next(iter(self.bucket.listing()), None) is None

    def committed_steps(self) -> list[int]:
        """Steps whose marker is valid and no newer than the tracker (a listing finds the
        candidates; each step's marker decides)."""
        tracker, _ = self.tracker()
        out = []
        for name in self.bucket.children():
            step = self.naming.parse(name)
            if step is None or not tracker or step > tracker:
                continue
            try:
                if self.marker(step) is not None:
                    out.append(step)
            except CheckpointCorruptError as exc:
                log.warning("ckptguard: %s: %s (not counted as committed)", self.where(name), exc)
        return sorted(out)

    def marked_steps(self) -> list[int]:
        """Every step with a marker object under the prefix, whatever the tracker says, a damaged
        one included (a listing: the resume rule refuses markers that stand without a tracker)."""
        out = []
        for name in self.bucket.children():
            step = self.naming.parse(name)
            if step is not None and self.bucket.get(
                self.url.key(name, MANIFEST_NAME), step=step, what="commit marker"
            ):
                out.append(step)
        return sorted(out)

    # ------------------------------------------------------------ the commit's primitives
    # (_commit.storepublish)

    def open_attempt(self, step: int) -> str:
        """A new temporary area for ``step``: an attempt whose owner record is written first;
        returns its name."""
        attempt = f"{rec.ATTEMPT_PREFIX}{secrets.token_hex(8)}"
        owner = rec.Owner(step, attempt, rec.Writer.here(), time.time())
        self.bucket.create(
            self.url.key(self.naming.name(step), attempt, rec.OWNER),
            owner.to_bytes(),
            step=step,
            what="attempt owner record",
            conditional=False,
        )
        return attempt

    def drop_marker(self, step: int, *, what: str = "orphan marker") -> None:
        """Delete the marker of ``step`` (its objects stay)."""
        self.bucket.delete(
            self.url.key(self.naming.name(step), MANIFEST_NAME), step=step, what=what
        )

    def upload(
        self, step: int, attempt: str, files: Sequence[tuple[str, Path, int]]
    ) -> dict[str, str]:
        """Upload ``(relative name, local path, size)`` files into the attempt; returns name ->
        ETag."""
        base = (self.naming.name(step), attempt)
        items = [
            _transfer.Outgoing(path, self.url.key(*base, rel), size) for rel, path, size in files
        ]
        etags = _transfer.upload(self.bucket, items, step=step)
        return {rel: etags[self.url.key(*base, rel)] for rel, _, _ in files}

    def create_marker(self, marker: rec.Marker) -> bool:
        """Create the step's marker if absent (``If-None-Match: *``); True only where the store
        created it under that condition (and refused the same create again: ``_check_refused``).
        False: refused (another writer's, or this writer's own retried request that had landed) or
        written unconditionally; the caller reads the marker back to know whose it is."""
        key = self.url.key(self.naming.name(marker.step), MANIFEST_NAME)
        data = marker.to_bytes()
        created = self.bucket.create(
            key, data, step=marker.step, what="commit marker", conditional=self.conditional
        )
        if created is None or not self.conditional:
            return False
        self._check_refused(
            key,
            data,
            marker.step,
            what="commit marker",
            risk=f"two writers could both commit "
            f"step {marker.step}. Step {marker.step} is not committed (the tracker did not move)",
        )
        return True

    def swap_tracker(self, step: int, etag: str | None) -> bool:
        """Write the tracker as ``step`` if it is still the version ``etag`` (None: only if absent);
        False: it changed in between (compare-and-set; a plain PUT under
        ``SINGLE_WRITER_UNSAFE``)."""
        key, data = self.url.key(TRACKER_NAME), f"{step}\n".encode()
        if etag is None:
            done = self.bucket.create(
                key, data, step=step, what="tracker", conditional=self.conditional
            )
        else:
            done = self.bucket.replace(
                key, data, etag, step=step, what="tracker", conditional=self.conditional
            )
        return done is not None

    def _check_refused(
        self,
        key: str,
        data: bytes,
        step: int | None,
        *,
        what: str,
        risk: str,
        stale: str | None = None,
    ) -> None:
        """The store honoured the condition on this very key: the same bytes written again under the
        same condition (created again, or replacing the ETag just replaced: ``stale``) must be
        refused. A store that honours the probe's key but not this one (a proxy, a bucket policy, a
        gateway rule per path) would otherwise let a second writer overwrite what this one wrote
        while both believe they won. The bytes are this writer's own, so a store that accepts them
        changes nothing of its own write."""
        doing = "create" if stale is None else "replace"
        again = (
            self.bucket.create(key, data, step=step, what=f"{what} (check of If-None-Match)")
            if stale is None
            else self.bucket.replace(
                key, data, stale, step=step, what=f"{what} (check of If-Match)"
            )
        )
        if again is None:
            return
        header = "If-None-Match: *" if stale is None else "a stale If-Match"
        raise ConditionalWriteUnsupportedError(
            f"the store at {self.bucket.endpoint} accepted a second {doing} of "
            f"s3://{self.url.bucket}/{key} with {header} (it refused the probe's): it ignores "
            f"conditional writes on this key, so {risk}. Fix the store or the proxy in front of "
            f"it, or with exactly one writer guaranteed by you use "
            f"ObjectStoreOptions(consistency=Consistency.SINGLE_WRITER_UNSAFE) "
            f"(docs/objectstore.md)",
            bucket=self.url.bucket,
            key=key,
            step=step,
        )

    # ------------------------------------------------------------ restore

    def fetch(
        self,
        marker: rec.Marker,
        step_dir: Path,
        *,
        only: set[str] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        """Download the marker's objects (or ``only`` those) into ``step_dir``; the caller writes
        the manifest (``write_manifest``) once every process finished."""
        base = (self.naming.name(marker.step), marker.attempt)
        items = [
            _transfer.Incoming(self.url.key(*base, rel), step_dir / rel, o.size, o.etag, o.xxh3)
            for rel, o in sorted(marker.objects.items())
            if only is None or rel in only
        ]
        self._same_as_manifest(
            marker, [rel for rel in sorted(marker.objects) if only is None or rel in only]
        )
        _transfer.download(self.bucket, items, step=marker.step, progress=progress)

    def _same_as_manifest(self, marker: rec.Marker, names: list[str]) -> None:
        """The marker's objects are the files its manifest lists, with the same sizes and xxh3: the
        local restore checks the files against the manifest, the download against the marker."""
        files = marker.manifest.get("files")
        listed = (
            {f.get("path"): f for f in files if isinstance(f, dict)}
            if isinstance(files, list)
            else {}
        )
        for rel in names:
            obj, entry = marker.objects[rel], listed.get(rel)
            if entry is None or entry.get("size") != obj.size or entry.get("xxh3") != obj.xxh3:
                where = self.where(self.naming.name(marker.step), marker.attempt, rel)
                said = (
                    "lists no such file"
                    if entry is None
                    else f"says {str(entry.get('size'))[:40]} bytes, xxh3 "
                    f"{str(entry.get('xxh3'))[:70]}"
                )
                raise CheckpointCorruptError(
                    f"{where} (step {marker.step}): the marker declares {obj.size} bytes, xxh3 "
                    f"{obj.xxh3}; its manifest {said}: the marker is damaged or crafted, nothing "
                    f"was downloaded: restore another step"
                )

    @staticmethod
    def write_manifest(marker: rec.Marker, step_dir: Path) -> None:
        atomic_write_json(step_dir / MANIFEST_NAME, marker.manifest)

    def state_url(self, marker: rec.Marker) -> str:
        """The URL of the step's DCP directory: what ``FsspecReader`` (with s3fs) reads."""
        return self.where(self.naming.name(marker.step), marker.attempt, "state")

    # ------------------------------------------------------------ rotation and gc

    def delete_step(self, step: int) -> None:
        """Marker first, then every object under the step (all attempts)."""
        name = self.naming.name(step)
        self.bucket.delete(self.url.key(name, MANIFEST_NAME), step=step, what="commit marker")
        keys = [o.key for o in self.bucket.listing(name + "/")]
        self.bucket.delete_many(keys, step=step)

    def put_proof(self, name: str, data: bytes) -> None:
        """One rank's proof log ``name`` (``rank_00000.jsonl``), copied whole to ``proof/<name>``: a
        plain PUT, each rank writes only its own file (the lease holder's job)."""
        if not rec.is_proof(f"{PROOF_DIR}/{name}"):
            raise ConfigError(f"{name!r} is not a proof log name (rank_NNNNN.jsonl)")
        self.bucket.create(
            self.url.key(PROOF_DIR, name), data, what="proof records", conditional=False
        )

    def get_proof(self, name: str) -> bytes | None:
        """The store's copy of one rank's proof log (None: there is none)."""
        found = self.bucket.get(
            self.url.key(PROOF_DIR, name), what="proof records", limit=PROOF_LOG_BYTES
        )
        return None if found is None else found.data

    def fetch_proof(self, dest: Path) -> list[str]:
        """Every ``proof/*.jsonl`` under the root, downloaded into ``dest/proof``; returns their
        names."""
        names = []
        (dest / PROOF_DIR).mkdir(parents=True, exist_ok=True)
        for obj in self.bucket.listing(PROOF_DIR + "/"):
            rel = self.url.relative(obj.key) or ""
            if not rec.is_proof(rel):
                continue
            found = self.bucket.get(obj.key, what="proof records", limit=PROOF_LOG_BYTES)
            if found is not None:
                name = rel.split("/", 1)[1]
                atomic_write_bytes(dest / PROOF_DIR / name, found.data)
                names.append(name)
        return sorted(names)

    # ------------------------------------------------------------ the write lease's primitives

    def lease(self) -> tuple[rec.Lease | None, str | None]:
        """``lease.json`` as it is now and its ETag; (None, None) when there is none. Who may take
        it over is the commit side's rule (``ckptguard._commit.storelease``)."""
        found = self.bucket.get(self.url.key(rec.LEASE), what="write lease")
        if found is None:
            return None, None
        return rec.Lease.from_bytes(found.data, self.where(rec.LEASE)), found.etag

    def put_lease(self, lease: rec.Lease, etag: str | None, *, verify: bool = True) -> bool:
        """Write ``lease`` if ``lease.json`` is still the version ``etag`` (None: only if absent);
        False: it changed in between (compare-and-set; a plain PUT under ``SINGLE_WRITER_UNSAFE``).
        With ``verify`` the first write of this object is checked once: the store must refuse the
        same write again (``ConditionalWriteUnsupportedError`` where it does not: two jobs could
        both hold the lease)."""
        key, data = self.url.key(rec.LEASE), lease.to_bytes()
        if etag is None:
            done = (
                self.bucket.create(key, data, what="write lease", conditional=self.conditional)
                is not None
            )
        else:
            done = (
                self.bucket.replace(
                    key, data, etag, what="write lease", conditional=self.conditional
                )
                is not None
            )
        if (
            done and verify and self.conditional and not self._lease_verified
        ):  # renewed at every save: once
            self._check_refused(
                key,
                data,
                None,
                what="write lease",
                stale=etag,
                risk="two jobs could both hold the write lease",
            )
            self._lease_verified = True
        return done
