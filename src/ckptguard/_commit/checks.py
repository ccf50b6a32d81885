"""Checks of one step directory, shared by restore, retention and the operator tools.

Contract: ``verify_step`` returns findings, never raises on bad content; paths from the
manifest that leave the step directory are findings and are never opened.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .._resume.digest import file_digest
from ..errors import CheckpointError
from ..storage.base import DCP_METADATA
from ..storage.unpickler import read_dcp_metadata
from . import layout as _layout
from . import manifest as _manifest

_ALLOWED_EXTRA = {_layout.MANIFEST_NAME}


class Severity(str, enum.Enum):
    ERROR = "ERROR"
    WARNING = "WARNING"


@dataclass(frozen=True)
class Finding:
    """One thing wrong: what, which file, what to do."""

    severity: Severity
    code: str
    path: str
    message: str
    fix: str

    def line(self) -> str:
        return f"{self.severity.value:<7} {self.code:<18} {self.path}: {self.message}; {self.fix}"

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["severity"] = self.severity.value
        return out


def _err(code: str, path: Path | str, message: str, fix: str) -> Finding:
    return Finding(Severity.ERROR, code, str(path), message, fix)


def safe_member(step_dir: Path, rel: str) -> Path | None:
    """``step_dir/rel`` if it stays inside ``step_dir`` without following a symlink out."""
    if not rel or os.path.isabs(rel) or ".." in Path(rel).parts:
        return None
    path = step_dir / rel
    base = step_dir.resolve()
    try:
        real = path.resolve()
    except OSError:
        return None
    if real != base and base not in real.parents:
        return None
    return path


RESTORE_HINT = "restore an earlier committed step, or copy the file back from where it was written"


def _check_files(
    step_dir: Path, manifest: _manifest.Manifest
) -> tuple[list[Finding], list[tuple[Path, dict[str, Any]]]]:
    findings, ok = [], []
    for entry in manifest.files:
        rel = str(entry.get("path", ""))
        path = safe_member(step_dir, rel)
        if path is None:
            findings.append(
                _err(
                    "unsafe-path",
                    step_dir / _layout.MANIFEST_NAME,
                    f"lists {rel!r}, which leaves the step directory (absolute, '..' or a symlink out)",
                    "do not restore or delete through this checkpoint; inspect it by hand",
                )
            )
            continue
        if path.is_symlink():
            findings.append(
                _err(
                    "symlink",
                    path,
                    "is a symlink; checkpoint files are regular files",
                    "replace it with the real file or restore an earlier step",
                )
            )
            continue
        if not path.is_file():
            findings.append(
                _err(
                    "missing-file",
                    path,
                    f"is listed in the manifest (rank {entry.get('rank')}) but absent",
                    RESTORE_HINT,
                )
            )
            continue
        size = path.stat().st_size
        if size == 0 or size != entry.get("size"):
            code = "empty-file" if size == 0 else "size-mismatch"
            findings.append(_err(code, path, f"has {size} bytes, the manifest says {entry.get('size')}", RESTORE_HINT))
            continue
        ok.append((path, entry))
    return findings, ok


def _check_shard_set(step_dir: Path, manifest: _manifest.Manifest) -> list[Finding]:
    """Every rank's extras and every file DCP's metadata points at must be listed."""
    listed = {str(f.get("path")) for f in manifest.files}
    findings = []
    for rank in range(manifest.world_size):
        name = _layout.extras_name(rank)
        if name not in listed:
            findings.append(
                _err(
                    "missing-rank",
                    step_dir / name,
                    f"rank {rank} of {manifest.world_size} has no extras in the manifest",
                    RESTORE_HINT,
                )
            )
    state = step_dir / _layout.STATE_DIR
    if f"{_layout.STATE_DIR}/{DCP_METADATA}" not in listed:
        return [
            *findings,
            _err("missing-file", state / DCP_METADATA, "DCP metadata is not in the manifest", RESTORE_HINT),
        ]
    try:
        md = read_dcp_metadata(state)
    except (CheckpointError, OSError) as exc:
        return [*findings, _err("bad-metadata", state / DCP_METADATA, str(exc).split(";")[0], RESTORE_HINT)]
    for rel in sorted({info.relative_path for info in (md.storage_data or {}).values()}):
        if f"{_layout.STATE_DIR}/{rel}" not in listed:
            findings.append(
                _err(
                    "missing-shard",
                    state / rel,
                    "DCP metadata points at it but the manifest does not list it",
                    RESTORE_HINT,
                )
            )
    return findings


def _leftovers(step_dir: Path, manifest: _manifest.Manifest) -> list[Finding]:
    listed = {str(f.get("path")) for f in manifest.files} | _ALLOWED_EXTRA
    findings = []
    for dirpath, dirnames, filenames in os.walk(step_dir, followlinks=False):
        for name in filenames + [d for d in dirnames if Path(dirpath, d).is_symlink()]:
            rel = os.path.relpath(os.path.join(dirpath, name), step_dir)
            if rel not in listed:
                findings.append(
                    Finding(
                        Severity.ERROR,
                        "unexpected-file",
                        str(step_dir / rel),
                        "is not in the manifest (a leftover temp file or a foreign write)",
                        "find out who wrote it, then delete it; the checkpoint itself is intact",
                    )
                )
    return findings


def verify_step(step_dir: Path, *, deep: bool = False, progress: Callable[[int], None] | None = None) -> list[Finding]:
    """Findings for one step directory (empty: complete)."""
    step_dir = Path(step_dir)
    try:
        manifest = _manifest.read(step_dir)
    except CheckpointError as exc:
        code = "no-manifest" if isinstance(exc, FileNotFoundError) else "bad-manifest"
        return [
            _err(
                code,
                step_dir / _layout.MANIFEST_NAME,
                str(exc).split(";")[0],
                "this step is not committed: never restore it; resume from the tracker's step",
            )
        ]
    findings, present = _check_files(step_dir, manifest)
    if any(f.code == "unsafe-path" for f in findings):
        return findings  # never walk or hash through a manifest that points outside
    findings += _check_shard_set(step_dir, manifest)
    findings += _leftovers(step_dir, manifest)
    if deep:
        for path, entry in present:
            _size, xxh = file_digest(str(path))
            if progress is not None:
                progress(entry["size"])
            if xxh != entry.get("xxh3"):
                findings.append(
                    _err(
                        "checksum",
                        path,
                        f"xxh3 {xxh} differs from the manifest's {entry.get('xxh3')} "
                        "(the bytes changed after the save)",
                        RESTORE_HINT,
                    )
                )
    return findings


def leftover_findings(root: Path, *, max_age_s: float = 24 * 3600.0) -> list[Finding]:
    """A WARNING per crash leftover in ``root`` (temp directories, trash, temp files, lease
    take-over markers, foreign temp-like entries) and per unreadable hold file."""
    from . import lease as _lease
    from . import retention as _retention

    findings = []
    for item in _layout.leftovers(root, max_age_s=max_age_s, tmp_files=(_layout.TRACKER_NAME, _lease.LEASE_NAME)):
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


def deep_bytes(step_dir: Path) -> int:
    try:
        return sum(int(f.get("size", 0)) for f in _manifest.read(step_dir).files)
    except CheckpointError:
        return 0


def cost(step_dir: Path) -> dict[str, Any] | None:
    """The manifest's size and save-time record, when it has one."""
    import json

    try:
        cost: dict[str, Any] | None = json.loads((Path(step_dir) / _layout.MANIFEST_NAME).read_text()).get("cost")
        return cost
    except (OSError, ValueError):
        return None
