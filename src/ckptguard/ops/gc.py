"""Clean a checkpoint root of what crashes leave, without ever losing a checkpoint.

One procedure for every root kind (``collect``): identify the root, refuse while a live run holds
its lease (unless ``force``), survey what the root kind finds, remove what the survey calls
removable and report the rest with what to do. A root kind (``GcRoot``) says what it finds and how
an entry is removed: a directory root here, an object store's prefix in ``ops.storegc``. Whether a
writer is gone is one rule for both (``_disk.tempfiles.writer_gone``).

A directory root (``gc``): gc acts only on a root it can identify (a tracker or contract phase
files) and only on entries ckptguard created: its temp directories (named ``.tmp-<step>-<nonce>``
with an owner record) once their owner is dead, its trash, the temp files of its atomic writes and
stale lease take-over markers. A step directory with a complete checkpoint is never removed,
whatever the tracker says; one newer than the tracker (or with no tracker) is reported with what to
do, and removed only with ``orphans=True``; never one of per-node publish (node-local roots, a
global manifest naming the nodes), whose node's tracker may lag the step the other nodes' trackers
agreed on (gc sees one node). Anything else (a foreign directory, an incomplete step) is reported
and left alone. ``adopt_step`` points the tracker at a verified orphan instead.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from .._disk import layout as _layout
from .._disk import lease as _lease
from .._records import contract as _contract
from .._records import leftovers as _leftovers
from .._records import manifest as _manifest
from .._records import readers as _readers
from .._records import retention as _retention
from .._records import trust as _trust
from .._records.checks import verify_step
from ..errors import CheckpointCorruptError, ConfigError, RunStepError

LEASE_TTL_S = 6 * 3600.0
STALE_TEMP_AGE_S = 24 * 3600.0


Where = Path | str
"""A path under a directory root, or an object's (or attempt's) URL under an object store's root."""
Progress = Callable[[str, int, int], None]
"""``progress(phase, done, total)``: after each unit the survey checks, the phase naming them
(``"steps"`` for a directory root's step directories, ``"attempts"`` for an object store's), and
after each entry removed (``"remove"``)."""


@dataclass
class GcReport:
    removed: list[tuple[Where, str]] = field(default_factory=list)  # (where, what it was)
    kept: list[tuple[Where, str]] = field(default_factory=list)  # (where, why and what to do)


@dataclass(frozen=True)
class Found:
    """An entry a root kind's survey found: removable, or kept with why and what to do."""

    where: Where
    note: str
    removable: bool
    handle: object = None
    """What the root kind needs to remove it (a step directory's flag, an attempt's keys)."""


STEP_DIR = object()
"""A directory root's ``Found.handle`` for a step directory (removed through the trash)."""


class GcRoot(Protocol):
    """What gc needs of a root kind."""

    def identify(self) -> None:
        """Raise ConfigError unless this is a ckptguard root (a CheckpointError where it is one gc
        must not touch now, such as an object store whose tracker's marker is missing)."""

    def check_orphans(self) -> None:
        """Raise ConfigError where ``orphans`` cannot be honoured."""

    def check_idle(self) -> None:
        """Raise LeaseHeldError while a live run holds the root's lease."""

    def survey(self, *, orphans: bool, dry_run: bool, progress: Progress | None) -> list[Found]:
        """Every entry gc has a word for; ``dry_run``: read only (no reader-lease sweep)."""

    def remove(self, found: Found) -> str | None:
        """Remove one removable entry (an entry already gone is fine); or, where it changed since
        the survey so that it must stay, say why (it is then reported as kept)."""

    def finish(self) -> None:
        """After the last removal (a directory's fsync)."""


