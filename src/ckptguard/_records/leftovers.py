"""Crash leftovers in a root, as findings: temp directories, trash, temp files, lease take-over
markers, foreign temp-like entries and unreadable hold files (``ckptguard verify``, ``gc``).
"""

from __future__ import annotations

from pathlib import Path

from .._disk import layout as _layout
from .._disk import lease as _lease
from . import retention as _retention
from . import trust as _trust
from .findings import Finding, Severity


def leftover_findings(root: Path, *, max_age_s: float = 24 * 3600.0) -> list[Finding]:
    """A WARNING per crash leftover in ``root`` (temp directories, trash, temp files, lease
    take-over markers, foreign temp-like entries) and per unreadable hold file."""
    findings = []
    own = (_layout.TRACKER_NAME, _lease.LEASE_NAME, _trust.TRUST_NAME)
    for item in _layout.leftovers(root, max_age_s=max_age_s, tmp_files=own):
        if item.removable:
            fix = "`ckptguard gc ROOT` removes it"
        elif item.kind == "foreign":
            fix = "ckptguard never removes it; delete it by hand if it is yours and unneeded"
        else:
            fix = "if that process is a stuck save, stop it; `ckptguard gc ROOT` removes it once the owner is gone"
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
                    f"rewrite it with `ckptguard hold ROOT {step} --reason ...`, or `ckptguard release ROOT {step}`",
                )
            )
    return findings
