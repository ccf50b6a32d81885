"""Before launch: is the resume target complete, and will each rank find its files?

Contract: ``preflight`` resolves the step exactly as ``restore`` would (tracker, committed,
quick verify of the files this disk holds: on node-local roots, this node's part, named by
its node manifest), and, given the new allocation (which host each rank runs on), checks
that the ranks placed on this node find their files on this disk. It looks at the real
files, never at where the manifest says they were written; the ranks placed on other nodes
of node-local roots are reported as not checked (run preflight there). That is docs/practices.md's
pitfall 14: node-local checkpoints and a new node set silently restart at step 0. A root
that does not exist here is NOT READY, never a fresh start.

A RunCheckpoint root (a run step of several roles): the tracker's step must hold every role (a
step missing a role is NOT READY naming it), each role's part is verified as a step, and the
placement is checked role by role (a role's rank i is the run rank ``ranks[i]`` of the run
manifest), every finding naming its role.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from .._agree import node_name
from .._disk import layout as _layout
from .._records import checks as _checks
from .._records import manifest as _manifest
from .._records import runmanifest as _runmanifest
from .._records.checks import verify_step
from .._records.findings import Finding, Severity
from .._records.manifest import files_needed, safe_member
from .._resume.resolve_local import resolve_local
from ..config import ResumeMode
from ..errors import CheckpointError, ConfigError


def _text(path: Path) -> str:
    try:
        return _layout.read_small(path, limit=64 << 20, what="host list").decode("utf-8")
    except (CheckpointError, OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not a readable host list ({exc})") from None


def parse_hosts(path: str | os.PathLike[str], world: int) -> dict[int, str]:
    """A host list (one per line; ranks in equal contiguous blocks) as rank -> host."""
    path = Path(path)
    hosts = [h.strip() for h in _text(path).splitlines() if h.strip() and not h.startswith("#")]
    if not hosts or world % len(hosts):
        raise ConfigError(
            f"{path}: {len(hosts)} hosts cannot hold {world} ranks in equal blocks; "
            "give a rank-to-host map with --rank-hosts instead"
        )
    per = world // len(hosts)
    return {r: hosts[r // per] for r in range(world)}


def parse_rank_hosts(path: str | os.PathLike[str]) -> dict[int, str]:
    """A rank-to-host map: JSON {"0": "h1", ...} or lines 'RANK HOST'."""
    path = Path(path)
    text = _text(path)
    try:
        data = _layout.parse_json(text, where=str(path))
    except CheckpointError:
        data = None
    if isinstance(data, dict):
        try:
            return {int(k): str(v) for k, v in data.items()}
        except ValueError:
            raise ConfigError(
                f"{path}: the JSON rank-to-host map must have rank numbers as keys"
            ) from None
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
    roles: dict[str, list[int]] | None = None  # a run step: each role and its run ranks

    @property
    def ok(self) -> bool:
        return not any(f.severity is Severity.ERROR for f in self.findings)


def preflight(
    root: str | os.PathLike[str],
    naming: _layout.StepNaming,
    *,
    rank_hosts: dict[int, str] | None = None,
    expect_step: int | None = None,
    node: str | None = None,
) -> PreflightReport:
    """``node``: the node this runs on, as the ranks name it (default: ``CKPTGUARD_NODE`` or the
    host name)."""
    root = Path(root)
    report = PreflightReport()
    if not root.is_dir():
        report.findings.append(
            Finding(
                Severity.ERROR,
                "no-root",
                str(root),
                "does not exist on this node (or is not a directory), so a launch with resume "
                "'auto' would start from step 0",
                "point the launch at the root that holds the checkpoint, or copy this node's part "
                "of it here (`ckptguard transfer`) before launching",
            )
        )
        return report
    tracker_path = root / _layout.TRACKER_NAME
    if not os.path.lexists(
        tracker_path
    ):  # a dangling link is refused below, not reported as absent
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
        res = resolve_local(root, naming, ResumeMode.AUTO, None, read_manifest=_checks.read_any)
    except CheckpointError as exc:
        report.findings.append(
            Finding(
                Severity.ERROR,
                "unresolvable",
                str(root),
                str(exc).split(". ")[0],
                "fix the root before launching",
            )
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
    report.findings += _lagging(root, naming, res.step)
    if res.path is None:
        return report
    found = _checks.read_any(res.path)
    if isinstance(found, _runmanifest.RunManifest):
        report.roles = {name: list(e.ranks) for name, e in found.roles.items()}
    report.findings += verify_step(res.path)
    if rank_hosts is not None and report.ok:
        try:
            report.findings += _placement(res.path, rank_hosts, node or node_name())
        except (CheckpointError, OSError) as exc:
            report.findings.append(
                Finding(
                    Severity.ERROR,
                    "unplaceable",
                    str(res.path),
                    str(exc).split(";")[0],
                    "run `ckptguard verify --deep` on the step and fix it before launching",
                )
            )
    return report


def _lagging(root: Path, naming: _layout.StepNaming, step: int) -> list[Finding]:
    """Steps newer than this node's tracker that this node holds published on node-local roots: a
    per-node save stopped between the nodes' trackers. The job resumes such a step when another
    node's tracker names it (its restore agrees across nodes); this node alone cannot tell."""
    out = []
    for found, path in sorted(_layout.step_dirs(root, naming).items()):
        if found <= step:
            continue
        try:
            manifest = _manifest.read(path)
        except CheckpointError:
            continue
        if manifest.nodes and manifest.step == found:
            out.append(
                Finding(
                    Severity.WARNING,
                    "published-newer",
                    str(path),
                    f"step {found} is published on this node (node-local roots) but this "
                    f"node's tracker says {step}: a save stopped between the nodes' trackers; "
                    f"the job resumes step {found} if another node's tracker says so, else it "
                    f"is removed by the next save",
                    "run preflight on the other nodes; the launch itself agrees on one step",
                )
            )
    return out


