"""Rotation that never deletes the checkpoint you need (docs/practices.md, 7).

Contract: policies are pure functions of the committed steps found on disk, so a restart
rebuilds the same decision (no in-memory list to lose). A directory is deleted only if it
is committed (manifest, shard set and sizes check out, and the tracker covers it), is not
the tracker's target, not protected by the caller (the step being restored or written),
not held, and not the newest verified step (``trust.json``: the step a ``prefer="verified"``
resume needs after a NaN; with that record unreadable nothing is deleted); a hold file that
cannot be read still holds its step. Without a tracker
nothing is deleted. Corrupt and orphan directories are never counted among the kept ones
and are never deleted here; one that cannot even be checked is one finding, never a
failure of the whole rotation. Deletion renames the directory into the trash first, so
a half-deleted directory never looks committed; the trash itself is deleted by a background
thread (``Deleter``), so a commit never waits for the old step's files to go (issue 41: 1.25-
1.75 s of a 6 GiB commit). A kill mid-delete leaves only a trash directory (never a step name,
no manifest), swept by the next rotation or ``gc``. A failed delete is reported and retried at
the next run; it never raises into training.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from .._disk import layout as _layout
from ..errors import CheckpointError, ConfigError
from . import readers as _readers
from . import trust as _trust
from .checks import verify_step

log = logging.getLogger("ckptguard")

HOLDS_DIR = "holds"


class RetentionPolicy(Protocol):
    def keep(self, steps: Sequence[int]) -> set[int]:
        """The steps to keep, given the committed steps in ascending order."""
        ...


class _Combinable:
    def __or__(self, other: RetentionPolicy) -> KeepAny:
        return KeepAny((self, other))  # type: ignore[arg-type]


@dataclass(frozen=True)
class KeepLast(_Combinable):
    """The newest ``n`` committed steps."""

    n: int

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ConfigError(
                f"KeepLast(n={self.n!r}): n must be an int >= 1 (the newest step is always kept)"
            )

    def keep(self, steps: Sequence[int]) -> set[int]:
        return set(sorted(steps)[-self.n :])


@dataclass(frozen=True)
class KeepEvery(_Combinable):
    """Every step divisible by ``n``: kept outside rotation, for evaluation and rollback."""

    n: int

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ConfigError(f"KeepEvery(n={self.n!r}): n must be an int >= 1")

    def keep(self, steps: Sequence[int]) -> set[int]:
        return {s for s in steps if s % self.n == 0}


@dataclass(frozen=True)
class KeepAny(_Combinable):
    """Keeps what any of its policies keeps."""

    policies: tuple[RetentionPolicy, ...] = field(default_factory=tuple)

    def keep(self, steps: Sequence[int]) -> set[int]:
        out: set[int] = set()
        for p in self.policies:
            out |= p.keep(steps)
        return out


def default_policy() -> KeepAny:
    """The last 3, plus every 20th step outside rotation."""
    return KeepLast(3) | KeepEvery(20)


# ---------------------------------------------------------------- holds


def hold(root: Path, step: int, reason: str) -> Path:
    """Pin ``step`` against rotation; survives restarts (a file under ROOT/holds)."""
    if not reason.strip():
        raise ConfigError("hold: give a reason (who needs this step, and until when)")
    directory = root / HOLDS_DIR
    _layout.refuse_link(directory, "holds directory")  # never written through a link
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{step}.json"
    _layout.atomic_write_json(path, {"step": step, "reason": reason, "created_unix": time.time()})
    return path


def release(root: Path, step: int) -> bool:
    _layout.refuse_link(root / HOLDS_DIR, "holds directory")  # never delete through a link
    path = root / HOLDS_DIR / f"{step}.json"
    if not path.exists() and not path.is_symlink():
        return False
    path.unlink()
    return True


_HOLD_NAME = re.compile(r"(\d+)\.json\Z")


def holds(root: Path, *, sweep: bool = False) -> dict[int, str]:
    """Held steps and why: the holds (``hold``), then the steps live readers have open
    (``_readers``: ``open_step``, ``hold --ttl``). A hold file that cannot be read still holds
    the step its name gives (``<step>.json``): a damaged hold must never free a step someone
    relies on. ``sweep``: dead reader leases are removed on the way (retention does)."""
    out = _own_holds(root)
    for step, reader in _readers.live(root, sweep=sweep).items():
        out.setdefault(step, reader)
    return out


def _own_holds(root: Path) -> dict[int, str]:
    out: dict[int, str] = {}
    _layout.refuse_link(root / HOLDS_DIR, "holds directory")  # never read through a link
    try:
        entries = sorted(os.scandir(root / HOLDS_DIR), key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return out
    for entry in entries:
        match = _HOLD_NAME.match(entry.name)
        if match is None:
            continue  # not a name ``hold`` writes (e.g. a temp file of a hold being written)
        path = Path(entry.path)
        step = int(match.group(1))
        try:
            data = _layout.read_json(path, limit=64 << 10, what="hold record")
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
            out[step] = str(data.get("reason", ""))
            if data.get("step") != step:  # a hand-edited file: hold both steps it names
                with contextlib.suppress(TypeError, ValueError):
                    out.setdefault(int(data["step"]), out[step])
        except (OSError, ValueError, KeyError) as exc:
            why = str(exc).split(";")[0][:200]
            out[step] = (
                f"UNREADABLE hold file {path} ({why}): treated as held; "
                f"fix or `ckptguard release` it"
            )
            log.warning(
                "ckptguard: hold file %s is unreadable (%s); step %d stays held "
                "until it is fixed or released",
                path,
                why,
                step,
            )
    return out


# ---------------------------------------------------------------- apply


@dataclass
class RetentionReport:
    kept: list[int]
    deleted: list[int]
    failed: dict[int, str]
    not_counted: dict[str, str]  # directory name -> why it is neither kept nor deleted


def _is_committed(path: Path) -> str | None:
    """None if the quick check passes, else why not."""
    errors = [
        f for f in verify_step(path) if f.severity.value == "ERROR" and f.code != "unexpected-file"
    ]
    return errors[0].line() if errors else None


def check_step(path: Path) -> str | None:
    """None if ``path`` is a complete checkpoint, else why not. Never raises: a step that
    cannot even be checked (a link loop, an unreadable file) is one incomplete step."""
    try:
        return _is_committed(path)
    except Exception as exc:  # one bad step must never stop rotation of the whole root
        return f"could not be checked ({type(exc).__name__}: {str(exc)[:200]})"


def orphan_hint(path: Path, step: int, tracker: int | None, naming: _layout.StepNaming) -> str:
    """What to do with a complete step the tracker does not cover (the commands spelled out)."""
    where = "there is no tracker" if tracker is None else f"newer than the tracker ({tracker})"
    template = "" if naming.template == "step_{step:08d}" else f" --template '{naming.template}'"
    return (
        f"a complete checkpoint, {where}: never deleted by rotation or plain gc. Resume "
        f"from it with restore(path={str(path)!r}), point the tracker at it with "
        f"`ckptguard adopt {path.parent} {step}{template}`, or delete it with `ckptguard "
        f"gc {path.parent} --orphans{template}`"
    )


INCOMPLETE_HINT = (
    "inspect it with `ckptguard verify ROOT`; copy the missing files back (node-local storage "
    "keeps some on other nodes), or delete it by hand if it cannot be repaired"
)


def kept(
    committed: Sequence[int],
    policy: RetentionPolicy,
    *,
    tracker: int | None,
    protect: Iterable[int] = (),
) -> set[int]:
    """The committed steps a rotation keeps, on a directory root (``apply``) and on an object store
    (``_commit.storepublish.rotate``) alike: the policy's, the protected ones, and the tracker's
    step."""
    return policy.keep(committed) | set(protect) | ({tracker} if tracker is not None else set())


def apply(
    root: Path, naming: _layout.StepNaming, policy: RetentionPolicy, *, protect: Iterable[int] = ()
) -> RetentionReport:
    """Delete the committed steps ``policy`` drops. Committed means complete and covered by
    the tracker: without a tracker nothing is deleted, and a complete step newer than the
    tracker is an orphan that is reported, never deleted (the tracker may be the stale one)."""
    try:
        tracker = _layout.read_tracker(root)
    except CheckpointError as exc:
        return RetentionReport(
            [], [], {}, {_layout.TRACKER_NAME: f"{exc}; nothing is deleted until it is fixed"}
        )
    DELETER.submit(_trash_dirs(root))  # what a kill or a failed delete left, off the caller's path
    committed: list[int] = []
    not_counted: dict[str, str] = {}
    dirs = _layout.step_dirs(root, naming)
    for step, path in sorted(dirs.items()):
        if path.is_symlink():
            not_counted[path.name] = "a symlink; rotation never deletes through links"
            continue
        why = check_step(path)
        if why is not None:
            not_counted[path.name] = f"not a complete checkpoint ({why}); {INCOMPLETE_HINT}"
            continue
        if tracker is None or step > tracker:
            not_counted[path.name] = orphan_hint(path, step, tracker, naming)
            continue
        committed.append(step)
    try:
        verified = _trust.newest_verified(root, committed)
    except CheckpointError as exc:
        not_counted[_trust.TRUST_NAME] = f"{exc}; nothing is deleted until it is fixed"
        return RetentionReport(committed, [], {}, not_counted)
    pinned = {*protect, *holds(root, sweep=True), *([verified] if verified is not None else [])}
    keep = kept(committed, policy, tracker=tracker, protect=pinned)
    report = RetentionReport(
        kept=sorted(s for s in committed if s in keep),
        deleted=[],
        failed={},
        not_counted=not_counted,
    )
    moved: dict[int, Path] = {}
    for step in committed:
        if step in keep:
            continue
        # cheap: a rename; the manifest stays until no reader turned up meanwhile (_confirm_moved)
        try:
            moved[step] = _layout.uncommit_to_trash(dirs[step], keep_manifest=True)
        except OSError as exc:
            report.failed[step] = f"{type(exc).__name__}: {exc}"
            log.warning(
                "ckptguard: could not delete step %d at %s (%s); retried at the next save",
                step,
                dirs[step],
                exc,
            )
    report.deleted.extend(_confirm_moved(root, moved, dirs, report))
    trash = {moved[step]: f"step {step}" for step in report.deleted}
    DELETER.submit(trash, trash)
    return report


def _confirm_moved(
    root: Path, moved: dict[int, Path], dirs: dict[int, Path], report: RetentionReport
) -> list[int]:
    """The holds and reader leases again, after the renames: a reader whose lease landed between the
    first look and its step's rename (``open_step`` writes its lease, then checks the manifest) gets
    the step back, committed as before; the others lose their manifest and become plain trash.
    Returns the steps deleted."""
    late = holds(root) if moved else {}
    deleted = []
    for step, trash in sorted(moved.items()):
        if step in late:
            try:
                _layout.restore_from_trash(trash, dirs[step])
                report.kept.append(step)
            except OSError as exc:
                log.warning(
                    "ckptguard: step %d gained a reader (%s) while rotation moved it "
                    "aside, and could not be put back (%s); it is kept at %s, its manifest "
                    "intact: rename it back to %s",
                    step,
                    late[step],
                    exc,
                    trash,
                    dirs[step].name,
                )
            continue
        _layout.drop_manifest(trash)
        deleted.append(step)
    report.kept.sort()
    return deleted


# ---------------------------------------------------------------- background delete


def _trash_dirs(root: Path) -> list[Path]:
    """The trash an earlier kill or failed delete left: ckptguard's own (its owner record inside,
    which ``_delete`` removes last), never a directory that only looks like it, never a step moved
    aside whose manifest is still there (``moved_aside``)."""
    try:
        return [
            p
            for p in root.glob(f"{_layout.TRASH_PREFIX}*")
            if _layout.is_trash_dir(p)
            and (p / _layout.OWNER_NAME).is_file()
            and not _layout.moved_aside(p)
        ]
    except OSError:
        return []


def _delete(path: Path, what: str = "") -> None:
    if not _layout.is_trash_dir(path) or _layout.moved_aside(
        path
    ):  # never through a link, never a whole step
        return
    try:
        # the owner record last: a delete cut short stays recognisably ckptguard's trash
        # (``_trash_dirs``)
        for child in sorted(path.iterdir(), key=lambda c: c.name == _layout.OWNER_NAME):
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink(missing_ok=True)
        path.rmdir()
    except OSError as exc:
        log.warning(
            "ckptguard: could not delete %s%s (%s: %s); it is uncommitted (never resumed from), "
            "and the next save retries the delete",
            what or path,
            f" at {path}" if what else "",
            type(exc).__name__,
            exc,
        )


class Deleter:
    """Deletes trash directories on one daemon thread, started when there is work and gone when
    there is none. ``wait`` blocks until what was submitted is gone (tests, process exit)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._queue: list[tuple[Path, str]] = []
        self._pending: set[Path] = set()
        self._thread: threading.Thread | None = None

    def submit(self, paths: Iterable[Path], what: Mapping[Path, str] | None = None) -> None:
        """Delete ``paths`` (trash directories) in the background; ``what`` names them in a warning
        (``step 3``)."""
        with self._cv:
            for path in paths:
                if (
                    path not in self._pending
                ):  # a sweep finding a trash already queued must not delete it twice
                    self._pending.add(path)
                    self._queue.append((path, (what or {}).get(path, "")))
            if self._queue and self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="ckptguard-trash", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cv:
                if not self._queue:
                    self._thread = None
                    self._cv.notify_all()
                    return
                path, what = self._queue.pop(0)
            try:
                _delete(path, what)
            except Exception as exc:  # a delete must never kill the thread that deletes the rest
                log.warning(
                    "ckptguard: deleting %s failed (%s: %s); retried at the next save",
                    path,
                    type(exc).__name__,
                    exc,
                )
            with self._cv:
                self._pending.discard(path)
                self._cv.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """True once every submitted directory is deleted (or given up on), False on ``timeout``."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._pending, timeout)

    def _after_fork(self) -> None:
        # a forked child has no deleter thread: the parent's queue is the parent's to finish
        self._cv = threading.Condition()
        self._queue, self._pending, self._thread = [], set(), None


DELETER = Deleter()
os.register_at_fork(after_in_child=DELETER._after_fork)
# a process that exits right after a save still deletes what it dropped (as a synchronous delete
# did), within a bound; what is left after it is trash, swept by the next rotation or ``gc``
atexit.register(DELETER.wait, 60.0)