def files_needed(step_dir: Path, manifest: _manifest.Manifest, rank: int) -> set[str]:
    """Files (relative to the step) that ``rank`` reads when restoring on the same layout:
    its extras, the DCP metadata, the shards it wrote, and the files of replicated keys."""
    needed = {_layout.extras_name(rank), f"{_layout.STATE_DIR}/{DCP_METADATA}"}
    md = read_dcp_metadata(step_dir / _layout.STATE_DIR)
    writers: dict[str, set[str]] = {}
    for index, info in (md.storage_data or {}).items():
        writers.setdefault(index.fqn, set()).add(info.relative_path)
    for files in writers.values():
        mine = {f for f in files if f.startswith(f"__{rank}_")}
        if not mine and len(files) == 1:
            mine = files  # a replicated key: stored once, by whichever rank DCP chose
        needed |= {f"{_layout.STATE_DIR}/{f}" for f in mine}
    return needed


GLOBAL_FILES = {f"{_layout.STATE_DIR}/{DCP_METADATA}"}


def file_hosts(manifest: _manifest.Manifest) -> dict[str, str]:
    """Which host wrote each per-rank file (where it lives on node-local storage).

    The global files (manifest, DCP metadata, tracker) are published to every node."""
    hosts = manifest.topology.get("rank_hosts") or []
    return {
        f["path"]: hosts[f["rank"]]
        for f in manifest.files
        if f.get("rank") is not None and f["rank"] < len(hosts) and f["path"] not in GLOBAL_FILES
    }


