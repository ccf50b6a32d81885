"""Every error ckptguard raises.

One root, and leaves that also subclass the builtin a caller would naturally catch::

    CheckpointError
    +-- ConfigError (ValueError)                 a bad argument or config field
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

Every message says what happened, where (path, step, rank) and what to do.
"""

from __future__ import annotations

import errno as _errno
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "ChainMismatchError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointIncompleteError",
    "CheckpointNotFoundError",
    "CheckpointWriteError",
    "CollectiveTimeoutError",
    "ConfigError",
    "ContractMismatchError",
    "LeaseHeldError",
    "RankDisagreementError",
    "ReplicatedDivergenceError",
    "ResumeError",
    "StateMismatchError",
    "TopologyMismatchError",
    "UnsafeCheckpointError",
    "VersionMismatchError",
    "WriteFailure",
]


class CheckpointError(Exception):
    """Root of every ckptguard error."""


class ConfigError(CheckpointError, ValueError):
    """A configuration field or argument is invalid."""


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

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WriteFailure:
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

    ``first`` is the earliest failure reported (by wall clock, then rank);
    ``failures`` holds every rank's report.
    """

    def __init__(self, message: str, *, step: int, failures: Sequence[WriteFailure]) -> None:
        first = min(failures, key=lambda f: (f.time_ns, f.rank)) if failures else None
        super().__init__(first.errno if first and first.errno else 0, message)
        self.step = step
        self.failures = list(failures)
        self.first = first

    def __str__(self) -> str:
        return str(self.args[1]) if len(self.args) > 1 else super().__str__()


def error_payload(exc: BaseException) -> dict[str, str]:
    """An error as JSON, to ship to the other ranks so that every rank raises the same one."""
    return {"type": type(exc).__name__, "message": str(exc)}


def rebuild(payload: dict[str, str], *, note: str = "") -> CheckpointError:
    """The ckptguard error a payload describes; a foreign error becomes a CheckpointError that names it."""
    cls = globals().get(payload["type"])
    message = f"{note}{payload['message']}"
    if not (isinstance(cls, type) and issubclass(cls, CheckpointError)):
        return CheckpointError(f"{note}{payload['type']}: {payload['message']}")
    exc = cls.__new__(cls)
    Exception.__init__(exc, message)  # leaves' extra constructor fields are not shipped
    return exc
