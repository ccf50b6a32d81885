"""Shard files to and from the store: parallel parts within a byte budget, every part checksummed.

Upload: a file up to ``part_bytes`` is one PUT, a larger one a multipart upload; every PUT and
every part carries the CRC32 of its bytes (``ChecksumCRC32``), which the store recomputes and
refuses on a mismatch (BadDigest), so bytes damaged on the way never become part of an object. At
most ``ObjectStoreOptions.workers`` parts are in flight (each held in memory once), whatever the
number of files. A failed upload aborts its multipart upload; one that a kill left is gc's.

Download: ranged GETs of ``part_bytes`` in parallel, each with ``If-Match`` on the ETag the marker
recorded (an object replaced since the commit fails instead of mixing two versions), written into a
temporary name beside the target, size and xxh3 checked against the marker, fsynced, then renamed.
"""

from __future__ import annotations

import base64
import concurrent.futures as _cf
import contextlib
import os
import secrets
import threading
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from ... import _faults
from ...errors import CheckpointCorruptError, ObjectStoreError
from ._bucket import Bucket

PART_POINT = "store.part_uploaded"


@dataclass(frozen=True)
class Outgoing:
    """One local file to upload to ``key``."""

    path: Path
    key: str
    size: int


@dataclass(frozen=True)
class Incoming:
    """One object to download to ``path``, as the marker recorded it."""

    key: str
    path: Path
    size: int
    etag: str
    xxh3: str


def _crc(data: bytes | memoryview) -> str:
    return base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()


