"""One bucket prefix over boto3: small reads, conditional writes, listings, deletes, every error
named.

Why boto3: it is the S3 client AWS maintains, and it is the one that carries everything the commit
needs: ``IfNoneMatch``/``IfMatch`` on PutObject (conditional create and compare-and-swap on the
ETag), multipart uploads with per-part checksums the store verifies (``ChecksumCRC32``), ranged GETs
with ``IfMatch``, bounded retries with backoff (botocore's standard mode) and per-request timeouts.

Every failure becomes ``ObjectStoreError`` naming the bucket, the key, the step (when there is one),
what was being done and what to do. A conditional write the store refused (HTTP 412) is not an
error here: it returns None and the caller decides (someone else created or changed the object).
"""

from __future__ import annotations

import datetime as _dt
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import boto3
import botocore.config
import botocore.exceptions

from ...errors import ObjectStoreError
from ._options import ObjectStoreOptions, StoreURL

SMALL_OBJECT_BYTES = 16 << 20
"""The most a record read (marker, tracker, lease, owner) accepts; ckptguard writes kilobytes."""
PROOF_LOG_BYTES = 1 << 30
"""The most a rank's proof log read accepts: about 390 B a recorded step, 2.7 million steps (16 MiB
was 43,000)."""


@dataclass(frozen=True)
class Small:
    """A small object read whole, with the ETag a conditional write on it names."""

    data: bytes
    etag: str


@dataclass(frozen=True)
class Listed:
    key: str
    size: int
    modified_unix: float


@dataclass(frozen=True)
class Upload:
    """A multipart upload in progress (or abandoned) under the prefix."""

    key: str
    upload_id: str
    initiated_unix: float


def _no_bucket(exc: BaseException) -> bool:
    return (
        isinstance(exc, botocore.exceptions.ClientError)
        and exc.response.get("Error", {}).get("Code") == "NoSuchBucket"
    )


def _hint(code: str, status: int | None, endpoint: str, reading: bool = False) -> str:
    """What to do; ``reading``: a read, listing or download (no step was being saved)."""
    if code in ("NoSuchBucket",):
        return "create the bucket, or fix the bucket name in the URL"
    if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch") or status == 403:
        return (
            "check the credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE) "
            "and the bucket policy"
        )
    if code in ("BadDigest", "InvalidDigest", "XAmzContentChecksumMismatch", "InvalidChecksum"):
        return (
            "the store saw other bytes than were sent (corrupted in transit or on the local "
            "disk); save again"
        )
    if code in ("EntityTooSmall", "InvalidPart", "InvalidPartOrder", "NoSuchUpload"):
        return "the multipart upload is incomplete or was aborted (by gc?); save again"
    if status is None and reading:
        return (
            f"the store at {endpoint} did not answer after the bounded retries; check that "
            f"it is reachable and healthy (ObjectStoreOptions.endpoint_url, "
            f"AWS_ENDPOINT_URL), then run the same again"
        )
    if status is None:
        return (
            f"the store at {endpoint} did not answer after the bounded retries; check that "
            f"it is reachable and healthy, then save again (nothing of this step is "
            f"visible: its marker was not written)"
        )
    if status >= 500 or code in ("SlowDown", "RequestTimeout"):
        return (
            "the store is failing or throttling; retry later, or lower ObjectStoreOptions.threads"
        )
    if reading:
        return "see the store's message; nothing was changed on the store by this read"
    return "see the store's message; nothing of this step is visible until its marker is written"


_READS = ("reading", "looking up", "listing", "downloading")


