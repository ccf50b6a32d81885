"""Crash leftovers in a root (``leftovers``: temp directories, trash, temp files, each with what
``gc`` does with it) and as findings, with lease take-over markers, foreign temp-like entries and
unreadable hold files (``ckptguard verify``, ``gc``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .._disk import layout as _layout
from .._disk import lease as _lease
from .._disk import tempfiles as _tempfiles
from . import retention as _retention
from . import trust as _trust
from .findings import Finding, Severity


def leftover_findings(root: Path, *, max_age_s: float = 24 * 3600.0) -> list[Finding]:
    """A WARNING per crash leftover in ``root`` (temp directories, trash, temp files, lease
    take-over markers, foreign temp-like entries) and per unreadable hold file."""
    findings = []
    own = (_layout.TRACKER_NAME, _lease.LEASE_NAME, _trust.TRUST_NAME)
    for item in leftovers(root, max_age_s=max_age_s, tmp_files=own):
        if item.removable:
            fix = "`ckptguard gc ROOT` removes it"
        elif item.kind == "foreign":
            fix = "ckptguard never removes it; delete it by hand if it is yours and unneeded"
        else:
            fix = (
                "if that process is a stuck save, stop it; `ckptguard gc ROOT` removes it once "
                "the owner is gone"
            )
        code = "foreign-entry" if item.kind == "foreign" else item.kind
        findings.append(Finding(Severity.WARNING, code, str(item.path), item.detail, fix))
    for marker, dead in _lease.leftover_markers(root):
        if dead:
            findings.append(
                Finding(
                    Severity.WARNING,
                    "takeover-marker",
                    str(marker),
                    "a lease take-over marker whose writer is dead",
                    "`ckptguard gc ROOT` removes it; the next take-over also steps past it",
                )
            )
    for step, reason in sorted(_retention.holds(root).items()):
        if reason.startswith("UNREADABLE"):
            findings.append(
                Finding(
                    Severity.WARNING,
                    "bad-hold",
                    str(root / _retention.HOLDS_DIR / f"{step}.json"),
                    f"cannot be read, so step {step} stays held",
                    f"rewrite it with `ckptguard hold ROOT {step} --reason ...`, or "
                    f"`ckptguard release ROOT {step}`",
                )
            )
    return findings


@dataclass(frozen=True)
class Leftover:
    """An entry a crash left in the root: what it is, and whether ``gc`` may remove it."""

    path: Path
    kind: str  # temp-dir, trash, temp-file, foreign
    removable: bool
    detail: str


def _count_files(path: Path, *, limit: int = 100_000) -> str:
    n = 0
    for _dirpath, _dirs, files in os.walk(path, followlinks=False):
        n += len(files)
        if n >= limit:
            return f"{limit}+ files"
    return f"{n} files"


def leftovers(
    root: Path, *, max_age_s: float, tmp_files: tuple[str, ...] = (_layout.TRACKER_NAME,)
) -> list[Leftover]:
    """Temp directories, trash and temp files under ``root``, each with what ``gc`` does with it."""
    out: list[Leftover] = []
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError:
        return out
    for entry in entries:
        path = Path(entry.path)
        if entry.name.startswith(_layout.TMP_PREFIX):
            if not _layout.is_own_temp_dir(path):
                out.append(
                    Leftover(path, "foreign", False, "not created by ckptguard (no such temp name)")
                )
                continue
            state = _layout.owner_state(path, max_age_s=max_age_s)
            who = _layout.describe_owner(path)
            if state == "dead":
                out.append(
                    Leftover(
                        path,
                        "temp-dir",
                        True,
                        f"a save's temp directory whose owner ({who}) is dead",
                    )
                )
            elif state == "alive":
                out.append(
                    Leftover(
                        path,
                        "temp-dir",
                        False,
                        f"a save's temp directory whose owner ({who}) is alive: a save in flight, "
                        f"or one that timed out and left it",
                    )
                )
            else:
                out.append(
                    Leftover(path, "foreign", False, "not created by ckptguard (no owner record)")
                )
        elif entry.name.startswith(_layout.TRASH_PREFIX) and _layout.moved_aside(path):
            name = entry.name[len(_layout.TRASH_PREFIX) :].rsplit("-", 1)[0]
            out.append(
                Leftover(
                    path,
                    "moved-aside",
                    False,
                    f"a committed step moved aside by an overwrite or a rotation that did not "
                    f"finish (its manifest is still there): if no {name} exists and the tracker "
                    f"names its step, rename it back to {name}; else delete it by hand",
                )
            )
        elif entry.name.startswith(_layout.TRASH_PREFIX) and _layout.is_trash_dir(path):
            live = (
                _layout.owner_state(path, max_age_s=max_age_s) == "alive"
            )  # retention deletes it in the background
            out.append(
                Leftover(
                    path,
                    "trash",
                    True,
                    f"a step being deleted ({_count_files(path)}), "
                    + (
                        f"by a live process ({_layout.describe_owner(path)})"
                        if live
                        else "interrupted"
                    ),
                )
            )
        elif any(
            _layout.is_temp_file(path, of=name) for name in tmp_files
        ) or _tempfiles.is_temp_file(path):
            dead = _tempfiles.owner_state(path, max_age_s=max_age_s) != "alive"
            who = _tempfiles.describe_owner(path)
            out.append(
                Leftover(
                    path,
                    "temp-file",
                    dead,
                    f"a temporary file of an atomic write ({who}) that "
                    + (
                        "crashed before its rename"
                        if dead
                        else "is in flight: its writer still runs"
                    ),
                )
            )
    return out
