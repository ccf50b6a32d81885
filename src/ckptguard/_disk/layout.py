"""Names on disk and the primitives that publish them atomically.

Contract: a file that another process may read is only ever created by writing a
temporary name in the same directory, fsyncing it, renaming it over the final name
and fsyncing the directory. Discovery matches step directories by exact name, so a
temporary or foreign directory is never mistaken for a checkpoint. Every temporary
entry carries a name ckptguard gives (and a temp directory an owner record), so sweeping
and ``gc`` remove only what ckptguard created, never a foreign ``.tmp-build-cache``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._types import JsonObject
from ..errors import CheckpointCorruptError, CheckpointError, ConfigError, UnsafeCheckpointError
from . import tempfiles as _tempfiles
from .tempfiles import proc_start, this_host

TRACKER_NAME = "latest_checkpointed_iteration.txt"
MANIFEST_NAME = "manifest.json"
NODE_MANIFEST_NAME = (
    "node_manifest.json"  # node-local roots: this node's part, written before MANIFEST_NAME
)
STATE_DIR = "state"
CONTRACT_DIR = "contract"
PROOF_DIR = "proof"
TMP_PREFIX = ".tmp-"
OWNER_NAME = "owner.json"

_FIELD = re.compile(r"\{step(?::0?(\d+)d)?\}")
_MAX_WIDTH = 20


def extras_name(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


class StepNaming:
    """Maps steps to directory names through a template such as ``step_{step:08d}``."""

    def __init__(self, template: str) -> None:
        fields = _FIELD.findall(template)
        if len(fields) != 1 or "/" in template or template.startswith("."):
            raise ConfigError(
                f"dir_template {template!r} must hold exactly one {{step}} or {{step:0Nd}} field "
                "and no '/', and must not start with '.'; e.g. 'step_{step:08d}' or "
                "'global_step_{step}'"
            )
        self.template = template
        width = fields[0]
        if width and int(width) > _MAX_WIDTH:  # {step:0999999999d} would format gigabyte names
            raise ConfigError(
                f"dir_template {template!r} pads the step to {int(width)} digits; at most "
                f"{_MAX_WIDTH} make sense (a step is an int64): e.g. 'step_{{step:08d}}'"
            )
        digits = rf"(\d{{{width},}})" if width else r"(\d+)"
        head, tail = _FIELD.split(template, maxsplit=1)[0], _FIELD.split(template)[-1]
        self._pattern = re.compile(re.escape(head) + digits + re.escape(tail) + r"\Z")

    def name(self, step: int) -> str:
        return self.template.format(step=step)

    def parse(self, name: str) -> int | None:
        """The step a directory name stands for, or None; exact match only."""
        match = self._pattern.match(name)
        if match is None:
            return None
        step = int(match.group(1))
        # Reject look-alikes such as step_0100 for a width-8 template.
        return step if self.name(step) == name else None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(
    path: Path, data: bytes, *, before_rename: Callable[[], None] | None = None
) -> None:
    """Write ``data`` to ``path`` so a reader sees the old file or the whole new one."""
    tmp = _tempfiles.temp_name(
        path
    )  # names its owner: swept once this process is dead (``tempfiles``)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            if before_rename is not None:
                before_rename()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a failed write leaves no temp file behind (a kill is the sweep's)
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any, **kw: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode(), **kw)


# ---------------------------------------------------------------- bounded reads

SMALL_FILE_BYTES = 1 << 20
"""Default bound of ``read_small``: trackers, leases, holds, owner and phase records are bytes
long."""
JSON_MAX_DEPTH = 64
"""Deepest JSON nesting ckptguard accepts; what it writes nests a few levels."""


def read_small(path: Path, *, limit: int = SMALL_FILE_BYTES, what: str = "file") -> bytes:
    """The bytes of a small regular file: never through a symlink, never a FIFO or device, never
    past ``limit``.

    A FIFO would block the reader forever and ``/dev/zero`` never ends, so the entry is
    checked with ``lstat`` before it is opened, and again with ``fstat`` on the descriptor
    (opened with O_NOFOLLOW | O_NONBLOCK, so a swap in between neither follows a link nor
    blocks). Raises FileNotFoundError when absent, UnsafeCheckpointError for a link or a
    non-regular file, CheckpointCorruptError when larger than ``limit``.
    """
    path = Path(path)
    _regular(path, os.lstat(path).st_mode, what)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # became a symlink after the lstat
            _regular(path, stat.S_IFLNK, what)
        raise
    try:
        info = os.fstat(fd)
        _regular(path, info.st_mode, what)
        if info.st_size > limit:
            raise CheckpointCorruptError(
                f"{path} ({what}) has {info.st_size} bytes, more than the {limit} bytes "
                f"such a file can hold; it was not written by ckptguard: inspect it, then "
                f"fix or remove it by hand"
            )
        parts, total = [], 0
        while chunk := os.read(fd, min(1 << 20, limit + 1 - total)):
            parts.append(chunk)
            total += len(chunk)
            if total > limit:  # it grew while we read: still bounded
                raise CheckpointCorruptError(
                    f"{path} ({what}) grew past {limit} bytes while being read"
                )
        return b"".join(parts)
    finally:
        os.close(fd)


def _regular(path: Path, mode: int, what: str) -> None:
    if stat.S_ISREG(mode):
        return
    kind = (
        "a symlink"
        if stat.S_ISLNK(mode)
        else ("a directory" if stat.S_ISDIR(mode) else "not a regular file")
    )
    if stat.S_ISFIFO(mode):
        kind = "not a regular file (a FIFO)"
    elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        kind = "not a regular file (a device)"
    raise UnsafeCheckpointError(
        f"{path} ({what}) is {kind}; ckptguard reads such files only as regular files "
        f"inside the root, never through links or from pipes and devices: replace it with "
        f"the real file or remove it"
    )


def parse_json(data: bytes | str, *, where: str, max_depth: int = JSON_MAX_DEPTH) -> Any:
    """JSON from bytes ckptguard did not necessarily write: UTF-8, bounded depth, one error class.

    Any failure (not UTF-8, not JSON, nested deeper than ``max_depth``) is a
    CheckpointCorruptError naming ``where``; never a RecursionError or UnicodeDecodeError.
    """
    try:
        text = data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else data
        obj = json.loads(text)
    except UnicodeDecodeError as exc:
        raise CheckpointCorruptError(
            f"{where} is not UTF-8 text (byte {exc.start}); it was not written by ckptguard"
        ) from None
    except RecursionError:
        obj = None
        depth = max_depth + 1
    except ValueError as exc:
        raise CheckpointCorruptError(f"{where} is not valid JSON ({exc})") from None
    else:
        depth = json_depth(obj, max_depth)
    if depth > max_depth:
        raise CheckpointCorruptError(
            f"{where} nests JSON deeper than {max_depth} levels; ckptguard never writes that: "
            "it was damaged or crafted, so fix or remove it by hand"
        )
    return obj


def json_depth(obj: Any, stop: int) -> int:
    """Nesting depth of parsed JSON, counted without recursion and at most ``stop + 1``."""
    depth, level = 0, [obj]
    while level and depth <= stop:
        depth += 1
        nxt: list[Any] = []
        for node in level:
            if isinstance(node, dict):
                nxt.extend(node.values())
            elif isinstance(node, list):
                nxt.extend(node)
        level = nxt
    return depth if not level else stop + 1


def read_json(path: Path, *, limit: int = SMALL_FILE_BYTES, what: str = "file") -> Any:
    """``parse_json(read_small(path))``: a bounded, regular, link-free JSON file."""
    return parse_json(read_small(path, limit=limit, what=what), where=f"{path} ({what})")


def refuse_link(path: Path, what: str) -> None:
    """Raise if ``path`` is a symlink: ckptguard never reads or writes root entries through
    links."""
    if path.is_symlink():
        raise UnsafeCheckpointError(
            f"{path} ({what}) is a symlink; ckptguard never reads or writes through links "
            f"inside a checkpoint root (it could reach outside the root): replace it with "
            f"the real directory or file"
        )


_DIGITS = re.compile(r"[0-9]+")


def read_tracker(root: Path) -> int | None:
    """The step in the tracker, or None if there is no tracker."""
    path = root / TRACKER_NAME
    try:
        raw = read_small(path, limit=4096, what="tracker")
    except FileNotFoundError:
        return None
    try:
        text = raw.decode("ascii")
        text = (
            text[:-1] if text.endswith("\n") else text
        )  # ckptguard writes "N\n"; Megatron and verl "N"
        if not _DIGITS.fullmatch(
            text
        ):  # int() also takes " 3", "+3", "0_3", "٣": none is a step anyone wrote
            raise ValueError(text)
        step = int(text)
    except ValueError:  # UnicodeDecodeError is one too
        raise CheckpointCorruptError(
            f"tracker {path} holds {raw[:40]!r}, not a step number; it is written only by "
            "ckptguard (or Megatron/verl): inspect it, then fix or delete it by hand"
        ) from None
    if step < 0:
        raise CheckpointCorruptError(f"tracker {path} holds a negative step {step}")
    return step


def write_tracker(root: Path, step: int) -> None:
    atomic_write_bytes(root / TRACKER_NAME, f"{step}\n".encode())


def step_dirs(root: Path, naming: StepNaming) -> dict[int, Path]:
    """Every directory under root whose name is exactly a step name (committed or not)."""
    found: dict[int, Path] = {}
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return found
    for entry in entries:
        step = naming.parse(entry.name)
        if step is not None and entry.is_dir():
            found[step] = Path(entry.path)
    return found


# ---------------------------------------------------------------- temp directories


def committed_steps(
    root: Path, naming: StepNaming, read_manifest: Callable[[Path], Any]
) -> list[int]:
    """Steps no newer than the tracker whose ``read_manifest`` passes (it raises a CheckpointError
    otherwise), ascending; [] without a tracker."""
    tracker = read_tracker(root)
    if tracker is None:
        return []
    out = []
    for step, path in sorted(step_dirs(root, naming).items()):
        if step > tracker:
            continue
        try:
            read_manifest(path)
        except CheckpointError:
            continue
        out.append(step)
    return out


def temp_dir_name(step_name: str, nonce: str) -> str:
    return f"{TMP_PREFIX}{step_name}-{nonce}"


# The names ckptguard gives its temporary entries: a foreign ".tmp-build-cache" never matches.
_TEMP_DIR = re.compile(re.escape(TMP_PREFIX) + r".+-[0-9a-f]{12}\Z")


def write_owner(tmp: Path, *, node: str | None = None) -> None:
    """``node``: the node identity of the creating rank (a save's temp directory), so a rank of
    another node that finds this directory at its own root's path knows it is not its node's
    disk."""
    owner: dict[str, Any] = {
        "host": this_host(),
        "pid": os.getpid(),
        "start": proc_start(os.getpid()),
    }
    if node is not None:
        owner["node"] = node
    (tmp / OWNER_NAME).write_text(json.dumps(owner))


def read_owner(directory: Path) -> JsonObject | None:
    """The owner record ckptguard wrote into ``directory``, or None (absent or unreadable)."""
    try:
        owner = read_json(directory / OWNER_NAME, limit=4096, what="temp-dir owner record")
    except (OSError, ValueError):
        return None
    if (
        not isinstance(owner, dict)
        or not isinstance(owner.get("pid"), int)
        or not isinstance(owner.get("host"), str)
    ):
        return None
    return owner


def owner_state(directory: Path, *, max_age_s: float) -> str:
    """ "dead", "alive" or "foreign" (no owner record: not ckptguard's, never removed).

    Whether its owner is gone is the rule of every writer (``tempfiles.writer_gone``): on this host
    its process decides; on another host, or without the process's start time, an owner counts as
    dead only once the directory is older than ``max_age_s``."""
    owner = read_owner(directory)
    if owner is None:
        return "foreign"
    try:
        expired = time.time() - directory.stat().st_mtime > max_age_s
    except OSError:
        return "alive"
    start = owner.get("start")
    gone = _tempfiles.writer_gone(
        owner["host"], owner["pid"], start if isinstance(start, str) else None, expired=expired
    )
    return "alive" if gone is None else "dead"


def owner_is_dead(tmp: Path, *, max_age_s: float) -> bool:
    """True when the process that created ``tmp`` is gone; a directory without ckptguard's
    owner record is never dead: it is not ours to remove."""
    return owner_state(tmp, max_age_s=max_age_s) == "dead"


def describe_owner(directory: Path) -> str:
    owner = read_owner(directory)
    return f"pid {owner['pid']} on host {owner['host']}" if owner else "no owner record"


def sweep_temp_dirs(root: Path, *, max_age_s: float) -> list[Path]:
    """Remove ckptguard's temporary step directories whose owner is dead; returns what was
    removed."""
    removed = []
    for entry in sorted(root.glob(f"{TMP_PREFIX}*")):
        if is_own_temp_dir(entry) and owner_is_dead(entry, max_age_s=max_age_s):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def is_own_temp_dir(path: Path) -> bool:
    return bool(_TEMP_DIR.match(path.name)) and path.is_dir() and not path.is_symlink()


TRASH_PREFIX = ".trash-"
_TRASH_DIR = re.compile(re.escape(TRASH_PREFIX) + r".+-[0-9a-f]{8}\Z")


def is_trash_dir(path: Path) -> bool:
    """A directory ckptguard moved aside to delete (named by ``uncommit_to_trash``)."""
    return bool(_TRASH_DIR.match(path.name)) and path.is_dir() and not path.is_symlink()


def is_temp_file(path: Path, *, of: str) -> bool:
    """A temporary file that ``atomic_write_bytes`` left for ``of`` (crashed before its rename)."""
    return _tempfiles.is_temp_file(path, of=of)


def remove_step_dir(path: Path) -> None:
    """Uncommit, then delete: the directory is first renamed into the trash, so a crash or
    a failed delete midway never leaves a step-named directory whose old files could pair
    with new ones; ``empty_trash`` retries what is left."""
    shutil.rmtree(uncommit_to_trash(path))


def uncommit_to_trash(path: Path, *, keep_manifest: bool = False) -> Path:
    """Move a step directory into the trash (it stops counting as a step at once: discovery matches
    exact step names), then remove its manifest; returns the trash path, to delete when convenient.
    ``keep_manifest``: the caller may still put it back (``restore_from_trash``; never swept until
    ``drop_manifest``)."""
    if path.is_symlink():
        raise OSError(f"{path} is a symlink; ckptguard never deletes through links")
    trash = path.with_name(f"{TRASH_PREFIX}{path.name}-{secrets.token_hex(4)}")
    os.rename(path, trash)
    fsync_dir(path.parent)
    with contextlib.suppress(OSError):
        write_owner(trash)  # who is deleting it; the name alone already marks it as ckptguard's
    if not keep_manifest:
        drop_manifest(trash)
    return trash


def drop_manifest(trash: Path) -> None:
    """The trash's step can no longer be put back: it becomes plain trash, swept when convenient."""
    with contextlib.suppress(FileNotFoundError):
        (trash / MANIFEST_NAME).unlink()


def restore_from_trash(trash: Path, path: Path) -> None:
    """Put a step moved aside with its manifest back where it was (committed again, as before)."""
    with contextlib.suppress(FileNotFoundError):
        (trash / OWNER_NAME).unlink()
    os.rename(trash, path)
    fsync_dir(path.parent)


def moved_aside(path: Path) -> bool:
    """A trash directory still holding its manifest: a step moved aside by an overwrite or a
    rotation cut short (a kill between two renames); never swept, it may be the only copy of the
    tracker's step."""
    return is_trash_dir(path) and (path / MANIFEST_NAME).is_file()


def empty_trash(root: Path) -> list[Path]:
    """Retry deletes that failed earlier; returns what is still there."""
    left = []
    for path in root.glob(f"{TRASH_PREFIX}*"):
        if is_trash_dir(path) and not moved_aside(path):
            shutil.rmtree(path, ignore_errors=True)
            if path.exists():
                left.append(path)
    return left


# ---------------------------------------------------------------- crash leftovers
