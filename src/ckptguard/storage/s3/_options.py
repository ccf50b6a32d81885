"""Where a store is (``StoreURL``) and how it is talked to (``ObjectStoreOptions``,
``Consistency``)."""

from __future__ import annotations

import enum
import os
import re
from dataclasses import dataclass

from ...errors import ConfigError

MIB = 1 << 20
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.\-_]{1,254}\Z")


class Consistency(str, enum.Enum):
    """What the commit relies on from the store."""

    CONDITIONAL = "conditional"
    """The default: the marker is a conditional create (``If-None-Match: *``) and the tracker and
    the lease are conditional writes on their previous ETag (``If-Match``). Checked once per store
    by a probe that must see both refused with 412; a store that accepts them is refused."""
    SINGLE_WRITER_UNSAFE = "single-writer-unsafe"
    """A store without conditional writes: plain PUTs, each read back once after writing. Nothing
    stops two writers from both committing a step or from moving the tracker backwards; the operator
    guarantees a single writer (docs/objectstore.md). Only when asked for by this name."""


@dataclass(frozen=True)
class StoreURL:
    """``s3://bucket/prefix``: the checkpoint root on an object store (every key ckptguard touches
    is under it)."""

    bucket: str
    prefix: str
    """No leading or trailing ``/``; never empty (a whole bucket is not a root: gc could not tell
    ours apart)."""

    @classmethod
    def parse(cls, url: str) -> StoreURL:
        if not isinstance(url, str) or not url.startswith("s3://"):
            raise ConfigError(
                f"object-store root {url!r}: expected s3://bucket/prefix (GCS and other "
                f"S3-compatible stores too, with ObjectStoreOptions(endpoint_url=...))"
            )
        bucket, _, prefix = url[len("s3://") :].partition("/")
        prefix = prefix.strip("/")
        if not _BUCKET.match(bucket):
            raise ConfigError(
                f"object-store root {url!r}: {bucket!r} is not a bucket name (lower-case letters, "
                "digits, '.', '-')"
            )
        if not prefix or any(part in ("", ".", "..") for part in prefix.split("/")):
            raise ConfigError(
                f"object-store root {url!r}: give a prefix such as s3://{bucket}/runs/run1 (not "
                f"the bucket's top, no empty, '.' or '..' parts): every object ckptguard creates "
                f"or deletes lives under it"
            )
        return cls(bucket, prefix)

    @staticmethod
    def lookalike(root: object) -> str | None:
        """Why ``root`` (a str or a path) reads like an object-store URL but is not one, or None:
        ``s3:/bkt/x``, ``S3://bkt/x`` or ``Path("s3://bkt/x")`` (which drops a slash) would
        otherwise be taken as a local directory named ``s3:`` and a job would checkpoint to its
        node's disk believing it wrote to the store."""
        try:
            text = os.fspath(root)  # type: ignore[call-overload]
        except TypeError:
            return None
        if not isinstance(text, str) or text[:3].lower() != "s3:" or text.startswith("s3://"):
            return None
        return (
            f"{text!r} reads like an object-store URL but is not one: write s3://bucket/prefix "
            f"(lower-case scheme, two slashes) as a str (a pathlib.Path of the URL drops a slash); "
            f"a local directory named like that is refused too: rename it"
        )

    def key(self, *parts: str) -> str:
        return "/".join((self.prefix, *parts))

    def relative(self, key: str) -> str | None:
        """``key`` relative to the prefix, or None when it lies outside it."""
        head = self.prefix + "/"
        return key[len(head) :] if key.startswith(head) else None

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


@dataclass(frozen=True, kw_only=True)
class ObjectStoreOptions:
    """How ckptguard talks to an S3-compatible store (boto3 underneath)."""

    endpoint_url: str | None = None
    """None: boto3's configuration (``AWS_ENDPOINT_URL`` if set, else AWS S3 in ``region``). GCS:
    ``https://storage.googleapis.com`` with HMAC keys; MinIO, Ceph, R2 and others: their S3
    endpoint."""
    region: str | None = None
    """The bucket's region (None: boto3's default chain, ``AWS_REGION`` / the profile)."""
    path_style: bool | None = None
    """Address the bucket in the path (``endpoint/bucket/key``), as most S3-compatible servers need;
    None: boto3's configuration decides (``addressing_style`` in ``~/.aws/config``; path style for
    an IP endpoint)."""
    part_bytes: int = 64 * MIB
    """Multipart part size; files up to this size go as one PUT. S3 allows 5 MiB .. 5 GiB."""
    max_inflight_bytes: int | None = 1024 * MIB
    """Bytes of parts held in memory at once by one process (uploads and downloads); None:
    ``threads`` parts."""
    threads: int = 8
    """Concurrent requests of one process."""
    attempts: int = 5
    """Tries of one request (botocore's standard retry mode: backoff with jitter), then the
    error."""
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    """A request whose answer stalls this long is retried (within ``attempts``), then fails."""
    consistency: Consistency = Consistency.CONDITIONAL
    """``Consistency.SINGLE_WRITER_UNSAFE`` only on a store without conditional writes (see its
    docstring)."""
    lease_ttl_s: float = 600.0
    """A write lease not renewed for this long may be taken over (renewed at every save)."""

    def __post_init__(self) -> None:
        if not isinstance(self.part_bytes, int) or not 5 * MIB <= self.part_bytes <= 5 * 1024 * MIB:
            raise ConfigError(
                f"ObjectStoreOptions(part_bytes={self.part_bytes!r}): S3 parts are 5 MiB .. 5 GiB"
            )
        if self.max_inflight_bytes is not None and (
            not isinstance(self.max_inflight_bytes, int)
            or self.max_inflight_bytes < self.part_bytes
        ):
            raise ConfigError(
                f"ObjectStoreOptions(max_inflight_bytes={self.max_inflight_bytes!r}): must hold "
                f"one part (part_bytes={self.part_bytes}); lower part_bytes or raise the budget"
            )
        for name in ("threads", "attempts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"ObjectStoreOptions({name}={value!r}): an int >= 1")
        for name in ("connect_timeout_s", "read_timeout_s", "lease_ttl_s"):
            if not isinstance(getattr(self, name), (int, float)) or getattr(self, name) <= 0:
                raise ConfigError(
                    f"ObjectStoreOptions({name}={getattr(self, name)!r}): seconds > 0"
                )
        if not isinstance(self.consistency, Consistency):
            raise ConfigError(
                f"ObjectStoreOptions(consistency={self.consistency!r}): a "
                f"Consistency (CONDITIONAL, or SINGLE_WRITER_UNSAFE by name on a "
                f"store without conditional writes)"
            )

    @property
    def workers(self) -> int:
        """Concurrent part transfers of one process: ``threads``, fewer when the byte budget holds
        fewer parts."""
        if self.max_inflight_bytes is None:
            return self.threads
        return max(1, min(self.threads, self.max_inflight_bytes // self.part_bytes))
