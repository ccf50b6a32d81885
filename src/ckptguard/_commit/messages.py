"""The messages of the commit protocol between ranks, and how a rank's failure travels.

Every message is a frozen ``Wire`` dataclass; a failure is a ``WriteFailure`` record (errno, rank,
path, offset), the first of which every rank raises together (``raise_if_failed``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from .._agree import Wire
from .._context import Context
from .._records.entries import FileEntry
from .._types import JsonObject
from ..errors import (
    CheckpointWriteError,
    WriteFailure,
)


def read_failure(value: JsonObject | None) -> WriteFailure | None:
    return None if value is None else WriteFailure.from_json(value)


def read_failures(values: list[JsonObject]) -> list[WriteFailure]:
    return [WriteFailure.from_json(v) for v in values]


def read_files(values: list[JsonObject]) -> list[FileEntry]:
    return [FileEntry.from_json(v) for v in values]


@dataclass(frozen=True)
class ChunkDigests(Wire):
    """One rank's digest of every tensor chunk it holds, keyed ``key@offset``."""

    chunks: dict[str, str]
    kinds: dict[str, str] = field(default_factory=dict)  # item -> ItemKind value


@dataclass(frozen=True)
class ChunkVerdict(Wire):
    """Chunks held by several ranks with different bytes: ``[chunk, [[ranks alike], ...]]``, and
    items whose kind differs across ranks: ``[item, {kind: [ranks]}]``."""

    bad: list[list[Any]]
    kinds: list[list[Any]] = field(default_factory=list)


@dataclass(frozen=True)
class PrepareRequest(Wire):
    step: int
    root: str = ""
    node: str = ""


@dataclass(frozen=True)
class Prepared(Wire):
    """Rank 0's reply to prepare: the temp directory and the contract phase in force, or its
    failure."""

    tmp: str = ""
    chain_id: str = ""
    phase: int = 0
    contract_hash: str = ""
    failure: WriteFailure | None = None
    nodes: list[list[int]] = field(
        default_factory=list
    )  # node-local roots: each node's ranks; empty: shared
    READERS = {"failure": read_failure}


@dataclass(frozen=True)
class RankReport(Wire):
    """What one rank wrote (files with sizes and checksums, per-item digests), or its first
    error."""

    host: str
    files: list[FileEntry] = field(
        default_factory=list
    )  # rank None: the publisher fills in the sender
    digests: dict[str, str] = field(default_factory=dict)
    ep_rank: int | None = None
    failure: WriteFailure | None = None
    layout_free: dict[str, list[str]] = field(
        default_factory=dict
    )  # item -> partials (see digest.layout_free)
    reshard: dict[str, dict[str, Any]] = field(
        default_factory=dict
    )  # item -> declared reshard rule
    READERS = {"failure": read_failure, "files": read_files}


@dataclass(frozen=True)
class Outcome(Wire):
    """Rank 0's publish outcome: no failures means committed."""

    failures: list[WriteFailure] = field(default_factory=list)
    phase: str = "write"
    consequence: str = ""  # where the resume target stands after the failure, when not NOT_MOVED
    READERS = {"failures": read_failures}


@dataclass(frozen=True)
class PlaceView(Wire):
    """Whether this rank finds rank 0's temp directory at its own root: the same disk, or
    another."""

    sees: bool


@dataclass(frozen=True)
class NodeReport(Wire):
    """One node's publishing rank's outcome of a per-node phase (others send an empty one)."""

    failure: WriteFailure | None = None
    tracker: int | None = (
        # the publishing rank's tracker on its node's root (at prepare; after the tracker round)
        None
    )
    tracker_error: str = ""  # after the tracker round: why the tracker could not be read back
    READERS = {"failure": read_failure}


@dataclass(frozen=True)
class NodesSeen(Wire):
    """Rank 0's verdict on the node placement: failures, or the newest tracker of any node."""

    failures: list[WriteFailure] = field(default_factory=list)
    newest: int = 0
    READERS = {"failures": read_failures}


@dataclass(frozen=True)
class NodePlan(Wire):
    """Rank 0's verdict on the write: the failures, or the global manifest and the copies to
    make."""

    failures: list[WriteFailure] = field(default_factory=list)
    manifest: dict[str, Any] = field(default_factory=dict)
    copies: list[dict[str, Any]] = field(default_factory=list)  # {path, size, xxh3, src, dsts}
    READERS = {"failures": read_failures}


def failure_from(exc: BaseException, *, rank: int, phase: str) -> WriteFailure:
    """The first error of this rank with errno and path, digging through DCP's wrapper."""
    collateral = False
    if isinstance(exc, CheckpointException):
        mine = exc.failures.get(rank)
        if mine is None:
            collateral = True
        else:
            exc = mine[0] if isinstance(mine, tuple) else mine  # DCP wraps (exc, traceback)
    root = exc
    while root.__cause__ is not None and not isinstance(root, OSError):
        root = root.__cause__
    oserr = root if isinstance(root, OSError) else None
    return WriteFailure(
        rank=rank,
        phase=phase + (" (another rank failed first)" if collateral else ""),
        exc_type=type(root).__name__,
        message=str(root)[:2000],
        errno=oserr.errno if oserr else None,
        path=str(oserr.filename) if oserr and oserr.filename else None,
        offset=getattr(root, "offset", None),
        requested_bytes=getattr(root, "requested_bytes", None),
        returned_bytes=getattr(root, "returned_bytes", None),
        time_ns=time.time_ns() + (10**18 if collateral else 0),
    )


NOT_MOVED = (
    "the tracker was not moved, so the previous committed step stays the resume target. Fix the "
    "cause (disk space, permissions, storage health) and save again."
)


def raise_if_failed(
    ctx: Context,
    failures: list[WriteFailure],
    *,
    step: int,
    phase: str,
    consequence: str = NOT_MOVED,
) -> None:
    if not failures:
        return
    first = min(
        failures, key=WriteFailure.cause_order
    )  # an OS error before a serializer's symptom of it
    raise CheckpointWriteError(
        f"save of step {step} under {ctx.root} failed at {phase}; first error: {first.describe()}. "
        f"All {ctx.world} ranks raise this together; {consequence}",
        step=step,
        failures=failures,
    )
