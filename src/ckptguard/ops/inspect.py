"""What the CLI's reading commands ask of a root: resolve, list, the steps verify checks, holds.

Each function is what one command does, so ``cli.py`` only parses arguments and prints:
``resolve`` (which step a restore would load), ``list_steps`` (every step directory and its
state), ``verify_targets`` (a root's step directories or one step), ``state_bytes`` (what a
restore check reads), ``world_size`` (of a committed step), ``hold`` and ``release``.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .._disk import layout as _layout
from .._records import checks as _checks
from .._records import manifest as _manifest
from .._records import readers as _readers
from .._records import retention as _retention
from .._records import runmanifest as _runmanifest
from .._records import trust as _trust
from .._records.findings import Severity
from .._resume.resolve_local import Resolution, resolve_local
from ..config import ResumeMode
from ..errors import CheckpointError, ConfigError, ResumeError

__all__ = [
    "Listing",
    "StepEntry",
    "hold",
    "list_steps",
    "naming",
    "release",
    "resolve",
    "state_bytes",
    "tracker",
    "tracker_run_step",
    "verify_targets",
    "world_size",
]


def naming(template: str) -> _layout.StepNaming:
    """The step-directory naming of a ``--template`` (raises ConfigError for a bad one)."""
    return _layout.StepNaming(template)


def resolve(
    root: str | os.PathLike[str],
    template: str,
    mode: ResumeMode,
    path: str | os.PathLike[str] | None = None,
    prefer: str = "latest",
) -> Resolution:
    """Which step a restore under ``root`` would load, and why, decided as ``restore`` decides: the
    step's files are checked as restore checks them before it reads (present, sizes, shard set,
    paths), so a step restore would refuse is refused here too (ResumeError), never announced."""
    root = Path(root)
    path = Path(path) if path is not None else None
    root = root.absolute()
    steps = naming(template)
    if path is None and mode is not ResumeMode.NEVER and _layout.read_tracker(root) is None:
        dirs = _layout.step_dirs(root, steps)
        # the core's message blames "something outside ckptguard"; a killed transfer does this too
        if dirs:
            raise ResumeError(
                f"{root} holds step directories {sorted(dirs)[-3:]} but no tracker "
                f"{_layout.TRACKER_NAME}. A `ckptguard transfer` into this root that was killed "
                f"before its last step leaves exactly this: run the same transfer again (it "
                f"finishes the copy and sets the tracker). Otherwise something outside ckptguard "
                f"removed the tracker or wrote these steps: inspect the root, then "
                f"restore(path=...) the step you trust or `ckptguard adopt ROOT STEP` it"
            )
    res = resolve_local(
        root,
        steps,
        mode,
        path,
        _trust.as_prefer(prefer, "--prefer"),
        read_manifest=_checks.read_any,
    )
    if res.path is not None:
        errors = [
            f
            for f in _checks.verify_step(res.path)
            if f.severity is Severity.ERROR and f.code != "unexpected-file"
        ]
        if errors:
            raise ResumeError(
                f"a restore would refuse step {res.step} at {res.path} "
                f"({res.reason}): {errors[0].line()}"
                + (
                    f" (and {len(errors) - 1} more: `ckptguard verify {res.path}`)"
                    if len(errors) > 1
                    else ""
                )
            )
    return res


@dataclass(frozen=True)
class StepEntry:
    step: int | None  # None: a temp directory
    state: str
    name: str
    trust: str | None = None  # committed and orphan steps: candidate / verified, with why
    held: str | None = None  # the reason of its hold (``ckptguard hold``): rotation and gc keep it


@dataclass(frozen=True)
class Listing:
    tracker: int | None
    entries: list[StepEntry]


def list_steps(root: str | os.PathLike[str], template: str) -> Listing:
    """Every step directory under ``root`` (committed, orphan, not committed) and the temp
    directories."""
    root = Path(root)
    steps = naming(template)
    tracker = _layout.read_tracker(root)
    try:
        trust: dict[int, _trust.TrustEntry] | None = _trust.read(root)
        unreadable = ""
    except CheckpointError as exc:
        trust, unreadable = None, f"unknown ({str(exc).split(';')[0]})"
    unheld: str | None = None
    try:
        held = _retention.holds(root)
    except (
        CheckpointError
    ) as exc:  # a linked holds/ directory: said on every step rather than hidden
        held, unheld = {}, f"unknown ({str(exc).split(';')[0]})"
    entries = []
    for step, path in sorted(_layout.step_dirs(root, steps).items()):
        trusted = None
        if path.is_symlink():
            state = "NOT committed: a symlink (never read through)"
        else:
            try:
                found = _checks.read_any(path)
                state = (
                    "committed"
                    if tracker is not None and step <= tracker
                    else "orphan (newer than tracker)"
                )
                damaged = _checks.step_problem(path, step, found)
                if damaged:  # restore would refuse it: never listed as committed
                    state = f"NOT usable: {damaged}"
                trusted = _trust.describe(trust.get(step)) if trust is not None else unreadable
                if isinstance(found, _runmanifest.RunManifest):
                    state += f" (run step: {', '.join(sorted(found.roles))})"
            except CheckpointError as exc:
                state = f"NOT committed: {str(exc).split(';')[0]}"
        entries.append(StepEntry(step, state, path.name, trusted, held.get(step, unheld)))
    entries += [
        StepEntry(None, "in flight or abandoned", tmp.name) for tmp in sorted(root.glob(".tmp-*"))
    ]
    return Listing(tracker, entries)


def verify_targets(path: str | os.PathLike[str], template: str) -> tuple[bool, list[Path]]:
    """(is a root, the step directories ``verify PATH`` checks)."""
    path = Path(path)
    steps = naming(template)
    is_root = not (path / _layout.MANIFEST_NAME).exists() and steps.parse(path.name) is None
    return is_root, (list(_layout.step_dirs(path, steps).values()) if is_root else [path])


def state_bytes(step_dirs: Sequence[str | os.PathLike[str]]) -> int:
    """Bytes of tensor state a restore check of these steps reads (for its progress bar)."""
    total = 0
    for p in map(Path, step_dirs):
        with contextlib.suppress(CheckpointError):
            total += sum(f.size for f in _manifest.read(p).files if f.path.startswith("state/"))
    return total


def world_size(step_dir: str | os.PathLike[str]) -> int:
    """The saved world size of a committed step (a run step: of the whole run)."""
    step_dir = Path(step_dir)
    return int(_checks.read_any(step_dir).world_size)


def hold(
    root: str | os.PathLike[str], template: str, step: int, reason: str, ttl_s: float | None = None
) -> Path:
    """Pin a committed step against rotation; refuses a step that is not committed. With ``ttl_s``,
    a reader lease that expires after it (the same reason renews it) instead of a hold kept until
    released."""
    root = Path(root)
    steps = naming(template)
    where = root / steps.name(step)
    if not os.path.lexists(where):  # not a step that died before its commit: there is none
        found = sorted(_layout.step_dirs(root, steps))
        raise ConfigError(
            f"step {step} has no directory under {root} ({where.name} is absent; "
            f"the step directories there: {found[-10:] or 'none'}, the tracker "
            f"says {_layout.read_tracker(root)}): name a committed step "
            f"(`ckptguard list ROOT` shows them)"
        )
    _checks.read_any(where)
    if step > (_layout.read_tracker(root) or 0):
        raise ConfigError(f"step {step} is newer than the tracker: not committed")
    if ttl_s is not None:
        return _readers.acquire(root, step, ttl_s=ttl_s, who=reason, bind_process=False, key=reason)
    return _retention.hold(root, step, reason)


def release(root: str | os.PathLike[str], step: int) -> bool:
    """Remove the hold on ``step`` and its leases taken with ``hold --ttl``; True if there was
    one."""
    root = Path(root)
    leases = _readers.release_ttl(root, step)
    return _retention.release(root, step) or leases > 0


def level(path: str | os.PathLike[str]) -> str | None:
    """``"step"`` for a step directory (its manifest, no tracker), ``"root"`` for a checkpoint root
    (its tracker, no manifest), else None: what a command told the wrong one of the two says instead
    of a verdict."""
    path = Path(path)
    manifest, tracked = (
        (path / _layout.MANIFEST_NAME).is_file(),
        (path / _layout.TRACKER_NAME).is_file(),
    )
    return "step" if manifest and not tracked else "root" if tracked and not manifest else None


def tracker(root: str | os.PathLike[str]) -> int | None:
    """The tracker's step (None: no tracker); raises for an unreadable one."""
    root = Path(root)
    return _layout.read_tracker(root)


_TRAILING = re.compile(r".*?(\d+)\Z")


def tracker_run_step(root: str | os.PathLike[str]) -> Path | None:
    """The tracker's step directory when it is a run step (any naming template), else None."""
    root = Path(root)
    try:
        tracker = _layout.read_tracker(root)
    except (CheckpointError, OSError):
        return None
    if not tracker:
        return None
    for entry in sorted(root.iterdir()) if root.is_dir() else []:
        match = _TRAILING.match(entry.name)
        if (
            entry.name.startswith(".")
            or match is None
            or int(match.group(1)) != tracker
            or entry.is_symlink()
        ):
            continue
        try:
            if entry.is_dir() and _runmanifest.read(entry).step == tracker:
                return entry
        except (CheckpointError, OSError):
            continue
    return None