class Bucket:
    """The requests the object-store protocol makes, under one ``StoreURL``."""

    def __init__(self, url: StoreURL, options: ObjectStoreOptions) -> None:
        self.url, self.options = url, options
        config = botocore.config.Config(
            retries={"max_attempts": options.attempts, "mode": "standard"},
            connect_timeout=options.connect_timeout_s,
            read_timeout=options.read_timeout_s,
            max_pool_connections=options.threads + 4,
            s3={"addressing_style": "path" if options.path_style else "virtual"}
            if options.path_style is not None
            else None,
            # checksums are sent where ckptguard computes them (every part and PUT of data), and
            # records carry none: some S3-compatible stores reject the newer default trailers.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        self.client: Any = _client(options, config)
        self.endpoint = str(self.client.meta.endpoint_url)

    # ------------------------------------------------------------ errors

    def error(
        self, exc: BaseException, key: str, doing: str, step: int | None = None
    ) -> ObjectStoreError:
        status, code, text = None, type(exc).__name__, str(exc)
        if isinstance(exc, botocore.exceptions.ClientError):
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = exc.response.get("Error", {}).get("Code", code)
            text = exc.response.get("Error", {}).get("Message", text)
        where = f"s3://{self.url.bucket}/{key}" + (f" (step {step})" if step is not None else "")
        return ObjectStoreError(
            f"{doing} {where} failed: {code}{f' (HTTP {status})' if status else ''}: {text}; "
            f"{_hint(code, status, self.endpoint, doing.startswith(_READS))}",
            bucket=self.url.bucket,
            key=key,
            step=step,
            status=status,
        )

    @staticmethod
    def status(exc: BaseException) -> int | None:
        if isinstance(exc, botocore.exceptions.ClientError):
            value = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return int(value) if value is not None else None
        return None

    # ------------------------------------------------------------ records

    def get(
        self,
        key: str,
        *,
        step: int | None = None,
        what: str = "object",
        limit: int = SMALL_OBJECT_BYTES,
    ) -> Small | None:
        """The whole object (at most ``limit`` bytes), or None when there is none."""
        try:
            got = self.client.get_object(Bucket=self.url.bucket, Key=key)
            size = int(got.get("ContentLength") or 0)
            if size > limit:
                got["Body"].close()
                raise ObjectStoreError(
                    f"s3://{self.url.bucket}/{key} ({what}) has {size} bytes, more "
                    f"than the {limit} a ckptguard record holds: it was not "
                    f"written by ckptguard; inspect it",
                    bucket=self.url.bucket,
                    key=key,
                    step=step,
                )
            return Small(got["Body"].read(), str(got["ETag"]))
        except ObjectStoreError:
            raise
        except Exception as exc:
            if self.status(exc) == 404 and not _no_bucket(
                exc
            ):  # a missing bucket is an error, never "absent"
                return None
            raise self.error(exc, key, f"reading the {what}", step) from exc

    def head(
        self, key: str, *, step: int | None = None, what: str = "object"
    ) -> tuple[int, str] | None:
        """(size, ETag) of ``key``, or None when there is none."""
        try:
            out = self.client.head_object(Bucket=self.url.bucket, Key=key)
        except Exception as exc:
            if self.status(exc) == 404:
                return None
            raise self.error(exc, key, f"looking up the {what}", step) from exc
        return int(out["ContentLength"]), str(out["ETag"])

    def create(
        self,
        key: str,
        data: bytes,
        *,
        step: int | None = None,
        what: str = "object",
        conditional: bool = True,
    ) -> str | None:
        """Create ``key`` only if absent (If-None-Match: *): its ETag, or None if it already
        exists."""
        return self._put(
            key, data, {"IfNoneMatch": "*"} if conditional else {}, step, f"creating the {what}"
        )

    def replace(
        self,
        key: str,
        data: bytes,
        etag: str,
        *,
        step: int | None = None,
        what: str = "object",
        conditional: bool = True,
    ) -> str | None:
        """Replace ``key`` only if its ETag is still ``etag`` (If-Match): the new ETag, or None if
        it changed."""
        return self._put(
            key, data, {"IfMatch": etag} if conditional else {}, step, f"replacing the {what}"
        )

    def _put(
        self, key: str, data: bytes, cond: dict[str, str], step: int | None, doing: str
    ) -> str | None:
        try:
            out = self.client.put_object(Bucket=self.url.bucket, Key=key, Body=data, **cond)
            return str(out["ETag"])
        except Exception as exc:
            # 412: the condition failed. 409 (ConditionalRequestConflict): a concurrent conditional
            # write to the same key was in flight; S3 asks to retry, and the re-read decides.
            if cond and self.status(exc) in (412, 409):
                return None
            raise self.error(exc, key, doing, step) from exc

    def delete(self, key: str, *, step: int | None = None, what: str = "object") -> None:
        try:
            self.client.delete_object(Bucket=self.url.bucket, Key=key)
        except Exception as exc:
            if self.status(exc) != 404:
                raise self.error(exc, key, f"deleting the {what}", step) from exc

    def delete_many(self, keys: list[str], *, step: int | None = None) -> None:
        for start in range(0, len(keys), 1000):
            chunk = keys[start : start + 1000]
            try:
                out = self.client.delete_objects(
                    Bucket=self.url.bucket,
                    Delete={"Objects": [{"Key": k} for k in chunk], "Quiet": True},
                )
            except Exception as exc:
                raise self.error(
                    exc, chunk[0], f"deleting {len(chunk)} objects from", step
                ) from exc
            for err in out.get("Errors") or []:
                if err.get("Code") != "NoSuchKey":
                    raise ObjectStoreError(
                        f"deleting s3://{self.url.bucket}/{err.get('Key')} (step {step}) failed: "
                        f"{err.get('Code')}: {err.get('Message')}; run `ckptguard gc` again later",
                        bucket=self.url.bucket,
                        key=str(err.get("Key")),
                        step=step,
                    )

    # ------------------------------------------------------------ listings (gc, rotation, list;
    # never resolve)

    def listing(self, rel: str = "") -> Iterator[Listed]:
        prefix = self.url.key(rel) if rel else self.url.prefix + "/"
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.url.bucket, Prefix=prefix
            ):
                for obj in page.get("Contents") or []:
                    yield Listed(str(obj["Key"]), int(obj["Size"]), _unix(obj["LastModified"]))
        except Exception as exc:
            raise self.error(exc, prefix, "listing") from exc

    def children(self, rel: str = "") -> list[str]:
        """The names one level under ``rel`` (``step_00000100``, ...), from a delimited listing."""
        prefix = self.url.key(rel) + "/" if rel else self.url.prefix + "/"
        names: list[str] = []
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.url.bucket, Prefix=prefix, Delimiter="/"
            )
            for page in pages:
                names += [
                    str(p["Prefix"])[len(prefix) :].rstrip("/")
                    for p in page.get("CommonPrefixes") or []
                ]
        except Exception as exc:
            raise self.error(exc, prefix, "listing") from exc
        return names

    def uploads(self) -> list[Upload]:
        found: list[Upload] = []
        try:
            pages = self.client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.url.bucket, Prefix=self.url.prefix + "/"
            )
            for page in pages:
                found += [
                    Upload(str(u["Key"]), str(u["UploadId"]), _unix(u["Initiated"]))
                    for u in page.get("Uploads") or []
                ]
        except Exception as exc:
            raise self.error(
                exc, self.url.prefix + "/", "listing the multipart uploads under"
            ) from exc
        return found

    def abort(self, upload: Upload, *, step: int | None = None) -> None:
        try:
            self.client.abort_multipart_upload(
                Bucket=self.url.bucket, Key=upload.key, UploadId=upload.upload_id
            )
        except Exception as exc:
            if self.status(exc) != 404:
                raise self.error(exc, upload.key, "aborting the multipart upload of", step) from exc


_clients: dict[tuple[Any, ...], Any] = {}
_clients_lock = threading.Lock()


def _client(options: ObjectStoreOptions, config: botocore.config.Config) -> Any:
    """One boto3 client per store and transfer settings in a process: creating one reads botocore's
    service model (tens of ms of CPU), and a client is safe to share between threads."""
    key = (
        options.endpoint_url,
        options.region,
        options.path_style,
        options.attempts,
        options.connect_timeout_s,
        options.read_timeout_s,
        options.threads,
        os.environ.get("AWS_ENDPOINT_URL"),
        os.environ.get("AWS_PROFILE"),
        os.environ.get("AWS_ACCESS_KEY_ID"),
    )
    with _clients_lock:
        if key not in _clients:
            _clients[key] = boto3.session.Session().client(
                "s3", endpoint_url=options.endpoint_url, region_name=options.region, config=config
            )
        return _clients[key]


def _unix(value: Any) -> float:
    if isinstance(value, _dt.datetime):
        return value.timestamp()
    return float(value)
