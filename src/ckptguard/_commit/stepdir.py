"""The step directory on one root: prepared, published by rename, uncommitted, discarded.

``prepare_root`` makes the temp directory (the lease, tracker 0 and phase 0 first on a new root);
``rename_in`` publishes a temp directory whose marker is in place; ``publish_dir`` then moves the
tracker. Every publisher (``publish.SharedRootPublisher``, ``publish_nodes``,
``publish.RolePartPublisher``) runs on these.
"""

from __future__ import annotations

import errno as _errno
import os
import secrets
import shutil
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash

from .._context import NO_ACTIONS, Actions, Context
from .._disk import layout as _layout
from .._disk import lease as _lease
from .._disk import tempfiles as _tempfiles
from .._disk.filedigest import file_digest
from .._records import contract as _contract
from .._records import retention as _retention
from .._records import trust as _trust
from .._records.entries import FileEntry
from ..errors import (
    ConfigError,
)
from . import rootcommit
from .messages import Prepared
from .pending import log

FAILED_PREFIX = ".failed-"


def prepare_root(
    ctx: Context, step: int, *, like: Prepared | None = None, actions: Actions = NO_ACTIONS
) -> Prepared:
    """Rank 0 (or, on node-local roots, each node's publishing rank, ``like`` rank 0's outcome):
    root, tracker 0, phase 0, sweep, existing-step check, temp directory."""
    root = ctx.root
    root.mkdir(parents=True, exist_ok=True)
    # The lease first: a second writer is refused before it changes anything in the root.
    note = _lease.acquire(root, ttl_s=ctx.config.storage.lease_ttl_s, override=actions.break_lease)
    if note:
        log.warning("ckptguard: %s: %s", root, note)
    if _layout.read_tracker(root) is None:
        # Declared fresh start first: "steps but no tracker" then never comes from us.
        _layout.write_tracker(root, 0)
    phases = _contract.read_phases(root)
    if not phases:
        # Every node's root carries rank 0's chain: one run, one chain id on every disk.
        chain = like.chain_id if like is not None else uuid.uuid4().hex
        _contract.write_phase(root, _contract.initial_phase(chain, ctx.config.contract))
    phase = _contract.check(root, ctx.config.contract, where=f"save of step {step}")
    if like is not None and (phase.chain_id, phase.phase) != (like.chain_id, like.phase):
        raise ConfigError(
            f"save of step {step}: this node's root {root} is at run chain {phase.chain_id} phase "
            f"{phase.phase}, rank 0's at chain {like.chain_id} phase {like.phase}: the node-local "
            f"roots belong to different runs. Give every node of this run the root of this run (or "
            f"empty ones for a new run)."
        )
    _layout.sweep_temp_dirs(root, max_age_s=ctx.config.storage.stale_temp_age_s)
    # The temp files of killed writers (tracker, lease, trust record, holds); never a live writer's.
    own = (_layout.TRACKER_NAME, _lease.LEASE_NAME, _trust.TRUST_NAME)
    _tempfiles.sweep(root, max_age_s=ctx.config.storage.stale_temp_age_s, names=own)
    _tempfiles.sweep(root / _retention.HOLDS_DIR, max_age_s=ctx.config.storage.stale_temp_age_s)
    name = ctx.naming.name(step)
    rootcommit.admit(DirRoot.of(ctx), step, overwrite=actions.overwrite)
    # Node-local roots: every node's temp directory has rank 0's name (and, once published, the
    # step's).
    tmp = root / (
        Path(like.tmp).name
        if like is not None
        else _layout.temp_dir_name(name, secrets.token_hex(6))
    )
    tmp.mkdir()
    (tmp / _layout.STATE_DIR).mkdir()
    _layout.write_owner(tmp, node=ctx.agreement.info.host)
    contract_hash = phase.contract_hash or _contract.contract_hash(phase.contract)
    return Prepared(
        tmp=str(tmp), chain_id=phase.chain_id, phase=phase.phase, contract_hash=contract_hash
    )


def copy_verified(src: Path, dst: Path, *, expect: str | None = None) -> str:
    """Copy to a temp name on the target, fsync, re-read and compare, then rename.

    The source is hashed while it is copied; the copy is hashed again from disk. ``expect``
    (a recorded xxh3) must match too. Returns the xxh3 of what was published."""
    part = dst.with_name(f"{dst.name}.part-{secrets.token_hex(4)}")
    h = xxhash.xxh3_64()
    with open(src, "rb") as fin, open(part, "wb") as fout:
        while block := fin.read(8 << 20):
            h.update(block)
            view = memoryview(block)
            while view:
                n = fout.write(view)
                view = view[n:]  # a short write continues where it stopped
        fout.flush()
        os.fsync(fout.fileno())
    copied = file_digest(str(part))[1]
    if copied != h.hexdigest() or (expect is not None and copied != expect):
        raise OSError(
            _errno.EIO,
            f"copy differs from its source or record after fsync: {src} -> {part}",
            str(part),
        )
    os.replace(part, dst)
    return copied


def publish_dir(ctx: Context, step: int, tmp: Path, actions: Actions = NO_ACTIONS) -> None:
    """Rename a temp directory whose commit marker is in place to its step name, then move the
    tracker."""
    rootcommit.publish(DirRoot.of(ctx), step, tmp, overwrite=actions.overwrite)


def rename_in(ctx: Context, step: int, tmp: Path, actions: Actions = NO_ACTIONS) -> Path | None:
    """Publish ``tmp`` (its manifest in place) as the step directory; returns the trash to delete
    after the tracker moved (``DirRoot.finish``), if a directory of this step was there."""
    trash = rootcommit.make_visible(DirRoot.of(ctx), step, tmp, overwrite=actions.overwrite)
    assert trash is None or isinstance(trash, Path)
    return trash


