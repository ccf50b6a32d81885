"""The small JSON objects of an object-store root, typed, validated on read.

Layout under ``s3://bucket/prefix`` (the format ``objectstore`` 1)::

    ckptguard-root.json                 root record: this prefix is a ckptguard root (gc needs it)
    latest_checkpointed_iteration.txt   tracker: "N\\n", replaced by If-Match (ETag), forward only
    lease.json                          write lease: created by If-None-Match, renewed by If-Match
    step_00000100/manifest.json         COMMIT MARKER: made last by If-None-Match; names its attempt
    step_00000100/a-<nonce>/owner.json  attempt owner record, written before its first object
    step_00000100/a-<nonce>/state/...   the step's files: plain DCP under state/, as in a local step

A writer puts its files under an attempt of its own, so two writers of one step never overwrite
each other's objects; the marker's conditional create picks the one attempt that is the step.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ..._disk.layout import PROOF_DIR, parse_json
from ..._disk.tempfiles import proc_start, this_host
from ..._types import JsonObject
from ...errors import CheckpointCorruptError

ROOT_RECORD = "ckptguard-root.json"
LEASE = "lease.json"
OWNER = "owner.json"
ROOT_KIND = "ckptguard-objectstore-root"
MARKER_KIND = "ckptguard-objectstore-step"
ATTEMPT_PREFIX = "a-"
FORMAT = 1
MAX_OBJECT_BYTES = 5 << 40
"""The largest object S3 stores (5 TiB): a marker declaring more is not ckptguard's."""
_XXH3 = re.compile(r"[0-9a-f]{1,64}\Z")


def _load(data: bytes, where: str) -> JsonObject:
    # parse_json bounds the nesting: a crafted record ends in CheckpointCorruptError, never
    # RecursionError.
    value = parse_json(data, where=where)
    if not isinstance(value, dict):
        raise CheckpointCorruptError(f"{where} holds {type(value).__name__}, not a JSON object")
    return value


def _dump(value: JsonObject) -> bytes:
    return (json.dumps(value, indent=1, sort_keys=True) + "\n").encode()


def _need(data: JsonObject, name: str, kind: type | tuple[type, ...], where: str) -> Any:
    value = data.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise CheckpointCorruptError(
            f"{where}: field {name!r} is {repr(value)[:200]}; the record is damaged or foreign"
        )
    return value


def _seconds(data: JsonObject, name: str, where: str) -> float:
    """A time field (unix seconds): a number a float holds (a crafted 10**400 is named, not an
    OverflowError)."""
    value = _need(data, name, (int, float), where)
    try:
        return float(value)
    except OverflowError:
        raise CheckpointCorruptError(
            f"{where}: field {name!r} is not a time in seconds; the record is damaged or foreign"
        ) from None


@dataclass(frozen=True)
class Writer:
    """Who wrote a record: host, process, and (for a marker) the lease it held."""

    host: str
    pid: int
    lease: str | None = None
    # The process's start time: tells it from a later process given its PID (absent in older
    # records).
    start: str | None = None

    @classmethod
    def here(cls, lease: str | None = None) -> Writer:
        return cls(this_host(), os.getpid(), lease, proc_start(os.getpid()))

    @classmethod
    def read(cls, raw: JsonObject, where: str) -> Writer:
        """The ``writer`` field of a record, each part checked (a crafted one is named, never a bare
        ValueError)."""
        writer = _need(raw, "writer", dict, where)
        host, pid, lease = writer.get("host"), writer.get("pid"), writer.get("lease")
        start = writer.get("start")
        if (
            not isinstance(host, str)
            or not isinstance(pid, int)
            or isinstance(pid, bool)
            or not (lease is None or isinstance(lease, str))
            or not (start is None or (isinstance(start, str) and len(start) <= 32))
        ):
            raise CheckpointCorruptError(
                f"{where}: field 'writer' is {str(writer)[:200]}; the record is damaged or foreign"
            )
        return cls(host, pid, lease, start)

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}" + (f", lease {self.lease}" if self.lease else "")


@dataclass(frozen=True)
class StoredObject:
    """One file of a committed step as the store holds it."""

    size: int
    xxh3: str
    etag: str


