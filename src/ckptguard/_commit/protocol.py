"""The save side of the File contract: write everything, agree, then publish.

Protocol (docs/architecture.md, the walk of one save; docs/practices.md, 3.3-3.4):

1. Rank 0 prepares: the root and, on a new root, tracker 0 and contract phase 0; it sweeps
   temp directories whose owner died and creates ``.tmp-<step>-<nonce>/``.
2. Every rank writes its DCP shards and its extras there (or into ``stage_dir`` first,
   then copies with checksum verification) and reports success or its first error.
3. If any rank failed, every rank raises the same CheckpointWriteError; the tracker
   does not move.
4. Rank 0 writes ``manifest.json`` (temp, fsync, rename), uncommits an orphan or
   overwritten directory of the same step, renames the temp directory, fsyncs the root
   and replaces the tracker. Every rank learns the outcome before returning.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from .. import _faults
from .._agree import gather_decide
from .._context import NO_ACTIONS, Actions, Context
from .._disk import layout as _layout
from .._disk.digest import digest, file_digest, release_host_cache
from .._records import manifest as _manifest
from .._records.entries import FileEntry
from .._records.proofwriter import write_held
from .._state.rng import RNG_ITEM
from .._state.state import Captured, digests_and_layout_free
from .._types import StateDict
from ..errors import (
    CheckpointError,
    ConfigError,
)
from ..storage._pool import io_error, write_all
from ..storage.base import WrittenFile
from .messages import Prepared, PrepareRequest, RankReport, failure_from, raise_if_failed
from .publish import Publisher, RolePartPublisher, SharedRootPublisher
from .publish_nodes import NodePublisher, place, prepare_nodes
from .snapshot import Snapshot, check_replicated, resumed, snapshot
from .stepdir import copy_verified, prepare_root

log = logging.getLogger("ckptguard")


# ---------------------------------------------------------------- step 1: prepare


def prepare(ctx: Context, step: int, actions: Actions = NO_ACTIONS) -> Prepared:
    nodes: dict[str, list[int]] = {}  # rank 0 only: node -> ranks, from the requests

    def decide(requests: list[PrepareRequest]) -> Prepared:
        steps = [r.step for r in requests]
        if len(set(steps)) > 1:
            raise ConfigError(
                f"ranks called save with different steps {steps} (index = rank); every "
                f"rank must save the same step"
            )
        for rank, r in enumerate(requests):
            nodes.setdefault(r.node, []).append(rank)
        for node, ranks in nodes.items():
            roots = {requests[r].root for r in ranks}
            if len(roots) > 1:
                # One node, one disk: ranks of a node write into the one temp directory of that
                # node.
                listing = "; ".join(f"rank {r}: {requests[r].root}" for r in ranks)
                raise ConfigError(
                    f"save of step {step}: ranks of node {node} passed different checkpoint "
                    f"roots ({listing}). Every rank of a node must pass the same root: storage "
                    f"they all share, or the node's own node-local disk (each node then "
                    f"publishes its own ranks' files)"
                )
        try:
            return prepare_root(ctx, step, actions=actions)
        except CheckpointError:
            raise
        except (
            Exception
        ) as exc:  # an OSError of the root: reported like a write failure, with errno and path
            return Prepared(failure=failure_from(exc, rank=0, phase="prepare"))

    request = PrepareRequest(step, str(ctx.root.absolute()), ctx.agreement.info.host)
    prep = gather_decide(ctx.agreement, "save.prepare", request, decide, decision=Prepared)
    raise_if_failed(ctx, [prep.failure] if prep.failure else [], step=step, phase="prepare")
    # a fresh run's proof records, held until now: a kill right after this commit keeps them
    write_held()
    if ctx.world == 1:
        return prep
    prep = place(ctx, step, prep, nodes)
    if prep.nodes:
        prepare_nodes(ctx, step, prep, actions)
        write_held()  # node-local roots: this node's root exists from here on
    return prep


# ---------------------------------------------------------------- step 2: write


class _ExtrasFile:
    """The file ``torch.save`` writes the extras to: every write through ``write_all``, so a failed
    write is an OSError with errno, path and offset. Through a plain file, torch's serializer turns
    ENOSPC into "unexpected pos 1216 vs 1110" with errno 0, the error that hides its cause."""

    def __init__(self, fd: int, path: str) -> None:
        self.fd, self.path, self.offset = fd, path, 0
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        try:
            write_all(self.fd, view, self.path, self.offset)
        except OSError as exc:
            self.error = self.error or exc
            raise
        self.offset += len(view)
        return len(view)

    def flush(self) -> None:
        """Nothing is buffered here; the fsync follows the whole file."""


def _write_extras(path: Path, extras: StateDict) -> WrittenFile:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        out = _ExtrasFile(fd, str(path))
        try:
            # write and flush are all torch.save calls
            torch.save(extras, out)  # type: ignore[arg-type]
        except Exception as exc:
            if out.error is not None:  # the OS error, not the serializer's symptom of it
                raise out.error from exc
            raise
        try:
            os.fsync(fd)
        except OSError as exc:
            raise io_error(
                exc.errno or errno.EIO,
                "fsync of",
                str(path),
                offset=out.offset,
                requested=0,
                returned=-1,
            ) from exc
    finally:
        os.close(fd)
    size, xxh = file_digest(str(path))
    return WrittenFile(path=path.name, size=size, xxh3=xxh)


def _write_rank(
    ctx: Context, step: int, tmp: Path, items: dict[str, Captured], rng: Any
) -> list[WrittenFile]:
    extras = {
        "format_version": _manifest.FORMAT_VERSION,
        "step": step,
        "rank": ctx.rank,
        "kinds": {n: c.kind.value for n, c in items.items()},
        "items": {n: c.skeleton for n, c in items.items()},
        "rng": rng,
    }
    tensors = {k: t for c in items.values() for k, t in c.tensors.items()}
    stage = ctx.config.storage.stage_dir
    if stage is None:
        files = ctx.storage.write(tmp / _layout.STATE_DIR, tensors, ctx.storage_ctx)
        files.append(_write_extras(tmp / _layout.extras_name(ctx.rank), extras))
        return files
    local = stage / tmp.name
    (local / _layout.STATE_DIR).mkdir(parents=True, exist_ok=True)
    try:
        files = ctx.storage.write(local / _layout.STATE_DIR, tensors, ctx.storage_ctx)
        files.append(_write_extras(local / _layout.extras_name(ctx.rank), extras))
        for f in files:
            copy_verified(local / f.path, tmp / f.path)
        return files
    finally:
        shutil.rmtree(local, ignore_errors=True)


def _write_and_digest(
    ctx: Context, step: int, tmp: Path, items: dict[str, Captured], rng: Any
) -> tuple[list[WrittenFile], tuple[dict[str, str], dict[str, list[str]]]]:
    """The write and the digest pass over the same bytes, overlapped: digests in a second thread.

    Run one after the other, the digest pass added its whole time to every save; the two read
    the same (staged or live) tensors and neither changes them."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            # Both digests in one pass over the bytes: the per-rank one and the one no sharding
            # changes.
            box["digests"] = digests_and_layout_free(items)
        except BaseException as exc:  # raised below, in the commit's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name=f"ckptguard-digest-{step}", daemon=True)
    thread.start()
    try:
        written = _write_rank(ctx, step, tmp, items, rng)
    finally:
        thread.join()
    if "error" in box:
        raise box["error"]
    return written, box["digests"]


