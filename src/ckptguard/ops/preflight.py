"""Before launch: is the resume target complete, and will each rank find its files?

Contract: ``preflight`` resolves the step exactly as ``restore`` would (tracker, committed,
quick verify), and, given the new allocation (which host each rank runs on), lists per
host the files its ranks need but that were written on another host. That is the guide's
pitfall 14: node-local checkpoints and a new node set silently restart at step 0.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from .._commit import layout as _layout
from .._commit import manifest as _manifest
from .._commit.checks import Finding, Severity, file_hosts, files_needed, verify_step
from .._resume.restore import resolve_local
from ..config import ResumeMode
from ..errors import CheckpointError, ConfigError


def _text(path: Path) -> str:
    try:
        return _layout.read_small(path, limit=64 << 20, what="host list").decode("utf-8")
    except (CheckpointError, OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not a readable host list ({exc})") from None


def parse_hosts(path: Path, world: int) -> dict[int, str]:
    """A host list (one per line; ranks in equal contiguous blocks) as rank -> host."""
    hosts = [h.strip() for h in _text(path).splitlines() if h.strip() and not h.startswith("#")]
    if not hosts or world % len(hosts):
        raise ConfigError(
            f"{path}: {len(hosts)} hosts cannot hold {world} ranks in equal blocks; "
            "give a rank-to-host map with --rank-hosts instead"
        )
    per = world // len(hosts)
    return {r: hosts[r // per] for r in range(world)}


def parse_rank_hosts(path: Path) -> dict[int, str]:
    """A rank-to-host map: JSON {"0": "h1", ...} or lines 'RANK HOST'."""
    text = _text(path)
    try:
        data = _layout.parse_json(text, where=str(path))
    except CheckpointError:
        data = None
    if isinstance(data, dict):
        try:
            return {int(k): str(v) for k, v in data.items()}
        except ValueError:
            raise ConfigError(f"{path}: the JSON rank-to-host map must have rank numbers as keys") from None
    out = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[0].isdigit():
            raise ConfigError(f"{path}:{n}: expected 'RANK HOST', got {line!r}")
        out[int(parts[0])] = parts[1]
    return out


@dataclass
class PreflightReport:
    step: int | None = None
    path: str | None = None
    reason: str = ""
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(f.severity is Severity.ERROR for f in self.findings)


def preflight(
    root: Path, naming: _layout.StepNaming, *, rank_hosts: dict[int, str] | None = None, expect_step: int | None = None
) -> PreflightReport:
    report = PreflightReport()
    tracker_path = root / _layout.TRACKER_NAME
    if not os.path.lexists(tracker_path):  # a dangling link is refused below, not reported as absent
        report.findings.append(
            Finding(
                Severity.ERROR,
                "no-tracker",
                str(tracker_path),
                "is missing, so a launch with resume 'auto' would start from step 0",
                "point the launch at the root that holds the tracker, or copy it back",
            )
        )
        return report
    try:
        res = resolve_local(root, naming, ResumeMode.AUTO, None)
    except CheckpointError as exc:
        report.findings.append(
            Finding(Severity.ERROR, "unresolvable", str(root), str(exc).split(". ")[0], "fix the root before launching")
        )
        return report
    report.step, report.reason = res.step, res.reason
    report.path = str(res.path) if res.path else None
    if expect_step is not None and res.step != expect_step:
        report.findings.append(
            Finding(
                Severity.ERROR,
                "unexpected-step",
                str(tracker_path),
                f"resolves step {res.step}, expected {expect_step}",
                "find out which is right before launch",
            )
        )
    if res.path is None:
        return report
    report.findings += verify_step(res.path)
    if rank_hosts is not None and report.ok:
        try:
            report.findings += _placement(res.path, rank_hosts)
        except (CheckpointError, OSError) as exc:
            report.findings.append(
                Finding(Severity.ERROR, "unplaceable", str(res.path), str(exc).split(";")[0],
                        "run `ckptguard verify --deep` on the step and fix it before launching")
            )
    return report


def _placement(step_dir: Path, rank_hosts: dict[int, str]) -> list[Finding]:
    manifest = _manifest.read(step_dir)
    world = manifest.world_size
    if len(rank_hosts) != world or set(rank_hosts) != set(range(world)):
        return [
            Finding(
                Severity.ERROR,
                "world-size",
                str(step_dir),
                f"the checkpoint has {manifest.world_size} ranks, the allocation {len(rank_hosts)}",
                "launch with the saved world size",
            )
        ]
    where = file_hosts(manifest)
    missing: dict[str, dict[int, list[str]]] = {}
    for rank, host in sorted(rank_hosts.items()):
        for rel in sorted(files_needed(step_dir, manifest, rank)):
            if where.get(rel, host) != host:
                missing.setdefault(host, {}).setdefault(rank, []).append(f"{rel} (on {where[rel]})")
    findings = []
    for host, per_rank in sorted(missing.items()):
        for rank, files in per_rank.items():
            findings.append(
                Finding(
                    Severity.ERROR,
                    "missing-on-host",
                    f"{host}:{step_dir}",
                    f"rank {rank} will run "
                    f"on {host} but needs {len(files)} file(s) written elsewhere: {', '.join(files[:4])}",
                    "copy them to that host before launch, or keep the old rank-to-host placement",
                )
            )
    return findings
