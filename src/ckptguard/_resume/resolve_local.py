"""Which step a restore would load, and why, decided from what this rank sees on disk.

Contract: ``resolve_local`` reads the tracker and the step's commit marker and decides; it
raises ResumeError rather than guess (a guessed fresh start is never an outcome). It needs no
torch: ``ckptguard resolve``, ``list`` and ``preflight`` decide exactly as ``restore`` does
(``_resume.resolve.resolve`` agrees the decision across ranks) and start in well under a second.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from .._disk import layout as _layout
from .._records import manifest as _manifest
from .._records import trust as _trust
from ..config import ResumeMode
from ..errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    ResumeError,
    UnsafeCheckpointError,
)

__all__ = ["Resolution", "RootView", "resolve_local", "tracker_step"]


@dataclass(frozen=True)
class Resolution:
    """Which checkpoint a restore would load, and why."""

    step: int
    """The step to resume from (0 for a fresh start)."""
    path: Path | None
    """The committed step directory, or None for a fresh start."""
    reason: str
    """One sentence: why this step."""
    mode: ResumeMode
    url: str | None = None
    """Where the step is committed when that is not ``path`` (an object store's marker,
    ``s3://...``); ``path`` is then the staging directory a restore loads it into (downloaded there
    first)."""

    @property
    def fresh(self) -> bool:
        return self.path is None

    def describe(self) -> str:
        if self.fresh:
            return f"FRESH START at step 0: {self.reason}"
        where = f"{self.url} (into {self.path})" if self.url else str(self.path)
        return f"resume from step {self.step} at {where}: {self.reason}"


def resolve_local(
    root: Path,
    naming: _layout.StepNaming,
    mode: ResumeMode,
    path: Path | None,
    prefer: _trust.Prefer = _trust.Prefer.LATEST,
    *,
    read_manifest: Callable[[Path], Any] = _manifest.read,
) -> Resolution:
    """What this rank sees on disk; raises ResumeError rather than guessing.

    ``read_manifest`` reads a step's commit marker (an object with ``step``) or raises: a run of
    several roles passes its own, which also refuses a step missing a role (``ckptguard.run``)."""
    if path is not None:
        step_dir = Path(path)
        _layout.refuse_link(step_dir, "step directory")  # a link may lead outside every root
        if not step_dir.is_dir():
            raise CheckpointNotFoundError(
                f"restore(path={str(path)!r}): no such directory; pass a committed step directory"
            )
        manifest = read_manifest(step_dir)
        return Resolution(manifest.step, step_dir, "explicit path", mode)
    if mode is ResumeMode.NEVER:
        count = len(_layout.step_dirs(root, naming))
        return Resolution(
            0, None, f"ResumeMode.NEVER; {count} step directories under {root} ignored", mode
        )
    step, reason = tracker_step(_DirView(root, naming, read_manifest), mode)
    if step == 0:
        return Resolution(0, None, reason, mode)
    res = Resolution(step, root / naming.name(step), reason, mode)
    return (
        _prefer_verified(root, naming, res, read_manifest)
        if prefer is _trust.Prefer.VERIFIED
        else res
    )


class RootView(Protocol):
    """What the resume rule reads of a root: a directory (``_DirView``) or an object store's prefix
    (``_resume.storefetch``)."""

    where: str
    """The root as messages name it."""
    repair: str
    """What to do when the tracker's step is not committed (this kind of root's words)."""

    def exists(self) -> bool: ...

    def tracker(self) -> int | None: ...

    def uncommitted(self) -> list[int]:
        """The steps found without a tracker (a directory's step folders); [] where none can be."""
        ...

    def marker(self, step: int) -> int:
        """The step ``step``'s commit marker says; raises ``CheckpointError`` where there is none or
        it is unreadable, ``UnsafeCheckpointError`` where a link or a FIFO stands in its place."""
        ...


def tracker_step(view: RootView, mode: ResumeMode) -> tuple[int, str]:
    """The step the tracker names, its marker read (0: a fresh start), and why; raises ResumeError
    rather than guess, for every kind of root alike. ``mode`` is AUTO or MUST (MUST refuses a fresh
    start)."""
    must = mode is ResumeMode.MUST
    if not view.exists():
        if must:
            raise ResumeError(
                f"ResumeMode.MUST: checkpoint root {view.where} does not exist; "
                "check the path (it is never created by restore)"
            )
        return 0, (
            f"checkpoint root {view.where} does not exist (it was not created; "
            f"the first save creates it)"
        )
    tracker = view.tracker()
    if tracker is None:
        steps = view.uncommitted()
        if steps:
            raise ResumeError(
                f"{view.where} holds steps {steps[-3:]} but no tracker "
                f"{_layout.TRACKER_NAME}; ckptguard writes the tracker before any step, so "
                "something outside it removed the tracker or wrote these steps. Inspect the "
                "root, then restore(path=...) the step you trust or move the steps away."
            )
        if must:
            raise ResumeError(f"ResumeMode.MUST: {view.where} has no tracker and no checkpoint")
        return 0, f"{view.where} exists but holds no checkpoint and no tracker"
    if tracker == 0:
        if must:
            raise ResumeError(
                f"ResumeMode.MUST: the tracker in {view.where} says 0 (no step committed yet)"
            )
        try:
            steps = view.uncommitted()
        except (CheckpointError, OSError):  # only named here: a listing refused changes no decision
            steps = []
        orphans = f"; uncommitted steps {steps} are ignored" if steps else ""
        return 0, f"tracker in {view.where} says 0: fresh start declared by the first save{orphans}"
    try:
        committed = view.marker(tracker)
    except UnsafeCheckpointError:
        raise  # a link or a FIFO in place of the marker: refused as such, not as "not committed"
    except CheckpointError as exc:
        raise ResumeError(
            f"the tracker in {view.where} points at step {tracker}, but that step is not committed "
            f"({exc}). ckptguard never moves the tracker before the commit, so the step was "
            f"changed afterwards. {view.repair}"
        ) from exc
    if committed != tracker:
        raise ResumeError(
            f"the commit marker of step {tracker} under {view.where} says step {committed}, "
            f"and the tracker says {tracker}. {view.repair}"
        )
    return tracker, f"tracker {_layout.TRACKER_NAME} says {tracker}"


class _DirView:
    """A checkpoint root directory as the resume rule reads it."""

    repair = (
        "Restore the files (deleted, copied partially, a node-local disk?), or restore(path=...) "
        "an older committed step explicitly."
    )

    def __init__(self, root: Path, naming: _layout.StepNaming, read: Callable[[Path], Any]) -> None:
        self.root, self.naming, self.read, self.where = root, naming, read, str(root)

    def exists(self) -> bool:
        return self.root.exists()

    def tracker(self) -> int | None:
        return _layout.read_tracker(self.root)

    def uncommitted(self) -> list[int]:
        return sorted(_layout.step_dirs(self.root, self.naming))

    def marker(self, step: int) -> int:
        step_dir = self.root / self.naming.name(step)
        _layout.refuse_link(step_dir, f"step directory of the tracker's step {step}")
        return int(self.read(step_dir).step)


def _prefer_verified(
    root: Path,
    naming: _layout.StepNaming,
    res: Resolution,
    read_manifest: Callable[[Path], Any] = _manifest.read,
) -> Resolution:
    """prefer='verified': the newest verified committed step no newer than the tracker (module doc
    of trust)."""
    try:
        trust = _trust.read(root)
    except CheckpointCorruptError as exc:
        raise ResumeError(f"prefer='verified' under {root}: {exc}") from None
    for step in sorted((s for s in trust if s <= res.step), reverse=True):
        if _trust.state(trust[step]) is not _trust.Trust.VERIFIED:
            continue
        step_dir = root / naming.name(step)
        try:
            if step_dir.is_symlink() or read_manifest(step_dir).step != step:
                continue
        except CheckpointError:
            continue  # deleted or damaged since it was verified: the next older one
        newer = (
            ""
            if step == res.step
            else (
                f"; the tracker's step {res.step} and the steps between are not verified: resuming "
                f"here is a rollback (saving those steps again needs save(..., overwrite=True))"
            )
        )
        return Resolution(
            step,
            step_dir,
            f"prefer='verified': step {step} is the newest verified step{newer}",
            res.mode,
        )
    entry = trust.get(res.step)
    if entry is not None and entry.unhealthy_after is not None:
        raise ResumeError(
            f"prefer='verified' under {root}: no committed step is verified, and the tracker's "
            f"step {res.step} was followed by the unhealthy step {entry.unhealthy_after}. Restore "
            f"an older step with restore(path=...), or resume it anyway with prefer='latest'"
        )
    return Resolution(
        res.step,
        res.path,
        f"{res.reason}; prefer='verified': no step is verified yet, and no "
        f"unhealthy step followed step {res.step} ({_trust.describe(entry)})",
        res.mode,
    )
