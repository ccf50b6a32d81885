"""The small JSON objects of an object-store root, typed, validated on read.

Layout under ``s3://bucket/prefix`` (the format ``objectstore`` 1)::

    ckptguard-root.json                 root record: this prefix is a ckptguard root (gc needs it)
    latest_checkpointed_iteration.txt   tracker: "N\\n", replaced by If-Match on its ETag, never backwards
    lease.json                          write lease: created by If-None-Match, renewed by If-Match
    step_00000100/manifest.json         COMMIT MARKER: created by If-None-Match last; names its attempt
    step_00000100/a-<nonce>/owner.json  attempt owner record, written before the attempt's first object
    step_00000100/a-<nonce>/state/...   the step's files (plain DCP under state/), as in a local step

A writer puts its files under an attempt of its own, so two writers of one step never overwrite
each other's objects; the marker's conditional create picks the one attempt that is the step.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ..._types import JsonObject
from ...errors import CheckpointCorruptError

ROOT_RECORD = "ckptguard-root.json"
LEASE = "lease.json"
OWNER = "owner.json"
ROOT_KIND = "ckptguard-objectstore-root"
MARKER_KIND = "ckptguard-objectstore-step"
ATTEMPT_PREFIX = "a-"
FORMAT = 1


def _load(data: bytes, where: str) -> JsonObject:
    try:
        value = json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointCorruptError(f"{where} is not JSON ({exc}); it was not written by ckptguard") from exc
    if not isinstance(value, dict):
        raise CheckpointCorruptError(f"{where} holds {type(value).__name__}, not a JSON object")
    return value


def _dump(value: JsonObject) -> bytes:
    return (json.dumps(value, indent=1, sort_keys=True) + "\n").encode()


def _need(data: JsonObject, name: str, kind: type | tuple[type, ...], where: str) -> Any:
    value = data.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise CheckpointCorruptError(f"{where}: field {name!r} is {value!r}; the record is damaged or foreign")
    return value


@dataclass(frozen=True)
class Writer:
    """Who wrote a record: host, process, and (for a marker) the lease it held."""

    host: str
    pid: int
    lease: str | None = None

    @classmethod
    def here(cls, lease: str | None = None) -> Writer:
        return cls(socket.gethostname(), os.getpid(), lease)

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
    """The root's run-contract phases at commit time (``contract/phase_NNNN.json`` -> record): the chain
    a restore continues travels with the step."""
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
                f"{where}: kind {raw.get('kind')!r} format {raw.get('format')!r}, expected {MARKER_KIND!r} format "
                f"{FORMAT}: not a ckptguard marker, or written by a newer ckptguard (upgrade it)")
        objects = _need(raw, "objects", dict, where)
        writer = _need(raw, "writer", dict, where)
        attempt = _need(raw, "attempt", str, where)
        if not attempt.startswith(ATTEMPT_PREFIX) or "/" in attempt:
            raise CheckpointCorruptError(f"{where}: attempt {attempt!r} is not an attempt name of ckptguard")
        try:
            parsed = {
                _relative(name, where): StoredObject(int(o["size"]), str(o["xxh3"]), str(o["etag"]))
                for name, o in objects.items()
            }
            who = Writer(str(writer["host"]), int(writer["pid"]), writer.get("lease"))
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointCorruptError(f"{where}: an object or writer entry is damaged ({exc!r})") from exc
        return cls(step=_need(raw, "step", int, where), attempt=attempt, writer=who, objects=parsed,
                   manifest=_need(raw, "manifest", dict, where), phases=_phases(raw.get("phases") or {}, where),
                   created_unix=float(_need(raw, "created_unix", (int, float), where)))


def _phases(value: Any, where: str) -> dict[str, JsonObject]:
    ok = isinstance(value, dict) and all(
        isinstance(k, str) and re.fullmatch(r"phase_\d{4}\.json", k) and isinstance(v, dict) for k, v in value.items())
    if not ok:
        raise CheckpointCorruptError(f"{where}: field 'phases' is not a map of contract phase files")
    return dict(value)


def _relative(name: str, where: str) -> str:
    parts = name.split("/")
    if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise CheckpointCorruptError(f"{where}: object name {name!r} leaves its step; the marker is not ckptguard's")
    return name


@dataclass(frozen=True)
class RootRecord:
    """``ckptguard-root.json``: written by conditional create before the tracker; gc works only under it."""

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
            raise CheckpointCorruptError(f"{where}: kind {raw.get('kind')!r}, not {ROOT_KIND!r}; not a ckptguard root")
        writer = _need(raw, "writer", dict, where)
        return cls(float(_need(raw, "created_unix", (int, float), where)),
                   Writer(str(writer.get("host")), int(writer.get("pid") or 0)),
                   str(raw.get("consistency")), int(_need(raw, "format", int, where)))


@dataclass(frozen=True)
class Owner:
    """``<step>/<attempt>/owner.json``: this attempt's objects are ckptguard's, gc may remove them."""

    step: int
    attempt: str
    writer: Writer
    created_unix: float

    def to_bytes(self) -> bytes:
        return _dump(asdict(self))

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Owner:
        raw = _load(data, where)
        writer = _need(raw, "writer", dict, where)
        return cls(_need(raw, "step", int, where), _need(raw, "attempt", str, where),
                   Writer(str(writer.get("host")), int(writer.get("pid") or 0)),
                   float(_need(raw, "created_unix", (int, float), where)))


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
        writer = _need(raw, "writer", dict, where)
        return cls(_need(raw, "holder", str, where), Writer(str(writer.get("host")), int(writer.get("pid") or 0)),
                   float(_need(raw, "expires_unix", (int, float), where)),
                   float(_need(raw, "renewed_unix", (int, float), where)))


def parse_tracker(data: bytes, where: str) -> int:
    text = data.decode(errors="replace").strip()
    if not text.isdigit():
        raise CheckpointCorruptError(f"{where} holds {text[:40]!r}, not a step number; it was not written by "
                                     "ckptguard: inspect it, then fix it by hand")
    return int(text)
