"""Files streamed from one rank to another over torch.distributed point-to-point, verified by xxh3.

The one implementation of a file transfer between nodes: per-node publish copies the replicated
DCP files to the nodes that read them (``protocol``), and peer replicas push a step's files to a
rank of another node and fetch them back (``replica``). The terms both sides share (``FileSpec``,
``Link``, ``Problem``) and the words of each failure are in ``p2ptypes``.

Contract. Both sides know the file (``FileSpec``: path, size, xxh3) before it moves. The
receiver writes a temp name next to the destination, hashes the bytes as they arrive, fsyncs,
compares the xxh3 with the spec, and only then renames it in place. Each exchange is a fixed
sequence of messages that both sides walk in step (``max(1, ceil(size / CHUNK))`` blocks):

1. for each block: sender -> receiver: one message, a 24-byte header (ok with the block's length, or
   failed with the length of the description; and the sender's size of the file) followed by the
   block's bytes (or the description); receiver -> sender (every block but the last): written, or
   why not (its temp file could not be created, a write failed), as one message of the same form;
2. receiver -> sender: the file is in place, or why not (fsync, checksum, rename).

Every message is checked on both sides. The sender sends exactly the header and the length it
announces; the receiver posts every receive at the largest message the protocol has (``HEADER`` +
``CHUNK``: gloo aborts the process, uncatchably, on a message longer than the buffer it lands in,
and accepts a shorter one), then checks the header against its own plan: a block of another length
or a file of another size than its spec, a length beyond ``CHUNK`` or a status that is neither ok
nor failed is refused on both sides, its ``.part`` file removed, naming the peer's rank. A peer that
sends more than ``HEADER`` + ``CHUNK`` bytes in one message still ends the receiving process inside
gloo: no receive can be posted larger than the largest message a peer may send.

So a failure on either side reaches the peer within one block (``CHUNK`` bytes), never after
a timeout, and both sides return the same problem: what failed (the file, the step, the
sending and receiving rank) and what to do. A peer that dies or hangs mid-transfer shows as
a gloo error, or after ``timeout_s`` per message, on the side still alive.

Callers walk their transfers in one global order and each rank takes part only in the pairs
it sends or receives: the earliest unfinished pair always has both its ranks at it, so any
plan completes without deadlock, and after a failed pair both ranks go on with the next.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import secrets
import struct
import time
from pathlib import Path
from typing import Any

import numpy
import torch
import torch.distributed as dist
import xxhash

from .p2ptypes import (
    FileSpec,
    Link,
    OutOfStep,
    PeerProblem,
    Problem,
    describe,
    peer_broke,
    peer_lost,
)

__all__ = [
    "CHUNK",
    "HEADER",
    "FileSpec",
    "Link",
    "Problem",
    "recv_file",
    "recv_json",
    "send_file",
    "send_json",
]

CHUNK = 64 << 20
"""Bytes per block message; a failure reaches the peer after at most one block."""
# Bytes before each block: status, length and the sender's size of the file (int64 each).
HEADER = 24
_TEXT_MAX = 16 << 10
# Random bytes just past the longest body a message may have: a longer message overwrites them.
_CANARY = 8

_OK, _FAIL = 0, 1


# ---------------------------------------------------------------- messages


def _wait(link: Link, work: Any) -> None:
    if work is None:  # this rank is not in the group (never here: both ranks of a pair are)
        return
    if link.timeout_s is None:
        work.wait()
    else:
        work.wait(datetime.timedelta(seconds=link.timeout_s))


def _send(link: Link, tensor: torch.Tensor, dst: int) -> None:
    _wait(link, dist.isend(tensor, group=link.group, group_dst=dst))


def _inbox() -> torch.Tensor:
    """A receive buffer as large as the largest message plus a canary (its pages are touched only by
    what arrives)."""
    return torch.empty(HEADER + CHUNK + _CANARY, dtype=torch.uint8)


def _recv_msg(
    link: Link, src: int, inbox: torch.Tensor, ok_max: int = CHUNK
) -> tuple[int, int, int]:
    """(status, body length, total) of the next message from ``src``, its body at
    ``inbox[HEADER:]``. Checked before the body is used: the header's status and length, and the
    real length of the message (gloo does not report it): random canaries just past the body this
    side expects (``ok_max`` bytes for an ok message, ``_TEXT_MAX`` for a failure) must survive a
    message that announces no more."""
    view = inbox.numpy()
    spots = sorted({min(ok_max, CHUNK), _TEXT_MAX})
    # Overlapping windows would overwrite each other: keep the later one.
    if spots[-1] - spots[0] < _CANARY:
        spots = spots[-1:]
    canary = numpy.frombuffer(os.urandom(_CANARY), dtype=numpy.uint8)
    for at in spots:
        view[HEADER + at : HEADER + at + _CANARY] = canary
    _wait(link, dist.irecv(inbox, group=link.group, group_src=src))
    code, count, total = struct.unpack_from("<qqq", view.data, 0)
    if code not in (_OK, _FAIL) or not 0 <= count <= (CHUNK if code == _OK else _TEXT_MAX):
        raise OutOfStep(
            f"a message with status {code} and a body of {count} bytes (at most {CHUNK} bytes of "
            f"data or {_TEXT_MAX} of a failure's description are allowed)"
        )
    # The smallest canary at or past the announced length: overwritten, the message was longer than
    # it says. (A length past every canary is another size than this side expects: the caller
    # refuses it as such.)
    past = next((a for a in spots if a >= count), None)
    if past is not None and not numpy.array_equal(
        view[HEADER + past : HEADER + past + _CANARY], canary
    ):
        raise OutOfStep(
            f"a message longer than its header announces (more than {past} bytes of body where "
            f"{count} were announced)"
        )
    return code, count, total


def _send_msg(link: Link, dst: int, code: int, body: bytes = b"", total: int = 0) -> None:
    buf = torch.empty(HEADER + len(body), dtype=torch.uint8)
    view = buf.numpy().data
    struct.pack_into("<qqq", view, 0, code, len(body), total)
    view[HEADER:] = body
    _send(link, buf, dst)


def _send_ok(link: Link, dst: int) -> None:
    _send_msg(link, dst, _OK)


def _send_fail(link: Link, dst: int, problem: Problem) -> None:
    _send_msg(link, dst, _FAIL, json.dumps(problem.__dict__).encode()[:_TEXT_MAX])


def _recv_answer(link: Link, src: int, inbox: torch.Tensor) -> int:
    """The peer's next answer: raises its problem where it failed, else returns the answer's
    count."""
    code, n, _ = _recv_msg(link, src, inbox, ok_max=0)
    if code == _OK:
        if n:
            raise OutOfStep(f"an answer with a body of {n} bytes (none is due)")
        return n
    raise PeerProblem(_parse_problem(src, inbox, n))


def _parse_problem(src: int, inbox: torch.Tensor, n: int) -> Problem:
    """The description of a failure, in the body of the peer's "failed" message."""
    try:
        found = Problem(**json.loads(bytes(inbox[HEADER : HEADER + n].numpy())))
    except (ValueError, TypeError) as exc:  # a torn description: still a failure of the peer
        return Problem(
            f"rank {src} failed the transfer; its description does not parse ({exc})", rank=src
        )
    if not isinstance(found.message, str):
        return Problem(f"rank {src} failed the transfer; its description is not text", rank=src)
    return found