def collect(
    target: GcRoot,
    *,
    dry_run: bool = False,
    orphans: bool = False,
    force: bool = False,
    progress: Progress | None = None,
) -> GcReport:
    """The one gc procedure over any root kind; returns what it removed (or, ``dry_run``, would
    remove) and what it kept. Entries are removed in the order the survey found them (an object
    store's survey lists an attempt's multipart uploads before the attempt, so an interrupted gc
    never leaves an upload whose owner record is gone)."""
    target.identify()
    if orphans:
        target.check_orphans()
    if not (force or dry_run):
        target.check_idle()
    report = GcReport()
    victims = []
    for found in target.survey(orphans=orphans, dry_run=dry_run, progress=progress):
        if found.removable:
            victims.append(found)
        else:
            report.kept.append((found.where, found.note))
    if dry_run:
        report.removed = [(f.where, f.note) for f in victims]
        return report
    for done, found in enumerate(victims, 1):
        if progress is not None:
            progress("remove", done, len(victims))
        if (why := target.remove(found)) is None:
            report.removed.append((found.where, found.note))
        else:
            report.kept.append((found.where, why))
    if victims:
        target.finish()
    return report


def identify(root: str | os.PathLike[str]) -> None:
    """Raise ConfigError unless ``root`` is a checkpoint root ckptguard wrote."""
    root = Path(os.fspath(root))
    tracker = root / _layout.TRACKER_NAME
    if tracker.exists() or tracker.is_symlink() or _contract.phase_files(root):
        return
    raise ConfigError(
        f"{root} is not a checkpoint root: it has neither a tracker "
        f"({_layout.TRACKER_NAME}) nor {_layout.CONTRACT_DIR}/phase_*.json files. gc acts "
        f"only on roots ckptguard wrote, and removed nothing; pass the directory the run "
        f"saves to (the root given to CheckpointManager)."
    )


def _has_manifest(path: Path) -> bool:
    try:
        _manifest.read(path)
    except RunStepError:  # a RunCheckpoint step: ckptguard's if its run manifest reads
        return _has_run_manifest(path)
    except Exception:  # any unreadable manifest: gc cannot tell this directory is ckptguard's
        return False
    return True


def _has_run_manifest(path: Path) -> bool:
    from .._records import runmanifest

    try:
        runmanifest.read(path)
    except Exception:
        return False
    return True


def _per_node(path: Path) -> bool:
    """A step published by per-node publish (node-local roots): its global manifest names the
    nodes."""
    try:
        return bool(_manifest.read(path).nodes)
    except Exception:  # not a per-node step (or unreadable: handled as before)
        return False


def _per_node_hint(
    path: Path, step: int, tracker: int | None, why: str | None, naming: _layout.StepNaming
) -> str:
    state = (
        "this node's part is complete" if why is None else f"this node's part is incomplete ({why})"
    )
    where = (
        "this node's root has no tracker"
        if tracker is None
        else f"this node's tracker is at {tracker}"
    )
    template = "" if naming.template == "step_{step:08d}" else f" --template '{naming.template}'"
    return (
        f"step {step} was published on this node by a per-node save (node-local roots; {state}), "
        f"and {where}. Its global manifest is written only after every node confirmed its part, so "
        f"another node's tracker may already be at step {step}: a restore then agrees on step "
        f"{step} on every node, this one included. gc sees one node only and never removes it, "
        f"also not with --orphans; the next save removes it where no node's tracker reached step "
        f"{step}. Where the other nodes' trackers are at step {step}, `ckptguard adopt "
        f"{path.parent} {step}{template}` moves this node's tracker there too"
        + ("" if why is None else f"; {_retention.INCOMPLETE_HINT}")
    )


def gc(
    root: str | os.PathLike[str],
    naming: _layout.StepNaming,
    *,
    dry_run: bool = False,
    orphans: bool = False,
    force: bool = False,
    max_age_s: float = STALE_TEMP_AGE_S,
    ttl_s: float = LEASE_TTL_S,
    progress: Progress | None = None,
) -> GcReport:
    """``collect`` on a directory root: remove ckptguard's dead leftovers under ``root`` (and, with
    ``orphans``, the steps newer than the tracker); report everything else it finds."""
    target = DirRoot(Path(os.fspath(root)).absolute(), naming, max_age_s=max_age_s, ttl_s=ttl_s)
    return collect(target, dry_run=dry_run, orphans=orphans, force=force, progress=progress)


