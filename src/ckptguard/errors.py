"""Every error ckptguard raises.

One root, and leaves that also subclass the builtin a caller would naturally catch::

    CheckpointError
    +-- ConfigError (ValueError)                 a bad argument or config field
    |   +-- RunStepError                         a single-role reader met a RunCheckpoint step
    +-- CheckpointNotFoundError (FileNotFoundError)
    |   +-- CheckpointIncompleteError            files or the commit marker are missing
    +-- CheckpointCorruptError (ValueError)      a file is present but unreadable or wrong
    |   +-- UnsafeCheckpointError                content that would run code when unpickled
    +-- ResumeError (RuntimeError)               resolve refuses to pick a step
    |   +-- RankDisagreementError                ranks resolved different steps or files
    +-- StateMismatchError (ValueError)          keys or restored values differ from the checkpoint
    |   +-- ReplicatedDivergenceError            a "replicated" tensor differs across ranks
    +-- TopologyMismatchError (ValueError)       world size or parallel layout changed
    +-- VersionMismatchError (RuntimeError)      written by a newer torch or ckptguard
    +-- ContractMismatchError (ValueError)       the run contract changed without a new phase
    |   +-- ChainMismatchError                   a checkpoint of another run chain, not adopted
    +-- LeaseHeldError (RuntimeError)            another live run writes this root
    +-- CheckpointWriteError (OSError)           a rank failed to write; carries the first error
    +-- CollectiveTimeoutError (TimeoutError)    a rank did not arrive at an agreement point
    +-- StorageStallError (TimeoutError)         a storage thread or buffer did not return in time
    +-- StorageFormatError (RuntimeError)        a torch.save layout the stream writer cannot frame
    +-- SaveStillRunningError (TimeoutError)     wait(timeout) ended while a background save runs
    +-- StaleDerivedStateError (RuntimeError)    a stale parameter-derived cache about to be used
    +-- RehearsalError (RuntimeError)            `ckptguard rehearse` missed a point it waits for
    +-- RecordFormatError (ValueError)           a line of a memory records file is not a record
    +-- PinnedMemoryUnavailableError (RuntimeError)  exact-size pinning needs CUDA
    +-- ObjectStoreError (OSError)               an object-store request failed after its retries
    |   +-- ConditionalWriteUnsupportedError     If-None-Match/If-Match ignored (refused by default)
    +-- CommitConflictError (FileExistsError)    another writer won this step's commit on the store

Errors cross ranks as JSON (``error_payload`` / ``rebuild``): a leaf's fields (``phase``,
``missing_ranks``, ``step``, ``failures``) are carried, and the leaf is rebuilt with them, so
every rank sees the same class, message and fields.

Every message says what happened, where (path, step, rank) and what to do.
"""

from __future__ import annotations

import errno as _errno
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from ._types import JsonObject

__all__ = [
    "ChainMismatchError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointIncompleteError",
    "CheckpointNotFoundError",
    "CheckpointWriteError",
    "CollectiveTimeoutError",
    "CommitConflictError",
    "ConditionalWriteUnsupportedError",
    "ConfigError",
    "ContractMismatchError",
    "LeaseHeldError",
    "ObjectStoreError",
    "PinnedMemoryUnavailableError",
    "RankDisagreementError",
    "RecordFormatError",
    "RehearsalError",
    "ReplicatedDivergenceError",
    "ResumeError",
    "RunStepError",
    "SaveStillRunningError",
    "StaleDerivedStateError",
    "StateMismatchError",
    "StorageFormatError",
    "StorageStallError",
    "TopologyMismatchError",
    "UnsafeCheckpointError",
    "VersionMismatchError",
    "WriteFailure",
]


class CheckpointError(Exception):
    """Root of every ckptguard error."""

    #: Names of the keyword fields a leaf carries (set in its ``__init__``); they cross ranks.
    fields: ClassVar[tuple[str, ...]] = ()

    def wire_fields(self) -> JsonObject:
        """The fields as JSON values."""
        return {name: getattr(self, name, None) for name in self.fields}

    @classmethod
    def from_wire(cls, message: str, fields: JsonObject) -> CheckpointError:
        """The leaf rebuilt on another rank, with its fields."""
        if not cls.fields:
            return cls(message)
        return cls(message, **{name: fields.get(name) for name in cls.fields})


class ConfigError(CheckpointError, ValueError):
    """A configuration field or argument is invalid."""


