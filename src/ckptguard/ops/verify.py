"""Verify a written checkpoint without trusting it (the guide's rule 3.5).

Contract: ``verify_step`` returns findings, never raises on bad content. It reads the
manifest as JSON and DCP's ``.metadata`` only through the restricted unpickler; paths
from the manifest that are absolute, climb out with ``..`` or pass through a symlink
leaving the step directory are findings, and are never opened. A clean checkpoint
yields no ERROR finding. ``--deep`` adds every checksum; ``--restore`` (see
``_offline``) a real restore in a new process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from .._commit import checks as _checks
from .._commit import layout as _layout
from .._commit.checks import RESTORE_HINT, Finding, Severity, _err, cost, deep_bytes, safe_member, verify_step
from ..errors import CheckpointError

# The re-exported checks: ops.verify is where the CLI and users find them.
__all__ = ["RESTORE_HINT", "Finding", "Severity", "cost", "deep_bytes", "restore_check", "safe_member", "verify_root",
           "verify_step", "worst"]


def verify_root(
    root: Path, naming: _layout.StepNaming, *, deep: bool = False, progress: Callable[[int], None] | None = None
) -> tuple[list[Path], list[Finding]]:
    """(committed step directories checked, findings) for a whole root, tracker included."""
    findings: list[Finding] = []
    try:
        tracker = _layout.read_tracker(root)
    except CheckpointError as exc:
        return [], [_err("bad-tracker", root / _layout.TRACKER_NAME, str(exc), "fix or remove the tracker by hand")]
    dirs = _layout.step_dirs(root, naming)
    if tracker is None:
        if dirs:
            findings.append(
                _err(
                    "no-tracker",
                    root / _layout.TRACKER_NAME,
                    "is missing although steps exist",
                    "something outside ckptguard removed it; restore(path=...) the step you trust",
                )
            )
        return [], findings + _checks.leftover_findings(root)
    checked = []
    for step, path in sorted(dirs.items()):
        if path.is_symlink():
            findings.append(
                _err(
                    "symlink",
                    path,
                    "the step directory is a symlink",
                    "replace it with the real directory; ckptguard never reads or deletes through links",
                )
            )
            continue
        if step > tracker:
            findings.append(
                Finding(
                    Severity.WARNING,
                    "orphan",
                    str(path),
                    f"is newer than the tracker ({tracker}): a save died between publish and tracker",
                    "ignored for resume: resume from it with restore(path=...), point the tracker at it with "
                    "`ckptguard adopt ROOT STEP`, or delete it with `ckptguard gc ROOT --orphans`",
                )
            )
            continue
        checked.append(path)
        findings += verify_step(path, deep=deep, progress=progress)
    if tracker > 0 and tracker not in dirs:
        findings.append(
            _err(
                "tracker-target",
                root / _layout.TRACKER_NAME,
                f"points at step {tracker}, which does not exist",
                "restore the step directory, or restore(path=...) an older one",
            )
        )
    findings += _checks.leftover_findings(root)
    return checked, findings


def worst(findings: Iterable[Finding]) -> int:
    """Exit code: 1 if any ERROR finding, else 0."""
    return 1 if any(f.severity is Severity.ERROR for f in findings) else 0


def restore_check(step_dirs: Iterable[Path]) -> list[Finding]:
    """A real restore of each step in a new process; digests compared item by item."""
    import json
    import subprocess
    import sys

    from ._offline import compare

    findings = []
    for step_dir in step_dirs:
        proc = subprocess.run(
            [sys.executable, "-m", "ckptguard.ops._offline", str(step_dir)], capture_output=True, text=True
        )
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            findings.append(
                _err("restore-failed", step_dir, f"a restore in a new process failed: {tail}", RESTORE_HINT)
            )
            continue
        for problem in compare(step_dir, json.loads(proc.stdout)):
            findings.append(_err("digest-mismatch", step_dir, problem, RESTORE_HINT))
    return findings


