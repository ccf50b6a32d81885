"""The terms of a file transfer between two ranks (``p2p``), and the words of its failure.

Both sides know the file before it moves (``FileSpec``) and run the transfer on a ``Link`` (the
process group, the step, the kind of transfer and what to do after a failure, a timeout per
message). A transfer that fails returns a ``Problem``, the same on both sides: ``describe`` words it
(what failed: the file, the step, the sending and receiving rank; what to do), ``peer_lost`` for a
peer that died or hangs, ``peer_broke`` for one that broke the protocol (``OutOfStep``). A peer's
own failure arrives as its ``Problem`` (``PeerProblem``). None of it runs unless ranks exchange
files.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class FileSpec:
    """One file of a transfer: where the sender reads it, where the receiver puts it."""

    path: str  # relative to the step directory (or to the root for ``root`` files)
    size: int
    xxh3: str
    where: str = "step"  # "step" or "root" (contract files)


@dataclass(frozen=True)
class Link:
    """Where transfers run and what their errors say."""

    group: Any  # the process group (None: the default group); ranks below are ranks of this group
    step: int | None  # the step the files belong to, named in every error
    what: str  # the kind of transfer, e.g. "copy of a replicated DCP file"
    retry: str  # what to do once the cause is fixed, e.g. "save again"
    timeout_s: float | None = None  # per message; None: the process group's own timeout


@dataclass(frozen=True)
class Problem:
    """A failed transfer, the same on both sides."""

    message: str
    rank: int = -1  # the rank that hit it (the peer reports the same problem)
    exc_type: str = "OSError"
    errno: int | None = None
    path: str | None = None
    time_ns: int = 0

    def __str__(self) -> str:
        return self.message


class PeerProblem(Exception):
    """The peer answered that it failed: ``problem`` is its description."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem.message)
        self.problem = problem


class OutOfStep(RuntimeError):
    """The peer sent a message the protocol does not allow at this point (a lying or broken
    peer)."""


def describe(
    link: Link,
    spec: FileSpec,
    src: int,
    dst: int,
    cause: str,
    todo: str,
    *,
    at: int,
    exc: BaseException | None = None,
    exc_type: str = "OSError",
    path: Path | str | None = None,
) -> Problem:
    """The problem rank ``at`` hit: the transfer, the step, the file and both ranks, the ``cause``;
    what to do (``todo``), then the link's retry."""
    step = f"step {link.step}" if link.step is not None else "step unknown"
    oserr = exc if isinstance(exc, OSError) else None
    return Problem(
        f"{link.what}, {step}: {spec.path} ({spec.size} bytes) from rank {src} to rank {dst}: "
        f"{cause}; {todo}, then {link.retry}",
        rank=at,
        exc_type=type(exc).__name__ if exc is not None else exc_type,
        errno=oserr.errno if oserr is not None else None,
        path=str(path)
        if path is not None
        else (str(oserr.filename) if oserr and oserr.filename else None),
        time_ns=time.time_ns(),
    )


def peer_lost(
    link: Link, spec: FileSpec, src: int, dst: int, peer: int, exc: BaseException, started: float
) -> Problem:
    return describe(
        link,
        spec,
        src,
        dst,
        f"rank {peer} stopped answering after {time.monotonic() - started:.1f} s "
        f"({type(exc).__name__}: {str(exc)[:300]})",
        f"rank {peer} died or hangs (its node's log says why); restart the "
        f"job once every rank runs",
        at=src if peer == dst else dst,
        exc=exc,
    )


def peer_broke(
    link: Link, spec: FileSpec, src: int, dst: int, peer: int, exc: OutOfStep
) -> Problem:
    """The peer broke the protocol: refused here (the caller's ``finally`` removes the ``.part``
    file), naming the peer; the pair cannot go on in step, so the transfers with that peer stop."""
    return describe(
        link,
        spec,
        src,
        dst,
        f"rank {peer} broke the transfer protocol: it sent {exc}",
        f"rank {peer} runs other code or is compromised; check that every "
        f"rank runs the same ckptguard",
        at=src if peer == dst else dst,
        exc_type="CheckpointCorruptError",
    )