class RunStepError(ConfigError):
    """A step directory holds a run manifest (several roles, ``RunCheckpoint``), not one state."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A root, step or file that was asked for does not exist."""


class CheckpointIncompleteError(CheckpointNotFoundError):
    """A checkpoint lacks its commit marker or some of its files."""


class CheckpointCorruptError(CheckpointError, ValueError):
    """A checkpoint file exists but cannot be read or fails its checksum."""


class UnsafeCheckpointError(CheckpointCorruptError):
    """A file holds pickled content outside the allowed classes (it could run code)."""


class ResumeError(CheckpointError, RuntimeError):
    """resolve/restore refuses to pick a step (the alternative would be a guessed fresh start)."""


class RankDisagreementError(ResumeError):
    """Ranks resolved different steps, or some rank lacks its files."""


class StateMismatchError(CheckpointError, ValueError):
    """The state given to restore does not match the checkpoint, or a restored value differs."""


class ReplicatedDivergenceError(StateMismatchError):
    """A tensor that DCP would store once differs across ranks."""


class TopologyMismatchError(CheckpointError, ValueError):
    """World size or parallel layout differs from the checkpoint's."""


class VersionMismatchError(CheckpointError, RuntimeError):
    """The checkpoint was written by a newer torch or ckptguard than the reader's."""


class ContractMismatchError(CheckpointError, ValueError):
    """The run contract (code, data, recipe, total steps) changed without a declared phase."""


class LeaseHeldError(CheckpointError, RuntimeError):
    """Another live run holds the root's write lease."""


class ChainMismatchError(ContractMismatchError):
    """The checkpoint belongs to another run chain and was not adopted."""


class CollectiveTimeoutError(CheckpointError, TimeoutError):
    """A rank did not reach an agreement point within the timeout."""

    fields = ("phase", "missing_ranks")

    def __init__(self, message: str, *, phase: str, missing_ranks: Sequence[int]) -> None:
        super().__init__(message)
        self.phase = phase
        self.missing_ranks = list(missing_ranks)


@dataclass(frozen=True)
class WriteFailure:
    """The first error one rank hit while writing its part of a checkpoint."""

    rank: int
    phase: str
    exc_type: str
    message: str
    errno: int | None = None
    path: str | None = None
    offset: int | None = None
    requested_bytes: int | None = None
    returned_bytes: int | None = None
    time_ns: int = 0

    def to_json(self) -> JsonObject:
        return asdict(self)

    def cause_order(self) -> tuple[bool, bool, int, int]:
        """The key that picks "the first error" across ranks: a rank's own failure before one that
        only followed another rank's (its time is pushed past 10**18), an OS error (errno set)
        before a symptom without one (a serializer's "unexpected pos", a peer's timeout), then wall
        clock, rank."""
        return self.time_ns >= 10**18, self.errno is None, self.time_ns, self.rank

    @classmethod
    def from_json(cls, data: JsonObject) -> WriteFailure:
        return cls(**data)

    def describe(self) -> str:
        parts = [f"rank {self.rank}", f"phase {self.phase!r}", f"{self.exc_type}: {self.message}"]
        if self.errno is not None:
            name = _errno.errorcode.get(self.errno, "?")
            parts.append(f"errno {self.errno} ({name})")
        if self.path is not None:
            parts.append(f"path {self.path}")
        if self.offset is not None:
            parts.append(f"offset {self.offset}")
        if self.requested_bytes is not None:
            parts.append(f"requested {self.requested_bytes} B, returned {self.returned_bytes} B")
        return ", ".join(parts)


class CheckpointWriteError(CheckpointError, OSError):
    """A save failed on some rank; every rank raises this same error together.

    ``first`` is the failure that names the cause (``WriteFailure.cause_order``: an OS error before
    a symptom without errno, then the earliest by wall clock, then rank);
    ``failures`` holds every rank's report.
    """

    fields = ("step", "failures")

    def __init__(
        self, message: str, *, step: int, failures: Sequence[WriteFailure | JsonObject]
    ) -> None:
        parsed = [f if isinstance(f, WriteFailure) else WriteFailure.from_json(f) for f in failures]
        first = min(parsed, key=WriteFailure.cause_order) if parsed else None
        super().__init__(first.errno if first and first.errno else 0, message)
        self.step = step
        self.failures = parsed
        self.first = first

    def __str__(self) -> str:
        return str(self.args[1]) if len(self.args) > 1 else super().__str__()

    def wire_fields(self) -> JsonObject:
        return {"step": self.step, "failures": [f.to_json() for f in self.failures]}