def _world_mismatch(step_dir: Path, world: int, rank_hosts: dict[int, str]) -> list[Finding]:
    if len(rank_hosts) == world and set(rank_hosts) == set(range(world)):
        return []
    return [
        Finding(
            Severity.ERROR,
            "world-size",
            str(step_dir),
            f"the checkpoint has {world} ranks, the allocation {len(rank_hosts)}",
            "launch with the saved world size",
        )
    ]


def _placement(step_dir: Path, rank_hosts: dict[int, str], node: str) -> list[Finding]:
    found = _checks.read_any(step_dir)
    if isinstance(found, _runmanifest.RunManifest):
        # A run step is on one shared root (RunCheckpoint refuses node-local ones): every role's
        # ranks read this disk. Role rank i is run rank ranks[i]; each finding names the role.
        if bad := _world_mismatch(step_dir, found.world_size, rank_hosts):
            return bad
        out = []
        for role, held in sorted(found.roles.items()):
            hosts = {i: rank_hosts[r] for i, r in enumerate(held.ranks)}
            for f in _placement(step_dir / role, hosts, node):
                out.append(
                    Finding(
                        f.severity,
                        f.code,
                        f.path,
                        f"role {role!r} (run ranks {held.ranks}): {f.message}",
                        f.fix,
                    )
                )
        return out
    manifest = found
    world = manifest.world_size
    if bad := _world_mismatch(step_dir, world, rank_hosts):
        return bad
    # One shared root: every rank reads this storage, wherever it runs. Node-local roots: this disk
    # serves the ranks placed on this node only; the other nodes' disks are out of sight here.
    here = (
        sorted(r for r, h in rank_hosts.items() if h == node)
        if manifest.nodes
        else sorted(rank_hosts)
    )
    findings = []
    for rank in here:
        files = {f.path: f for f in manifest.files}
        lost = []
        for rel in sorted(files_needed(step_dir, manifest, rank)):
            path = safe_member(step_dir, rel)
            entry = files.get(rel)
            if (
                path is None
                or entry is None
                or not path.is_file()
                or path.stat().st_size != entry.size
            ):
                lost.append(rel)
        if lost:
            findings.append(
                Finding(
                    Severity.ERROR,
                    "missing-on-host",
                    f"{rank_hosts[rank]}:{step_dir}",
                    f"rank {rank} will run on {rank_hosts[rank]} but {len(lost)} file(s) it reads "
                    f"are not on this disk: {', '.join(lost[:4])}{' ...' if len(lost) > 4 else ''}",
                    "copy them here before launch (`ckptguard transfer` of the node that holds "
                    "them), or keep the old rank-to-host placement",
                )
            )
    others = sorted({h for r, h in rank_hosts.items() if r not in here})
    for host in others:
        ranks = sorted(r for r, h in rank_hosts.items() if h == host)
        findings.append(
            Finding(
                Severity.WARNING,
                "not-checked",
                f"{host}:{step_dir}",
                f"ranks {ranks} will run on {host}, whose disk this preflight on {node} cannot see "
                f"(node-local roots), so their files were not checked",
                f"run `ckptguard preflight` on {host} too",
            )
        )
    return findings