@dataclass(frozen=True)
class Marker:
    """``<step>/manifest.json`` on the store: the commit marker. ``manifest`` is the step's
    ckptguard manifest (what ``manifest.json`` holds in a local step directory)."""

    step: int
    attempt: str
    writer: Writer
    objects: dict[str, StoredObject]
    manifest: dict[str, Any]
    phases: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The root's run-contract phases at commit time (``contract/phase_NNNN.json`` -> record): the
    chain a restore continues travels with the step."""
    created_unix: float = field(default_factory=time.time)
    format: int = FORMAT

    def to_bytes(self) -> bytes:
        data = asdict(self)
        data["kind"] = MARKER_KIND
        return _dump(data)

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Marker:
        raw = _load(data, where)
        if raw.get("kind") != MARKER_KIND or raw.get("format") != FORMAT:
            raise CheckpointCorruptError(
                f"{where}: kind {raw.get('kind')!r} format {raw.get('format')!r}, expected "
                f"{MARKER_KIND!r} format {FORMAT}: not a ckptguard marker, or written by a "
                f"newer ckptguard (upgrade it)"
            )
        objects = _need(raw, "objects", dict, where)
        who = Writer.read(raw, where)
        attempt = _need(raw, "attempt", str, where)
        if not attempt.startswith(ATTEMPT_PREFIX) or "/" in attempt:
            raise CheckpointCorruptError(
                f"{where}: attempt {attempt!r} is not an attempt name of ckptguard"
            )
        parsed = {_relative(name, where): _stored(name, o, where) for name, o in objects.items()}
        return cls(
            step=_need(raw, "step", int, where),
            attempt=attempt,
            writer=who,
            objects=parsed,
            manifest=_need(raw, "manifest", dict, where),
            phases=_phases(raw.get("phases") or {}, where),
            created_unix=_seconds(raw, "created_unix", where),
        )


def _stored(name: str, entry: Any, where: str) -> StoredObject:
    """One object entry of a marker, every field checked before anything is sized or requested from
    it."""
    if not isinstance(entry, dict):
        raise CheckpointCorruptError(
            f"{where}: the entry of object {name!r} is {type(entry).__name__}, not a map"
        )
    size, xxh3, etag = entry.get("size"), entry.get("xxh3"), entry.get("etag")
    if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_OBJECT_BYTES:
        raise CheckpointCorruptError(
            f"{where}: object {name!r} declares size {size!r}; a size is an int from 0 to "
            f"{MAX_OBJECT_BYTES} (5 TiB, the largest object S3 stores): the marker is damaged or "
            f"crafted, restore another step"
        )
    if not isinstance(xxh3, str) or not _XXH3.match(xxh3) or not isinstance(etag, str) or not etag:
        raise CheckpointCorruptError(
            f"{where}: object {name!r} has xxh3 {xxh3!r} and ETag {etag!r} (hex digits and a "
            f"non-empty ETag expected): the marker is damaged or crafted, restore another step"
        )
    return StoredObject(size, xxh3, etag)


def _phases(value: Any, where: str) -> dict[str, JsonObject]:
    ok = isinstance(value, dict) and all(
        isinstance(k, str) and re.fullmatch(r"phase_\d{4}\.json", k) and isinstance(v, dict)
        for k, v in value.items()
    )
    if not ok:
        raise CheckpointCorruptError(
            f"{where}: field 'phases' is not a map of contract phase files"
        )
    return dict(value)


def _relative(name: str, where: str) -> str:
    parts = name.split("/")
    if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise CheckpointCorruptError(
            f"{where}: object name {name!r} leaves its step; the marker is not ckptguard's"
        )
    return name


@dataclass(frozen=True)
class RootRecord:
    """``ckptguard-root.json``: written by conditional create before the tracker; gc works only
    under it."""

    created_unix: float
    writer: Writer
    consistency: str
    format: int = FORMAT

    def to_bytes(self) -> bytes:
        return _dump({**asdict(self), "kind": ROOT_KIND})

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> RootRecord:
        raw = _load(data, where)
        if raw.get("kind") != ROOT_KIND:
            raise CheckpointCorruptError(
                f"{where}: kind {raw.get('kind')!r}, not {ROOT_KIND!r}; not a ckptguard root"
            )
        return cls(
            _seconds(raw, "created_unix", where),
            Writer.read(raw, where),
            str(raw.get("consistency")),
            int(_need(raw, "format", int, where)),
        )


@dataclass(frozen=True)
class Owner:
    """``<step>/<attempt>/owner.json``: this attempt's objects are ckptguard's, gc may remove
    them."""

    step: int
    attempt: str
    writer: Writer
    created_unix: float

    def to_bytes(self) -> bytes:
        return _dump(asdict(self))

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Owner:
        raw = _load(data, where)
        return cls(
            _need(raw, "step", int, where),
            _need(raw, "attempt", str, where),
            Writer.read(raw, where),
            _seconds(raw, "created_unix", where),
        )


@dataclass(frozen=True)
class Lease:
    """``lease.json``: who may write this root until ``expires_unix`` (renewed by If-Match)."""

    holder: str
    writer: Writer
    expires_unix: float
    renewed_unix: float

    def to_bytes(self) -> bytes:
        return _dump(asdict(self))

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Lease:
        raw = _load(data, where)
        return cls(
            _need(raw, "holder", str, where),
            Writer.read(raw, where),
            _seconds(raw, "expires_unix", where),
            _seconds(raw, "renewed_unix", where),
        )


def parse_tracker(data: bytes, where: str) -> int:
    text = data.decode(errors="replace").strip()
    if not re.fullmatch(r"[0-9]{1,18}", text):  # str.isdigit() takes "\u00b2", which int() refuses
        raise CheckpointCorruptError(
            f"{where} holds {text[:40]!r}, not a step number; it was not written by "
            "ckptguard: inspect it, then fix it by hand"
        )
    return int(text)


def is_proof(rel: str) -> bool:
    """``proof/rank_NNNNN.jsonl``: one rank's copy of its proof log (gc and rotation leave it
    alone)."""
    parts = rel.split("/")
    return (
        len(parts) == 2
        and parts[0] == PROOF_DIR
        and parts[1].startswith("rank_")
        and parts[1].endswith(".jsonl")
    )
