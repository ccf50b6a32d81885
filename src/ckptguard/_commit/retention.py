"""Rotation that never deletes the checkpoint you need (the guide's rule 7).

Contract: policies are pure functions of the committed steps found on disk, so a restart
rebuilds the same decision (no in-memory list to lose). A directory is deleted only if it
is committed (manifest, shard set and sizes check out), is not the tracker's target, not
protected by the caller (the step being restored or written) and not held. Corrupt and
orphan directories are never counted among the kept ones and are removed only by ``gc``.
Deletion removes the manifest first, so a half-deleted directory never looks committed.
A failed delete is reported and retried at the next run; it never raises into training.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ..errors import ConfigError
from . import layout as _layout

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
            raise ConfigError(f"KeepLast(n={self.n!r}): n must be an int >= 1 (the newest step is always kept)")

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
    _layout.refuse_link(directory, "holds directory")
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{step}.json"
    _layout.atomic_write_json(path, {"step": step, "reason": reason, "created_unix": time.time()})
    return path


def release(root: Path, step: int) -> bool:
    path = root / HOLDS_DIR / f"{step}.json"
    if not path.exists():
        return False
    path.unlink()
    return True


def holds(root: Path) -> dict[int, str]:
    out = {}
    _layout.refuse_link(root / HOLDS_DIR, "holds directory")
    for path in (root / HOLDS_DIR).glob("*.json"):
        try:
            data = _layout.read_json(path, what="hold record")
            out[int(data["step"])] = str(data.get("reason", ""))
        except (OSError, ValueError, KeyError, TypeError):
            log.warning("ckptguard: unreadable hold file %s is treated as holding nothing; fix or remove it", path)
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
    from .checks import verify_step

    errors = [f for f in verify_step(path) if f.severity.value == "ERROR" and f.code != "unexpected-file"]
    return errors[0].line() if errors else None


def apply(
    root: Path, naming: _layout.StepNaming, policy: RetentionPolicy, *, protect: Iterable[int] = ()
) -> RetentionReport:
    tracker = _layout.read_tracker(root) or 0
    for path in _layout.empty_trash(root):
        log.warning("ckptguard: %s could not be deleted yet; retried at the next save", path)
    committed: list[int] = []
    not_counted: dict[str, str] = {}
    dirs = _layout.step_dirs(root, naming)
    for step, path in sorted(dirs.items()):
        if path.is_symlink():
            not_counted[path.name] = "a symlink; rotation never deletes through links"
            continue
        if step > tracker:
            not_counted[path.name] = f"orphan newer than the tracker ({tracker}); `ckptguard gc` removes it"
            continue
        why = _is_committed(path)
        if why is not None:
            not_counted[path.name] = f"not a complete checkpoint ({why}); `ckptguard gc` removes it"
            continue
        committed.append(step)
    keep = policy.keep(committed) | {tracker} | set(protect) | set(holds(root))
    report = RetentionReport(
        kept=sorted(s for s in committed if s in keep), deleted=[], failed={}, not_counted=not_counted
    )
    for step in committed:
        if step in keep:
            continue
        try:
            _layout.remove_step_dir(dirs[step])
            report.deleted.append(step)
        except OSError as exc:
            report.failed[step] = f"{type(exc).__name__}: {exc}"
            log.warning(
                "ckptguard: could not delete step %d at %s (%s); retried at the next save", step, dirs[step], exc
            )
    return report


def gc(root: Path, naming: _layout.StepNaming, *, dry_run: bool = False, max_age_s: float = 24 * 3600.0) -> list[Path]:
    """Remove what rotation never touches: orphans, uncommitted step dirs, dead temp dirs."""
    tracker = _layout.read_tracker(root) or 0
    victims = []
    for step, path in sorted(_layout.step_dirs(root, naming).items()):
        if path.is_symlink():
            continue  # never delete through a link
        if step > tracker or not (path / _layout.MANIFEST_NAME).exists():
            victims.append(path)
    victims += [
        p
        for p in sorted(root.glob(f"{_layout.TMP_PREFIX}*"))
        if p.is_dir() and not p.is_symlink() and _layout.owner_is_dead(p, max_age_s=max_age_s)
    ]
    if not dry_run:
        for path in victims:
            if (path / _layout.MANIFEST_NAME).exists():
                _layout.remove_step_dir(path)
            else:
                shutil.rmtree(path)
        if victims:
            _layout.fsync_dir(root)
    return victims