def _read(path: Path, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        data = os.pread(f.fileno(), length, offset)
    if len(data) != length:
        raise OSError(
            f"{path}: read {len(data)} of {length} bytes at offset {offset} (the file shrank)"
        )
    return data


class _Multipart:
    """One file's multipart upload: its parts' answers, completed once every part is in."""

    def __init__(self, bucket: Bucket, item: Outgoing, step: int | None) -> None:
        self.bucket, self.item, self.step = bucket, item, step
        try:
            out = bucket.client.create_multipart_upload(
                Bucket=bucket.url.bucket, Key=item.key, ChecksumAlgorithm="CRC32"
            )
        except Exception as exc:
            raise bucket.error(exc, item.key, "starting the multipart upload of", step) from exc
        self.upload_id = str(out["UploadId"])
        self.parts: dict[int, dict[str, Any]] = {}

    def send(self, number: int, offset: int, length: int) -> None:
        data = _read(self.item.path, offset, length)
        crc = _crc(data)
        try:
            out = self.bucket.client.upload_part(
                Bucket=self.bucket.url.bucket,
                Key=self.item.key,
                UploadId=self.upload_id,
                PartNumber=number,
                Body=data,
                ChecksumCRC32=crc,
            )
        except Exception as exc:
            raise self.bucket.error(
                exc, self.item.key, f"uploading part {number} of", self.step
            ) from exc
        echoed = out.get(
            "ChecksumCRC32"
        )  # a store that checks part checksums echoes the one it verified
        if echoed is not None and echoed != crc:
            raise ObjectStoreError(
                f"uploading part {number} of s3://{self.bucket.url.bucket}/{self.item.key} "
                f"(step {self.step}): the store recorded CRC32 {echoed}, the part's bytes "
                f"have {crc}; save again",
                bucket=self.bucket.url.bucket,
                key=self.item.key,
                step=self.step,
            )
        self.parts[number] = {"PartNumber": number, "ETag": str(out["ETag"]), "ChecksumCRC32": crc}

    def complete(self) -> str:
        parts = [self.parts[n] for n in sorted(self.parts)]
        try:
            out = self.bucket.client.complete_multipart_upload(
                Bucket=self.bucket.url.bucket,
                Key=self.item.key,
                UploadId=self.upload_id,
                MultipartUpload={"Parts": parts},
            )
        except Exception as exc:
            raise self.bucket.error(
                exc, self.item.key, "completing the multipart upload of", self.step
            ) from exc
        return str(out["ETag"])

    def abort(self) -> None:
        with contextlib.suppress(Exception):  # best effort: gc aborts what is left
            self.bucket.client.abort_multipart_upload(
                Bucket=self.bucket.url.bucket, Key=self.item.key, UploadId=self.upload_id
            )


def _spans(size: int, part: int) -> Iterator[tuple[int, int, int]]:
    for number, offset in enumerate(range(0, size, part), start=1):
        yield number, offset, min(part, size - offset)


def _put_whole(bucket: Bucket, item: Outgoing, step: int | None) -> str:
    data = _read(item.path, 0, item.size)
    try:
        out = bucket.client.put_object(
            Bucket=bucket.url.bucket, Key=item.key, Body=data, ChecksumCRC32=_crc(data)
        )
    except Exception as exc:
        raise bucket.error(exc, item.key, "uploading", step) from exc
    return str(out["ETag"])


def upload(bucket: Bucket, items: list[Outgoing], *, step: int | None = None) -> dict[str, str]:
    """Upload every file; returns key -> ETag. On any failure the first error is raised after every
    part in flight ended, and this call's unfinished multipart uploads are aborted."""
    opts = bucket.options
    multis: dict[str, _Multipart] = {}
    done: dict[str, str] = {}
    with _Pool(opts.workers, "ckptguard-s3-up") as pool:
        try:
            for item in items:
                if item.size <= opts.part_bytes:
                    pool.submit(item.key, _put_whole, bucket, item, step)
                    continue
                multi = multis[item.key] = _Multipart(bucket, item, step)
                for number, offset, length in _spans(item.size, opts.part_bytes):
                    pool.submit(item.key, _part, multi, number, offset, length)
            pool.settle(done)
            for key, multi in list(multis.items()):
                done[key] = multi.complete()
                del multis[key]
        finally:
            for multi in multis.values():
                multi.abort()
    return done


def _part(multi: _Multipart, number: int, offset: int, length: int) -> None:
    multi.send(number, offset, length)
    _faults.reached(PART_POINT)


class _Pool:
    """Requests in parallel that stop at the first failure: a job that fails marks the pool stopped
    in its own thread, so no worker starts another request after it (a stalled or lying object must
    not keep thousands of requests going), and ``settle`` raises that first failure."""

    def __init__(self, workers: int, name: str) -> None:
        self.pool = _cf.ThreadPoolExecutor(workers, thread_name_prefix=name)
        self.stopped = threading.Event()
        self.jobs: list[tuple[str, _cf.Future[str | None]]] = []

    def submit(self, key: str, fn: Callable[..., str | None], *args: Any) -> None:
        self.jobs.append((key, self.pool.submit(self._run, fn, *args)))

    def _run(self, fn: Callable[..., str | None], *args: Any) -> str | None:
        if self.stopped.is_set():
            return None
        try:
            return fn(*args)
        except BaseException:
            self.stopped.set()
            raise

    def settle(self, done: dict[str, str]) -> None:
        _settle(self.jobs, done)

    def __enter__(self) -> _Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()  # an error raised between submits: the queued jobs end without a request
        self.pool.shutdown(wait=True)


def _settle(jobs: list[tuple[str, _cf.Future[str | None]]], done: dict[str, str]) -> None:
    """Wait for the jobs; the first failure cancels every job not started yet, waits for the running
    ones (none writes later) and is raised."""
    futures = [job for _, job in jobs]
    _cf.wait(futures, return_when=_cf.FIRST_EXCEPTION)
    failed = [
        job for job in futures if job.done() and not job.cancelled() and job.exception() is not None
    ]
    if failed:
        for job in futures:
            job.cancel()
        _cf.wait(futures)
        raise failed[0].exception()  # type: ignore[misc]
    for key, job in jobs:
        etag = job.result()
        if etag is not None:
            done[key] = etag


# ---------------------------------------------------------------- download


def _get_span(
    bucket: Bucket, item: Incoming, fd: int, offset: int, length: int, step: int | None
) -> None:
    try:
        got = bucket.client.get_object(
            Bucket=bucket.url.bucket,
            Key=item.key,
            IfMatch=item.etag,
            Range=f"bytes={offset}-{offset + length - 1}",
        )
        data = got["Body"].read()
    except Exception as exc:
        if bucket.status(exc) == 412:
            raise ObjectStoreError(
                f"s3://{bucket.url.bucket}/{item.key} (step {step}) was replaced after its step "
                f"was committed (ETag is no longer {item.etag}): something outside ckptguard wrote "
                f"it; restore another step",
                bucket=bucket.url.bucket,
                key=item.key,
                step=step,
                status=412,
            ) from exc
        raise bucket.error(exc, item.key, "downloading", step) from exc
    if len(data) != length:
        raise ObjectStoreError(
            f"s3://{bucket.url.bucket}/{item.key} (step {step}): got {len(data)} of {length} "
            f"bytes at offset {offset}; the object is shorter than its marker says "
            f"({item.size} B): restore another step",
            bucket=bucket.url.bucket,
            key=item.key,
            step=step,
        )
    try:
        os.pwrite(fd, data, offset)
    except OSError as exc:
        raise ObjectStoreError(
            f"writing s3://{bucket.url.bucket}/{item.key} (step {step}) into {item.path} at "
            f"offset {offset} failed: {exc.strerror or exc}; free space or fix the staging "
            f"disk, then restore again",
            bucket=bucket.url.bucket,
            key=item.key,
            step=step,
        ) from exc


def download(
    bucket: Bucket,
    items: list[Incoming],
    *,
    step: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Download every object to its path (atomically, checked against size and xxh3). Every size the
    marker declares is checked against the object itself (HEAD) and against the free space before
    a file is created or a byte requested."""
    opts = bucket.options
    with _Pool(opts.workers, "ckptguard-s3-head") as heads:
        for item in items:
            heads.submit(item.key, _head, bucket, item, step)
        heads.settle({})
    _room(items, step, bucket)
    opened: list[tuple[Incoming, int, Path]] = []
    try:
        with _Pool(opts.workers, "ckptguard-s3-down") as pool:
            for item in items:
                item.path.parent.mkdir(parents=True, exist_ok=True)
                tmp = item.path.with_name(f"{item.path.name}.tmp-{secrets.token_hex(4)}")
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
                opened.append((item, fd, tmp))
                os.ftruncate(fd, item.size)
                for _, offset, length in _spans(item.size, opts.part_bytes):
                    pool.submit(item.key, _get_span, bucket, item, fd, offset, length, step)
            pool.settle({})
        for item, fd, tmp in opened:
            os.fsync(fd)
            _check(item, tmp, step)
            os.replace(tmp, item.path)
            if progress is not None:
                progress(item.size)
    finally:
        for _, fd, tmp in opened:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()


def _head(bucket: Bucket, item: Incoming, step: int | None) -> None:
    """The object as the marker recorded it (size and ETag), or the error naming it: a marker that
    declares 1 TiB for a 17 KiB object is refused here, before 16,384 range requests are planned."""
    where = f"s3://{bucket.url.bucket}/{item.key} (step {step})"
    found = bucket.head(item.key, step=step, what="checkpoint object")
    if found is None:
        raise CheckpointCorruptError(
            f"{where} does not exist, but its step's marker names it: something outside "
            "ckptguard deleted it; restore another step"
        )
    size, etag = found
    if size != item.size:
        raise CheckpointCorruptError(
            f"{where}: the marker declares {item.size} bytes, the object has {size}: the "
            f"marker does not describe this object (damaged or crafted); nothing was "
            f"downloaded: restore another step"
        )
    if _unquoted(etag) != _unquoted(
        item.etag
    ):  # stores quote an ETag in one reply and not in another
        raise ObjectStoreError(
            f"{where} was replaced after its step was committed (ETag {etag}, the marker recorded "
            f"{item.etag}): something outside ckptguard wrote it; restore another step",
            bucket=bucket.url.bucket,
            key=item.key,
            step=step,
        )


def _unquoted(etag: str) -> str:
    """An ETag without its quotes and weak prefix (RFC 9110 quotes it; some stores' HEAD and PUT
    replies differ)."""
    text = etag.strip()
    text = text[2:] if text.startswith("W/") else text
    return text.strip('"')


def _room(items: list[Incoming], step: int | None, bucket: Bucket) -> None:
    """The download fits the local disk: a full disk is said before the first byte, not as an
    OSError mid-way."""
    need: dict[int, tuple[int, Path]] = {}
    for item in items:
        base = item.path.parent
        while not base.exists() and base != base.parent:
            base = base.parent
        dev = os.stat(base).st_dev
        total, _ = need.get(dev, (0, base))
        need[dev] = (total + item.size, base)
    for total, base in need.values():
        vfs = os.statvfs(base)
        free = vfs.f_bavail * vfs.f_frsize
        if total > free:
            raise ObjectStoreError(
                f"downloading step {step} from s3://{bucket.url.bucket}/{bucket.url.prefix} needs "
                f"{total} bytes under {base}, which has {free} free: free space there or point the "
                f"staging root at a larger disk",
                bucket=bucket.url.bucket,
                key=items[0].key,
                step=step,
            )


def _check(item: Incoming, tmp: Path, step: int | None) -> None:
    digest = xxhash.xxh3_64()
    with open(tmp, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    if digest.hexdigest() != item.xxh3:
        raise CheckpointCorruptError(
            f"{item.key} (step {step}): downloaded {item.size} B whose xxh3 is "
            f"{digest.hexdigest()}, the marker says {item.xxh3}: the object holds other bytes than "
            f"were committed; restore another step"
        )