def send_json(link: Link, obj: Any, dst: int) -> None:
    data = json.dumps(obj).encode()
    # Pieces of at most one block: every message fits the inbox.
    for at in range(0, max(len(data), 1), CHUNK):
        _send_msg(link, dst, _OK, data[at : at + CHUNK], len(data))


def recv_json(link: Link, src: int, limit: int = 1 << 30) -> Any:
    inbox, got = _inbox(), bytearray()
    while True:
        code, n, total = _recv_msg(link, src, inbox)
        if code != _OK or not 0 <= total <= limit or len(got) + n > total:
            raise OutOfStep(
                f"a JSON piece of {n} bytes of {total} (status {code}, {len(got)} "
                f"received, at most {limit})"
            )
        got += bytes(inbox[HEADER : HEADER + n].numpy())
        if len(got) == total:
            try:
                return json.loads(bytes(got))
            except ValueError as exc:
                raise OutOfStep(f"JSON that does not parse ({exc})") from None
        if n == 0:
            raise OutOfStep(f"an empty JSON piece after {len(got)} of {total} bytes")


def _tell(link: Link, peer: int, problem: Problem) -> None:
    """Best effort: an honest peer that is out of step hears why; a lying one may not be
    listening."""
    with contextlib.suppress(RuntimeError):
        _send_fail(link, peer, problem)


