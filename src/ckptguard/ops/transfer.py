"""Move a committed checkpoint to another root (a new node after a node failure).

Contract: the copy follows the save's publish protocol: files go to a temp directory
under the destination, each through a temp name, fsync and a checksum compared with the
manifest, then renamed; the manifest is copied last; the directory is renamed; the
destination's tracker is set only after all of that, so a transfer killed midway leaves
no tracker pointing at it, and running it again finishes it. The destination's write
lease is held throughout: a live run there refuses the transfer. The contract phases
travel with it (chain identity), and a transfer record says what moved, from where, by
whom and when. A step saved on node-local roots moves this node's part: the files its node
manifest names, the node manifest, then the global manifest.
"""

from __future__ import annotations

import contextlib
import getpass
import logging
import os
import secrets
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .. import _faults
from .._commit.stepdir import copy_verified
from .._disk import layout as _layout
from .._disk import lease as _lease
from .._records import contract as _contract
from .._records import manifest as _manifest
from .._records import readers as _readers
from .._records.checks import verify_step
from .._records.manifest import node_part
from ..errors import CheckpointCorruptError, ConfigError

log = logging.getLogger("ckptguard")

TRANSFERS_DIR = "transfers"


def transfer(
    step_dir: str | os.PathLike[str],
    dest_root: str | os.PathLike[str],
    *,
    record: str | os.PathLike[str] | None = None,
    ttl_s: float = 6 * 3600.0,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Copy the committed ``step_dir`` into ``dest_root`` under the destination's lease.

    A transfer killed after its rename and before the tracker left a complete copy: run
    again, it checks that copy against the source's manifest and finishes (``resumed``).
    ``progress(bytes copied, bytes in all)`` follows each file copied."""
    step_dir = Path(step_dir)
    dest_root = Path(dest_root)
    record = Path(record) if record is not None else None
    step_dir, dest_root = Path(step_dir).absolute(), Path(dest_root).absolute()
    # The source root's rotation and gc keep the step while it is copied (a reader lease).
    with _readers.reading(step_dir, who=f"transfer to {dest_root} in pid {os.getpid()}") as unheld:
        if unheld is not None:
            log.warning(
                "ckptguard: transfer reads %s without a reader lease (%s)", step_dir, unheld
            )
        return _transfer_read(step_dir, dest_root, record, ttl_s, progress)


def _transfer_read(
    step_dir: Path,
    dest_root: Path,
    record: Path | None,
    ttl_s: float,
    progress: Callable[[int, int], None] | None,
) -> dict[str, Any]:
    findings = [f for f in verify_step(step_dir) if f.severity.value == "ERROR"]
    if findings:
        raise CheckpointCorruptError(
            f"transfer: {step_dir} is not a complete checkpoint: {findings[0].line()}"
        )
    manifest = _manifest.read(step_dir)
    final = dest_root / step_dir.name
    dest_root.mkdir(parents=True, exist_ok=True)
    # A live run writing the destination must not see its tracker or contract moved under it.
    ours = _lease.is_mine(dest_root)  # this process already writes there: keep its lease afterwards
    note = _lease.acquire(dest_root, ttl_s=ttl_s)
    try:
        return _transfer_locked(step_dir, dest_root, final, manifest, record, note, progress)
    finally:
        if not ours:
            _lease.release(dest_root)


def _same_copy(step_dir: Path, final: Path) -> bool:
    """Whether ``final`` is a complete copy of ``step_dir`` (an interrupted transfer's)."""
    if final.is_symlink() or not final.is_dir():
        return False
    try:
        same = (final / _layout.MANIFEST_NAME).read_bytes() == (
            step_dir / _layout.MANIFEST_NAME
        ).read_bytes()
    except OSError:
        return False
    errors = [f for f in verify_step(final, deep=True) if f.severity.value == "ERROR"]
    return same and not errors


def _transfer_locked(
    step_dir: Path,
    dest_root: Path,
    final: Path,
    manifest: Any,
    record: Path | None,
    note: str | None,
    progress: Callable[[int, int], None] | None,
) -> dict[str, Any]:
    started = time.time()
    resumed = False
    if final.exists() or final.is_symlink():
        if not _same_copy(step_dir, final):
            raise ConfigError(
                f"transfer: {final} already exists and is not a complete copy of {step_dir}; "
                f"remove it or pick another destination root"
            )
        resumed = (
            True  # killed between its rename and the tracker: only the tracker and record are left
        )
    _copy_contract(step_dir.parent, dest_root)
    if not resumed:
        _copy_files(step_dir, dest_root, final, manifest, progress)
    _faults.reached("transfer.before_tracker")
    current = _layout.read_tracker(dest_root) or 0
    if manifest.step >= current:
        _layout.write_tracker(dest_root, manifest.step)
    info = {
        "source": str(step_dir),
        "destination": str(final),
        "step": manifest.step,
        "files": [
            {"path": f.path, "size": f.size, "xxh3": f.xxh3}
            for f in node_part(step_dir, manifest)[0] or []
        ],
        "who": f"{getpass.getuser()}@{socket.gethostname()} pid {os.getpid()}",
        "started_unix": started,
        "finished_unix": time.time(),
        "tracker_set_to": max(manifest.step, current),
        "resumed": resumed,
        **({"lease": note} if note else {}),
    }
    rec_path = record or dest_root / TRANSFERS_DIR / f"{int(started)}-step{manifest.step}.json"
    rec_path.parent.mkdir(parents=True, exist_ok=True)
    _layout.atomic_write_json(rec_path, info)
    info["record"] = str(rec_path)
    return info


@contextlib.contextmanager
def publishing(dest_root: Path, final: Path) -> Iterator[Path]:
    """A temp directory for the step ``final`` under ``dest_root``, with an owner record (the
    destination's gc sweeps it if this process dies); published as ``final`` when the block ends
    (the owner record removed, one rename, the root fsynced), removed when it raises. Every transfer
    into a local root goes through it."""
    tmp = dest_root / _layout.temp_dir_name(final.name, secrets.token_hex(6))
    tmp.mkdir()
    _layout.write_owner(tmp)
    try:
        yield tmp
        (tmp / _layout.OWNER_NAME).unlink()
        os.rename(tmp, final)
        _layout.fsync_dir(dest_root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _copy_files(
    step_dir: Path,
    dest_root: Path,
    final: Path,
    manifest: Any,
    progress: Callable[[int, int], None] | None,
) -> None:
    entries, _findings = node_part(step_dir, manifest)  # verified complete by the caller
    total, done = sum(e.size for e in entries or []), 0
    with publishing(dest_root, final) as tmp:
        for entry in entries or []:
            (tmp / entry.path).parent.mkdir(parents=True, exist_ok=True)
            copy_verified(step_dir / entry.path, tmp / entry.path, expect=entry.xxh3)
            _faults.reached("transfer.file_copied")
            done += entry.size
            if progress is not None:
                progress(done, total)
        if manifest.nodes:
            copy_verified(step_dir / _layout.NODE_MANIFEST_NAME, tmp / _layout.NODE_MANIFEST_NAME)
        copy_verified(step_dir / _layout.MANIFEST_NAME, tmp / _layout.MANIFEST_NAME)


def _copy_contract(src_root: Path, dest_root: Path) -> None:
    """The destination continues the same chain: its phases must be the source's."""
    src, dst = _contract.read_phases(src_root), _contract.read_phases(dest_root)
    if not src:
        return
    if dst and dst[0].chain_id != src[0].chain_id:
        raise ConfigError(
            f"transfer: {dest_root} belongs to run chain {dst[0].chain_id}, the checkpoint to "
            f"{src[0].chain_id}; transfer into an empty root, or adopt the checkpoint there instead"
        )
    for path in _contract.phase_files(src_root):
        target = dest_root / _layout.CONTRACT_DIR / path.name
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            _layout.atomic_write_bytes(target, path.read_bytes())


def describe(info: dict[str, Any]) -> str:
    """What a transfer did, in a few lines (``--json`` prints ``info`` itself)."""
    size = sum(int(f["size"]) for f in info["files"])
    how = (
        "resumed an interrupted transfer: its copy was complete and verified"
        if info["resumed"]
        else (
            f"copied {len(info['files'])} file(s), {size} bytes, each verified against the manifest"
        )
    )
    return "\n".join(
        [
            f"step {info['step']}: {info['source']} -> {info['destination']}",
            f"  {how}, in {info['finished_unix'] - info['started_unix']:.2f} s",
            f"  tracker of the destination: step {info['tracker_set_to']}",
            f"  record: {info['record']}",
        ]
    )
