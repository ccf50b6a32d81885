"""The memory record format: one JSON object per line, and its reader.

Contract: every line written by ``PhaseRecorder`` or ``mem watch`` is a JSON object with
``v`` (format version, 1), ``kind`` (a ``RecordKind`` value), ``mono_ns`` (CLOCK_MONOTONIC,
comparable across processes of one node), ``wall_time``, ``node``, ``pid`` and, for phase
records, ``rank``. Byte figures are ints; a figure that could not be read is null and named in
the enclosing object's ``not_obtained`` map.

Kinds:
    phase_start / phase_end   a phase boundary: host, ray, process and gpu figures; the end
                              record adds ``duration_s`` and the in-phase ``peak``
    phase_failure             the phase raised: error type, message, failing call, requested
                              bytes of a CUDA OOM, last completed phase, load-phase peak
    sample                    one ``mem watch`` tick: host, ray and every process in the tree
    watch_start / watch_end   the watched command, and its exit status (-9: SIGKILL)
    host_cache_release        the host staging pool of async saves was unmapped: ``released_bytes``,
                              ``how`` (``release()`` or the idle timer), ``step`` of the save
                              phase it followed, the process RSS before and after (``rss_drop``),
                              host figures

``read_records`` tolerates a truncated last line (the writer was killed mid-line), and refuses
any other malformed line, naming file and line.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from enum import Enum
from pathlib import Path
from typing import Any

from ..errors import RecordFormatError

__all__ = ["FORMAT_VERSION", "RecordFormatError", "RecordKind", "read_records"]

FORMAT_VERSION = 1


class RecordKind(Enum):
    PHASE_START = "phase_start"
    PHASE_END = "phase_end"
    PHASE_FAILURE = "phase_failure"
    SAMPLE = "sample"
    WATCH_START = "watch_start"
    WATCH_END = "watch_end"
    HOST_CACHE_RELEASE = "host_cache_release"


def read_records(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """All records of the given files, sorted by ``mono_ns`` (stable for equal times)."""
    out: list[dict[str, Any]] = []
    for path in paths:
        try:
            lines = Path(path).read_text(encoding="utf-8").split("\n")
        except FileNotFoundError:
            raise RecordFormatError(f"records file {path} does not exist") from None
        last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                if i == last:
                    # The writer died mid-line (SIGKILL by the OOM killer): the rest is still valid.
                    continue
                raise RecordFormatError(
                    f"{path}:{i + 1}: not a JSON record ({exc.msg}); fix or cut that line"
                ) from None
            if not isinstance(rec, dict) or "kind" not in rec or "mono_ns" not in rec:
                raise RecordFormatError(f"{path}:{i + 1}: a record needs 'kind' and 'mono_ns'")
            try:
                RecordKind(rec["kind"])
            except ValueError:
                raise RecordFormatError(
                    f"{path}:{i + 1}: unknown record kind {rec['kind']!r}"
                ) from None
            if rec.get("v", FORMAT_VERSION) > FORMAT_VERSION:
                raise RecordFormatError(
                    f"{path}:{i + 1}: record format v{rec['v']} is newer than this ckptguard "
                    f"reads (v{FORMAT_VERSION})"
                )
            out.append(rec)
    out.sort(key=lambda r: r["mono_ns"])
    return out


def of_kind(records: Iterable[dict[str, Any]], *kinds: RecordKind) -> list[dict[str, Any]]:
    """The records whose kind is one of ``kinds``, in order."""
    wanted = {k.value for k in kinds}
    return [r for r in records if r.get("kind") in wanted]