class DirRoot:
    """A directory root as gc sees it (``GcRoot``)."""

    def __init__(
        self, root: Path, naming: _layout.StepNaming, *, max_age_s: float, ttl_s: float
    ) -> None:
        self.root, self.naming, self.max_age_s, self.ttl_s = root, naming, max_age_s, ttl_s

    def identify(self) -> None:
        identify(self.root)

    def check_orphans(self) -> None:
        if _layout.read_tracker(self.root) is None:
            raise self._no_tracker()

    def _no_tracker(self) -> ConfigError:
        return ConfigError(
            f"gc --orphans: {self.root} has no tracker, so every step would look like an "
            f"orphan; point the tracker at the step you trust with `ckptguard adopt ROOT STEP` "
            f"first"
        )

    def check_idle(self) -> None:
        _lease.check_idle(self.root, ttl_s=self.ttl_s)

    def survey(self, *, orphans: bool, dry_run: bool, progress: Progress | None) -> list[Found]:
        root, naming = self.root, self.naming
        tracker = _layout.read_tracker(root)  # read once: every step's verdict is against it
        if orphans and tracker is None:  # gone since check_orphans: every step would be an orphan
            raise self._no_tracker()  # judged on this read, not on another one
        out: list[Found] = []
        dirs = _layout.step_dirs(root, naming)
        # an unreadable trust record stops gc, naming the file
        verified = _trust.newest_verified(root, dirs)
        # a step a live reader has open is never removed
        readers = _readers.live(root, sweep=not dry_run)
        for done, (step, path) in enumerate(sorted(dirs.items()), 1):
            if progress is not None:
                progress("steps", done, len(dirs))
            if path.is_symlink():
                out.append(
                    Found(
                        path,
                        "a symlink: never deleted through; replace it with the real directory",
                        False,
                    )
                )
                continue
            if step in readers:
                out.append(
                    Found(path, f"{readers[step]}: kept while that reader lease is live", False)
                )
                continue
            if not _has_manifest(path):
                out.append(
                    Found(
                        path,
                        "not created by ckptguard, or no longer recognisable (no readable "
                        "manifest.json): left alone; `ckptguard verify ROOT` says what is wrong "
                        "with it; delete it by hand if you know it is a checkpoint's remains",
                        False,
                    )
                )
                continue
            out += self._step(path, step, tracker, verified, orphans)
        out += _not_dirs(root, naming)
        own_files = (_layout.TRACKER_NAME, _lease.LEASE_NAME, _trust.TRUST_NAME)
        for item in _leftovers.leftovers(root, max_age_s=self.max_age_s, tmp_files=own_files):
            if item.removable:
                out.append(Found(item.path, item.detail, True))
            elif item.kind == "foreign":
                out.append(Found(item.path, f"{item.detail}: left alone", False))
            else:
                out.append(
                    Found(
                        item.path,
                        f"{item.detail}; gc removes it once that process has exited",
                        False,
                    )
                )
        for marker, dead in _lease.leftover_markers(root):
            if dead:
                out.append(Found(marker, "a lease take-over marker whose writer is dead", True))
        return out

    def _step(
        self, path: Path, step: int, tracker: int | None, verified: int | None, orphans: bool
    ) -> list[Found]:
        why = _retention.check_step(path)
        newer = tracker is None or step > tracker
        if newer and _per_node(path):
            # Node-local roots: the trackers move one node after another, so this node's may lag
            # the agreed step; removing it would take that node's part of the resume target away.
            return [Found(path, _per_node_hint(path, step, tracker, why, self.naming), False)]
        if newer and orphans and step == verified:
            note = (
                f"the newest verified step ({_trust.TRUST_NAME}): never removed by gc, also not "
                "with --orphans; adopt it, or move it away by hand"
            )
            return [Found(path, note, False)]
        if newer and orphans:
            note = f"orphan step {step}, newer than the tracker ({tracker}); --orphans"
            return [Found(path, note, True, handle=STEP_DIR)]
        if newer and why is None:
            return [Found(path, _retention.orphan_hint(path, step, tracker, self.naming), False)]
        if newer:
            note = (
                f"incomplete ({why}), newer than the tracker; {_retention.INCOMPLETE_HINT}, or "
                "--orphans"
            )
            return [Found(path, note, False)]
        if why is not None:
            return [Found(path, f"incomplete ({why}); {_retention.INCOMPLETE_HINT}", False)]
        return []

    def remove(self, found: Found) -> str | None:
        path = Path(found.where)
        if found.handle is STEP_DIR:  # uncommitted through the trash, as rotation does
            _layout.remove_step_dir(path)
        elif found.handle is not None:
            raise TypeError(f"gc of {self.root}: no way to remove {path} ({found.handle!r})")
        elif path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, onerror=_gone_is_fine)
        else:
            path.unlink(missing_ok=True)
        return None

    def finish(self) -> None:
        _layout.fsync_dir(self.root)