# ---------------------------------------------------------------- steps 3 and 4: confirm and
# publish


def save(ctx: Context, step: int, state: StateDict, actions: Actions = NO_ACTIONS) -> Path:
    return commit(ctx, snapshot(ctx, step, state, actions=actions))


def write_part(ctx: Context, step: int, tmp: Path, snap: Snapshot) -> RankReport:
    """Write this rank's part and describe it; a failure is described instead."""
    try:
        try:
            written, (digests, layout_free) = _write_and_digest(
                ctx, step, tmp, snap.items, snap.rng
            )
        finally:
            if snap.read_done is not None:
                # live tensors (a state larger than the staging pool) may change now
                snap.read_done()
        if snap.rng is not None:
            digests[RNG_ITEM] = digest(snap.rng)
        report = RankReport(
            ctx.agreement.info.host,
            [FileEntry(f.path, f.size, f.xxh3) for f in written],
            digests,
            ctx.expert.rank if ctx.expert else None,
            layout_free=layout_free,
            reshard=snap.reshard,
        )
        _faults.reached("commit.rank_written")
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException; report all
        report = RankReport(
            ctx.agreement.info.host, failure=failure_from(exc, rank=ctx.rank, phase="write")
        )
    release_host_cache()
    return report


def commit(ctx: Context, snap: Snapshot, *, part: Prepared | None = None) -> Path:
    """Steps 1 to 4 of the protocol for a snapshot; in the caller's or a background thread.

    ``part``: write the snapshot as one role's part of a run step into ``part.tmp`` (prepared by the
    run's commit, ``ckptguard.run``) and stop after its manifest: the run commit renames the step
    directory and moves the tracker once every role on every rank confirmed. Returns
    ``part.tmp``."""
    if not snap.guarded:
        check_replicated(
            ctx, snap.items, snap.step
        )  # collective: every rank raises alike, before prepare
    publisher: Publisher
    if part is not None:
        prep, tmp, publisher = part, Path(part.tmp), RolePartPublisher()
    else:
        prep = prepare(ctx, snap.step, snap.actions)
        # This rank's view: on node-local roots its own node's disk, where the name is the same.
        tmp = ctx.root.absolute() / Path(prep.tmp).name
        publisher = NodePublisher() if prep.nodes else SharedRootPublisher()
    path = publisher.run(ctx, snap, prep, tmp, lambda: write_part(ctx, snap.step, tmp, snap))
    ctx.last_save = (snap.step, resumed(snap))
    return path