class DirRoot:
    """``rootcommit.RootStore`` of a directory root: a step is committed when its directory, holding
    its manifest, has the step's name and the tracker covers it; the write lease is
    ``ROOT/lease.json``."""

    # publish.py reaches "commit.before_rename" before the lease check
    BEFORE_VISIBLE: str | None = None
    BEFORE_TRACKER = "commit.before_tracker"
    ROLLBACK = True  # save(..., overwrite=True): a deliberate rollback or rewrite

    def __init__(self, root: Path, naming: _layout.StepNaming) -> None:
        self.root, self.naming = root, naming

    @classmethod
    def of(cls, ctx: Context) -> DirRoot:
        return cls(ctx.root, ctx.naming)

    def _dir(self, step: int) -> Path:
        return self.root / self.naming.name(step)

    def tracker(self) -> int | None:
        return _layout.read_tracker(self.root)

    def visible(self, step: int) -> bool:
        return (self._dir(step) / _layout.MANIFEST_NAME).exists()

    def refuse(self, why: rootcommit.Refusal, step: int, tracker: int | None) -> Exception:
        if why is rootcommit.Refusal.RESERVED:
            return ConfigError(
                f"save of step {step} under {self.root}: step 0 is reserved for 'fresh start' (the "
                f"tracker of a new root); save steps >= 1"
            )
        if why is rootcommit.Refusal.BEHIND:
            return ConfigError(
                f"save of step {step} under {self.root}: the tracker is at step {tracker}; "
                f"saving an older step would move it back and orphan the newer ones. If this "
                f"is a deliberate rollback, set save(..., overwrite=True); otherwise check the "
                f"step counter after restore."
            )
        if why is rootcommit.Refusal.COMMITTED:
            return ConfigError(
                f"step {step} is already committed at {self._dir(step)}; saving it again would "
                f"replace it. Save a different step, or pass save(..., overwrite=True) to replace "
                f"it (it is uncommitted first, then rewritten)."
            )
        return ConfigError(
            f"save of step {step} under {self.root} is not published: the tracker moved to step "
            f"{tracker} while it was written (another writer on this root); publishing would move "
            f"it back and orphan the newer step. Stop the other writer; for a deliberate rollback "
            f"pass save(..., overwrite=True)."
        )

    def confirm_lease(self, step: int) -> None:
        _lease.confirm(self.root, step=step)

    def uncommit(self, step: int) -> Path | None:
        # An orphan (crash between rename and tracker) or an explicit overwrite: its old files must
        # never pair with the new ones, so it is moved aside first; deleting it waits until after
        # the tracker (a slow delete must not hold the other ranks at the publish agreement).
        final = self._dir(step)
        return _layout.uncommit_to_trash(final, keep_manifest=True) if final.exists() else None

    def put_back(self, step: int, undo: object) -> None:
        assert isinstance(undo, Path)
        _layout.restore_from_trash(undo, self._dir(step))

    def make_visible(self, step: int, staged: object) -> None:
        assert isinstance(staged, Path)
        os.rename(staged, self._dir(step))

    def sealed(self, step: int, undo: object | None) -> None:
        if isinstance(undo, Path):
            _layout.drop_manifest(undo)  # it can no longer be put back: plain trash
        # The owner record was kept until now, so a crash left a temp directory the sweep finds.
        (self._dir(step) / _layout.OWNER_NAME).unlink()
        _layout.fsync_dir(self.root)

    def move_tracker(self, step: int, *, back: bool) -> None:
        # Forward unless ``back``: the lease and ``make_visible``'s tracker check hold it there.
        _layout.write_tracker(self.root, step)

    def finish(self, step: int, undo: object | None) -> None:
        if isinstance(undo, Path):
            shutil.rmtree(undo, ignore_errors=True)  # what is left is retried by empty_trash


def file_problems(
    base: Path, files: Sequence[FileEntry], *, checksums: bool = True
) -> list[tuple[str, str]]:
    """(path, why) for each reported file that is not under ``base`` with its size and xxh3.

    The sizes first (one stat each), then (``checksums``) the xxh3 read back, hashed in
    parallel threads (the hash and the reads release the GIL)."""
    problems: list[tuple[str, str]] = []
    sized: list[FileEntry] = []
    for f in files:
        path = base / f.path
        try:
            size = path.stat().st_size
        except OSError:
            problems.append((f.path, "absent"))
            continue
        if size != f.size:
            problems.append((f.path, f"{size} bytes, reported {f.size}"))
        else:
            sized.append(f)
    if not sized or not checksums:
        return problems

    def hashed(f: FileEntry) -> tuple[str, str] | None:
        try:
            xxh = file_digest(str(base / f.path))[1]
        except OSError as exc:
            return (f.path, f"unreadable ({exc.strerror or exc})")
        return None if xxh == f.xxh3 else (f.path, f"xxh3 {xxh}, reported {f.xxh3}")

    with ThreadPoolExecutor(max_workers=min(4, len(sized))) as pool:
        problems += [p for p in pool.map(hashed, sized) if p is not None]
    return problems


def discard(ctx: Context, tmp: Path) -> None:
    """Delete a failed save's temp directory (frees what an ENOSPC needs), or keep it as
    the scene of the failure when ``keep_failed`` is set."""
    if ctx.config.storage.keep_failed:
        try:
            os.rename(tmp, tmp.with_name(tmp.name.replace(_layout.TMP_PREFIX, FAILED_PREFIX, 1)))
            return
        except OSError:
            pass
    shutil.rmtree(tmp, ignore_errors=True)