def _not_dirs(root: Path, naming: _layout.StepNaming) -> list[Found]:
    """Entries with a step's name that are not directories: said, never touched (a step
    directory's name on a file is no checkpoint ckptguard wrote, and is easily missed)."""
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError:
        return []
    note = "a step's name on something that is not a directory: not ckptguard's; left alone"
    return [
        Found(Path(e.path), note, False)
        for e in entries
        if naming.parse(e.name) is not None and not e.is_dir()
    ]


def _gone_is_fine(
    func: object, path: str, exc_info: tuple[type[BaseException], BaseException, object]
) -> None:
    """rmtree's error handler: an entry someone else removed meanwhile is what was wanted (a job's
    background trash delete, retention.DELETER, empties the same trash directory gc found); any
    other failure raises."""
    if not isinstance(exc_info[1], FileNotFoundError):
        raise exc_info[1]


def adopt_step(
    root: str | os.PathLike[str],
    naming: _layout.StepNaming,
    step: int,
    *,
    ttl_s: float = LEASE_TTL_S,
) -> str:
    """Point the tracker of ``root`` at ``step`` after verifying it with checksums: for a
    complete orphan (a save that died before its tracker, or a root whose tracker was lost).
    The tracker only moves forward; the root's lease is taken while it moves."""
    root = Path(os.fspath(root)).absolute()
    identify(root)
    path = root / naming.name(step)
    if path.is_symlink() or not path.is_dir():
        raise ConfigError(f"adopt: {path} is not a step directory (absent or a symlink)")
    errors = [
        f
        for f in verify_step(path, deep=True)
        if f.severity.value == "ERROR" and f.code != "unexpected-file"
    ]
    if errors:
        raise CheckpointCorruptError(
            f"adopt: {path} is not a complete checkpoint, the tracker stays where "
            f"it is: {errors[0].line()}"
        )
    _contract.check_chain(root, _manifest.read(path).chain_id, where=f"adopt of step {step}")
    tracker = _layout.read_tracker(root)
    if tracker is not None and step <= tracker:
        raise ConfigError(
            f"adopt: the tracker of {root} is at step {tracker}; moving it back to {step} "
            f"would orphan the newer steps. To resume from step {step}, "
            f"restore(path={str(path)!r}) instead"
        )
    _lease.acquire(root, ttl_s=ttl_s)
    try:
        _layout.write_tracker(root, step)
    finally:
        _lease.release(root)
    was = "absent" if tracker is None else f"step {tracker}"
    return f"the tracker of {root} now points at step {step} (was {was}); a restore resumes from it"