# ---------------------------------------------------------------- one file


def _read_block(f: Any, buf: torch.Tensor, at: int, size: int) -> str | None:
    """Fill ``buf`` from ``f`` (at byte ``at`` of a ``size``-byte file); why not, if it could
    not."""
    view = buf.numpy().data
    got = 0
    try:
        while got < len(view):
            n = f.readinto(view[got:])
            if not n:
                return f"it ends at byte {at + got}, its recorded size is {size}"
            got += n
    except OSError as exc:
        return f"reading it failed at byte {at + got}: {exc}"
    return None


def _blocks(size: int) -> int:
    # A file of 0 bytes is one empty block: the exchange still runs.
    return max(1, -(-size // CHUNK))


def _send_block(
    link: Link, dst: int, buf: torch.Tensor, n: int, total: int, problem: Problem | None = None
) -> None:
    """``buf[HEADER:HEADER + n]`` holds the block: sent with its header as one message of exactly
    the length the header announces. With ``problem`` the message says it failed and carries the
    description instead."""
    if problem is not None:
        _send_msg(link, dst, _FAIL, json.dumps(problem.__dict__).encode()[:_TEXT_MAX], total)
        return
    struct.pack_into("<qqq", buf.numpy().data, 0, _OK, n, total)
    _send(link, buf[: HEADER + n], dst)


def send_file(link: Link, path: Path, spec: FileSpec, dst: int) -> Problem | None:
    """Send ``spec.size`` bytes of ``path`` to ``dst`` (which calls ``recv_file``); returns the
    problem, this side's or the receiver's, if the file did not arrive in place."""
    me = dist.get_rank(link.group)
    started = time.monotonic()
    f = None
    problem: Problem | None = None
    try:
        try:
            f = open(path, "rb")  # noqa: SIM115 (kept open across the block loop, closed below)
        except OSError as exc:
            problem = describe(
                link,
                spec,
                me,
                dst,
                f"rank {me} cannot open it: {exc}",
                f"the file on rank {me}'s disk is gone or unreadable; check {path}",
                at=me,
                exc=exc,
            )
        buf = torch.empty(HEADER + min(CHUNK, spec.size), dtype=torch.uint8)
        inbox = _inbox()
        sent = 0
        n = min(CHUNK, spec.size)
        error = _read_block(f, buf[HEADER : HEADER + n], sent, spec.size) if f is not None else None
        blocks = _blocks(spec.size)
        for i in range(blocks):
            if problem is None and error is not None:
                problem = describe(
                    link,
                    spec,
                    me,
                    dst,
                    f"rank {me} cannot send it: {error}",
                    f"the file on rank {me}'s disk changed after its write, or the disk fails; "
                    f"check {path}",
                    at=me,
                    path=path,
                )
            if problem is not None:
                _send_block(link, dst, buf, n, spec.size, problem)
                return problem
            # Once sent, the buffer is free for the next block.
            _send_block(link, dst, buf, n, spec.size)
            sent += n
            if i < blocks - 1:
                n = min(CHUNK, spec.size - sent)
                # Read while the receiver writes; then its "written" (always taken before the next
                # block: the pair stays in step).
                error = _read_block(f, buf[HEADER : HEADER + n], sent, spec.size)
                _recv_answer(link, dst, inbox)
        _recv_answer(link, dst, inbox)  # fsynced, checked and in place
        return None
    except PeerProblem as exc:
        return exc.problem
    except OutOfStep as exc:
        problem = peer_broke(link, spec, me, dst, dst, exc)
        _tell(link, dst, problem)
        return problem
    except RuntimeError as exc:  # gloo: the peer died, or a message waited past timeout_s
        return peer_lost(link, spec, me, dst, dst, exc, started)
    finally:
        if f is not None:
            f.close()


def recv_file(
    link: Link,
    dest: Path,
    spec: FileSpec,
    src: int,
    *,
    refuse: tuple[str, str] | None = None,
) -> Problem | None:
    """Receive ``spec`` from ``src`` (which calls ``send_file``) into ``dest``: a temp name, fsync,
    xxh3 against ``spec``, rename. Returns the problem, this side's or the sender's.

    A problem of this side is answered in place of the next "written" (or the final answer): the
    block in flight is still received, so the sender never waits on a receiver that gave up.
    ``refuse`` (what is refused and why, what to do; "the file: it is not listed ..."): the caller
    refuses the file before a byte is written; the exchange still runs, so the sender hears it
    within one block."""
    me = dist.get_rank(link.group)
    started = time.monotonic()
    part = dest.with_name(f"{dest.name}.part-{secrets.token_hex(4)}")
    out = None
    problem: Problem | None = None

    def refused(doing: str, exc: OSError) -> Problem:
        return describe(
            link,
            spec,
            src,
            me,
            f"rank {me} failed {doing} {part}: {exc}",
            f"rank {me}'s disk refused the file: free space there, or make {dest.parent} writable",
            at=me,
            exc=exc,
        )

    try:
        if refuse is None and (
            not spec.path or os.path.isabs(spec.path) or ".." in Path(spec.path).parts
        ):
            # The path comes from the peer: one that leaves the receiver's directory is never
            # written.
            refuse = (
                "the path: it leaves the directory it is received into (absolute or '..')",
                f"the sender's manifest or plan is damaged or crafted; check "
                f"rank {src}'s checkpoint root",
            )
        if refuse is not None:
            problem = describe(
                link,
                spec,
                src,
                me,
                f"rank {me} refuses {refuse[0]}",
                refuse[1],
                at=me,
                exc_type="CheckpointCorruptError",
            )
        else:
            try:
                dest.parent.mkdir(parents=True, exist_ok=True)
                # kept open across the block loop, closed below
                out = open(part, "wb")  # noqa: SIM115
            except OSError as exc:
                problem = refused("creating", exc)
        h = xxhash.xxh3_64()
        buf = _inbox()
        view = buf.numpy().data
        got = 0
        blocks = _blocks(spec.size)
        for i in range(blocks):
            n = min(CHUNK, spec.size - got)
            code, count, total = _recv_msg(link, src, buf, ok_max=n)
            if code == _FAIL:
                raise PeerProblem(_parse_problem(src, buf, count))
            # The sender's record of the file is another size: refused on both sides (the whole
            # message arrived: the pair stays in step).
            if count != n or total != spec.size:
                problem = problem or describe(
                    link,
                    spec,
                    src,
                    me,
                    f"rank {src} sends {total} bytes of it, rank {me} expects {spec.size} "
                    f"(a block of {count} bytes where {n} were due, block {i + 1} of {blocks})",
                    f"the two ranks' records of this file disagree (a damaged or crafted manifest "
                    f"or plan): check rank {src}'s checkpoint root",
                    at=me,
                    exc_type="CheckpointCorruptError",
                )
                _send_fail(link, src, problem)
                return problem
            if problem is None and out is not None:
                payload = view[HEADER : HEADER + n]
                h.update(payload)
                try:
                    out.write(payload)
                except OSError as exc:
                    problem = refused("writing", exc)
            got += n
            if i < blocks - 1:
                if problem is not None:
                    _send_fail(link, src, problem)
                    return problem
                _send_ok(link, src)  # written
        if problem is None and out is not None:
            try:
                out.flush()
                os.fsync(out.fileno())
                out.close()
            except OSError as exc:
                problem = refused("writing", exc)
        if problem is None and h.hexdigest() != spec.xxh3:
            problem = describe(
                link,
                spec,
                src,
                me,
                f"the bytes rank {me} received have xxh3 {h.hexdigest()}, the writer recorded "
                f"{spec.xxh3}",
                f"the file changed on rank {src}'s disk after its write, or the transfer corrupted "
                f"it; check that disk and the network between the nodes",
                at=me,
                exc_type="CheckpointCorruptError",
                path=part,
            )
        if problem is None:
            try:
                os.replace(part, dest)
            except OSError as exc:
                problem = refused("renaming", exc)
        if problem is not None:
            _send_fail(link, src, problem)
            return problem
        _send_ok(link, src)  # in place
        return None
    except PeerProblem as exc:
        return exc.problem
    except OutOfStep as exc:
        problem = peer_broke(link, spec, src, me, src, exc)
        _tell(link, src, problem)
        return problem
    except RuntimeError as exc:  # gloo: the peer died, or a message waited past timeout_s
        return peer_lost(link, spec, src, me, src, exc, started)
    finally:
        if out is not None and not out.closed:
            out.close()
        if out is not None and part.exists():
            part.unlink(missing_ok=True)
