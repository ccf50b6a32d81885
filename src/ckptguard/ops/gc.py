"""Clean a checkpoint root of what crashes leave, without ever losing a checkpoint.

Contract: ``gc`` acts only on a root it can identify (a tracker or contract phase files) and only on
entries ckptguard created: its temp directories (named ``.tmp-<step>-<nonce>`` with an owner record)
once their owner is dead, its trash, the temp files of its atomic writes and stale lease take-over
markers. A step directory with a complete checkpoint is never removed, whatever the tracker says;
one newer than the tracker (or with no tracker) is reported with what to do, and removed only with
``orphans=True``; never one of per-node publish (node-local roots, a global manifest naming the
nodes), whose node's tracker may lag the step the other nodes' trackers agreed on (gc sees one
node). Anything else (a foreign directory, an incomplete step) is reported and left alone. It
refuses while a live run holds the root's lease unless ``force``. ``adopt_step`` points the tracker
at a verified orphan instead.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

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


@dataclass
class GcReport:
    removed: list[tuple[Path, str]] = field(default_factory=list)  # (path, what it was)
    kept: list[tuple[Path, str]] = field(
        default_factory=list
    )  # (path, why it stays and what to do)


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
    progress: Callable[[str, int, int], None] | None = None,
) -> GcReport:
    """Remove ckptguard's dead leftovers under ``root`` (and, with ``orphans``, the steps
    newer than the tracker); report everything else it finds. Returns what it did.

    ``progress(phase, done, total)``: after each step directory checked (``"check"``) and each
    entry removed (``"remove"``)."""
    root = Path(os.fspath(root)).absolute()
    identify(root)
    tracker = _layout.read_tracker(root)
    if orphans and tracker is None:
        raise ConfigError(
            f"gc --orphans: {root} has no tracker, so every step would look like an orphan; point "
            f"the tracker at the step you trust with `ckptguard adopt ROOT STEP` first"
        )
    if not (force or dry_run):
        _lease.check_idle(root, ttl_s=ttl_s)
    report = GcReport()
    victims: list[tuple[Path, str]] = []
    steps: set[Path] = set()  # victims that are step directories: uncommitted through the trash
    dirs = _layout.step_dirs(root, naming)
    verified = _trust.newest_verified(
        root, dirs
    )  # an unreadable trust record stops gc, naming the file
    readers = _readers.live(
        root, sweep=not dry_run
    )  # a step a live reader has open is never removed
    for done, (step, path) in enumerate(sorted(dirs.items()), 1):
        if progress is not None:
            progress("check", done, len(dirs))
        if path.is_symlink():
            report.kept.append(
                (path, "a symlink: never deleted through; replace it with the real directory")
            )
            continue
        if step in readers:
            report.kept.append((path, f"{readers[step]}: kept while that reader lease is live"))
            continue
        if not _has_manifest(path):
            report.kept.append(
                (
                    path,
                    "not created by ckptguard, or no longer recognisable (no "
                    "readable manifest.json): left alone; delete it by hand if you "
                    "know it is a checkpoint's remains",
                )
            )
            continue
        why = _retention.check_step(path)
        newer = tracker is None or step > tracker
        if newer and _per_node(path):
            # Node-local roots: the trackers move one node after another, so this node's may lag the
            # agreed step; removing it would take that node's part of the resume target away.
            report.kept.append((path, _per_node_hint(path, step, tracker, why, naming)))
        elif newer and orphans and step == verified:
            report.kept.append(
                (
                    path,
                    f"the newest verified step ({_trust.TRUST_NAME}): never removed by gc, "
                    "also not with --orphans; adopt it, or move it away by hand",
                )
            )
        elif newer and orphans:
            victims.append(
                (path, f"orphan step {step}, newer than the tracker ({tracker}); --orphans")
            )
            steps.add(path)
        elif newer and why is None:
            report.kept.append((path, _retention.orphan_hint(path, step, tracker, naming)))
        elif newer:
            report.kept.append(
                (
                    path,
                    f"incomplete ({why}), newer than the tracker; "
                    f"{_retention.INCOMPLETE_HINT}, or --orphans",
                )
            )
        elif why is not None:
            report.kept.append((path, f"incomplete ({why}); {_retention.INCOMPLETE_HINT}"))
    own_files = (_layout.TRACKER_NAME, _lease.LEASE_NAME, _trust.TRUST_NAME)
    for item in _leftovers.leftovers(root, max_age_s=max_age_s, tmp_files=own_files):
        if item.removable:
            victims.append((item.path, item.detail))
        elif item.kind == "foreign":
            report.kept.append((item.path, f"{item.detail}: left alone"))
        else:
            report.kept.append(
                (item.path, f"{item.detail}; gc removes it once that process has exited")
            )
    for marker, dead in _lease.leftover_markers(root):
        if dead:
            victims.append((marker, "a lease take-over marker whose writer is dead"))
    if dry_run:
        report.removed = victims
        return report
    for done, (path, what) in enumerate(victims, 1):
        if progress is not None:
            progress("remove", done, len(victims))
        if path in steps:
            _layout.remove_step_dir(path)
        elif path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, onerror=_gone_is_fine)
        else:
            path.unlink(missing_ok=True)
        report.removed.append((path, what))
    if victims:
        _layout.fsync_dir(root)
    return report


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