class StorageStallError(CheckpointError, TimeoutError):
    """A storage thread, read or host buffer did not come back within the stall timeout.

    Raised as ``StorageStallError(errno.ETIMEDOUT, message)``: it is an OSError, so the commit
    reports it like any I/O error (errno, rank, phase)."""

    def __str__(self) -> str:
        return str(self.args[1]) if len(self.args) > 1 else super().__str__()

    @classmethod
    def from_wire(cls, message: str, fields: JsonObject) -> CheckpointError:
        return cls(_errno.ETIMEDOUT, message)


class StorageFormatError(CheckpointError, RuntimeError):
    """torch.save framed a tensor in a way the streaming writer cannot place (an internal
    invariant)."""


class SaveStillRunningError(CheckpointError, TimeoutError):
    """``PendingSave.wait(timeout)`` returned while the background save is still running."""

    fields = ("step",)

    def __init__(self, message: str, *, step: int | None = None) -> None:
        super().__init__(message)
        self.step = step


class SaveBudgetError(CheckpointError, RuntimeError):
    """A synchronous save would hold the caller longer than its blocking budget (``BlockingBudget``,
    a fraction of the process group's collective timeout) and ``OverBudget.REFUSE`` applies: raised
    on every rank before anything is captured."""

    fields = ("step", "seconds", "budget_s")

    def __init__(
        self,
        message: str,
        *,
        step: int | None = None,
        seconds: float | None = None,
        budget_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.step = step
        self.seconds = seconds
        self.budget_s = budget_s


class StaleDerivedStateError(CheckpointError, RuntimeError):
    """A cache built for an older parameter version was about to be used."""


class RehearsalError(CheckpointError, RuntimeError):
    """The rehearsal could not reach a point it waits for (timeout, or the command exited)."""


class RecordFormatError(CheckpointError, ValueError):
    """A memory records file holds a line that is not a record (and is not a truncated last
    line)."""


class PinnedMemoryUnavailableError(CheckpointError, RuntimeError):
    """Exact-size pinning needs CUDA, and it is not available (or registration failed)."""


class ObjectStoreError(CheckpointError, OSError):
    """An object-store request failed (after its bounded retries): names bucket, key and step.

    ``status`` is the HTTP status the store answered (None: no answer, e.g. connection refused)."""

    fields = ("bucket", "key", "step", "status")

    def __init__(
        self,
        message: str,
        *,
        bucket: str = "",
        key: str = "",
        step: int | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(_errno.EIO, message)
        self.bucket, self.key, self.step, self.status = bucket, key, step, status

    def __str__(self) -> str:
        return str(self.args[1]) if len(self.args) > 1 else super().__str__()


class ConditionalWriteUnsupportedError(ObjectStoreError):
    """The store accepted a conditional write it should have refused (If-None-Match / If-Match
    ignored): two writers could both commit a step there. Refused unless a weaker mode is asked for
    by name."""


class CommitConflictError(CheckpointError, FileExistsError):
    """Another writer created this step's commit marker on the object store first (the conditional
    create refused ours): exactly one writer commits a step."""

    fields = ("step",)

    def __init__(self, message: str, *, step: int | None = None) -> None:
        super().__init__(message)
        self.step = step


def error_payload(exc: BaseException) -> JsonObject:
    """An error as JSON, to ship to the other ranks so that every rank raises the same one."""
    out: dict[str, Any] = {"type": type(exc).__name__, "message": str(exc)}
    if isinstance(exc, CheckpointError) and type(exc).fields:
        out["fields"] = exc.wire_fields()
    return out


def _leaves() -> dict[str, type[CheckpointError]]:
    found: dict[str, type[CheckpointError]] = {}
    todo: list[type[CheckpointError]] = [CheckpointError]
    while todo:
        cls = todo.pop()
        found[cls.__name__] = cls
        todo += cls.__subclasses__()
    return found


def rebuild(payload: JsonObject, *, note: str = "") -> CheckpointError:
    """The ckptguard error a payload describes, with its fields; a foreign error becomes a
    CheckpointError that names its type."""
    cls = _leaves().get(payload["type"])
    message = f"{note}{payload['message']}"
    if cls is None:
        return CheckpointError(f"{note}{payload['type']}: {payload['message']}")
    return cls.from_wire(message, payload.get("fields") or {})
