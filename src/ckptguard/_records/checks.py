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

from .._disk import layout as _layout
from .._disk.digest import file_digest
from ..errors import CheckpointError, RunStepError, UnsafeCheckpointError
from ..storage.base import DCP_METADATA
from ..storage.unpickler import read_dcp_metadata
from . import manifest as _manifest

_ALLOWED_EXTRA = {_layout.MANIFEST_NAME}

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(text: str) -> str:
    """``text`` with every non-printable character escaped (``\\n``, ``\\x1b``, ``\\u202e``).

    File names come from the disk: a newline in one would forge a line of output, an
    ANSI escape would rewrite the terminal, and an undecodable byte (a surrogate after
    ``os.fsdecode``) would make printing raise. Undecodable bytes show as ``\\xNN``."""
    if text.isprintable():
        return text
    out = []
    for ch in text:
        if ch.isprintable():
            out.append(ch)
        elif ch in _NAMED:
            out.append(_NAMED[ch])
        elif 0xDC80 <= ord(ch) <= 0xDCFF:  # surrogateescape: the raw byte of the name
            out.append(f"\\x{ord(ch) - 0xDC00:02x}")
        elif ord(ch) < 0x100:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(f"\\u{ord(ch):04x}" if ord(ch) < 0x10000 else f"\\U{ord(ch):08x}")
    return "".join(out)


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
        """One line of output; names from the disk are escaped, so it is always exactly one line."""
        text = f"{self.severity.value:<7} {self.code:<18} {self.path}: {self.message}; {self.fix}"
        return printable(text)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["severity"] = self.severity.value
        # JSON escapes control characters itself; undecodable bytes of a name become \\xNN,
        # since a lone surrogate cannot be encoded as UTF-8 by the reader of the output.
        out["path"] = out["path"].encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
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
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop (Python < 3.13)
        return None
    if real != base and base not in real.parents:
        return None
    return path


RESTORE_HINT = "restore an earlier committed step, or copy the file back from where it was written"


def _check_files(
    step_dir: Path, manifest: _manifest.Manifest, entries: list[dict[str, Any]] | None = None
) -> tuple[list[Finding], list[tuple[Path, dict[str, Any]]]]:
    findings, ok = [], []
    for entry in manifest.files if entries is None else entries:
        rel = str(entry.get("path", ""))
        lexical = bool(rel) and not os.path.isabs(rel) and ".." not in Path(rel).parts
        path = safe_member(step_dir, rel) if not (lexical and (step_dir / rel).is_symlink()) else step_dir / rel
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
    world = manifest.world_size
    # Ranks are counted from the names listed, never enumerated up to a world size the
    # manifest merely claims (10**8 would spin for minutes).
    present = {r for r in (_extras_rank(p) for p in listed) if r is not None and r < world}
    if len(present) < world:
        missing = []
        for rank in range(world):
            if rank not in present:
                missing.append(rank)
                if len(missing) == 8:
                    break
        count = world - len(present)
        names = ", ".join(str(r) for r in missing) + (" ..." if count > len(missing) else "")
        path = step_dir / _layout.extras_name(missing[0]) if count == 1 else step_dir
        findings.append(
            _err(
                "missing-rank",
                path,
                f"{count} of {world} ranks have no extras in the manifest (rank {names})"
                if count > 1
                else f"rank {missing[0]} of {world} has no extras in the manifest",
                RESTORE_HINT
                if count < world
                else "the manifest's world_size does not match its files: do not restore it; restore an earlier step",
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
    except UnsafeCheckpointError as exc:
        return [
            *findings,
            _err(
                "unsafe-path",
                state / DCP_METADATA,
                str(exc).split(": DCP writes")[0].split("; ckptguard")[0],
                "do not restore this checkpoint: inspect it by hand, restore an earlier step",
            ),
        ]
    except (CheckpointError, OSError) as exc:
        return [*findings, _err("bad-metadata", state / DCP_METADATA, str(exc).split(";")[0], RESTORE_HINT)]
    referenced = {info.relative_path for info in (md.storage_data or {}).values()}
    for rel in sorted(referenced):
        if f"{_layout.STATE_DIR}/{rel}" not in listed:
            findings.append(
                _err(
                    "missing-shard",
                    state / rel,
                    "DCP metadata points at it but the manifest does not list it",
                    RESTORE_HINT,
                )
            )
    # The other way round: a data file the save wrote that the metadata never points at means
    # the metadata lost entries (a .metadata listing no tensors passes every other check).
    prefix = f"{_layout.STATE_DIR}/"
    for f in manifest.files:
        rel = str(f.get("path", ""))
        data_file = rel.startswith(prefix) and rel.endswith(".distcp") and int(f.get("size") or 0) > 0
        if data_file and rel[len(prefix):] not in referenced:
            findings.append(
                _err(
                    "unreferenced-shard",
                    step_dir / rel,
                    "the manifest lists this data file but the DCP metadata points at none of its bytes "
                    "(the metadata lost its tensor entries)",
                    RESTORE_HINT,
                )
            )
    return findings


def _extras_rank(rel: str) -> int | None:
    if rel.startswith("rank_") and rel.endswith(".pt") and rel[5:-3].isdigit() and rel == _layout.extras_name(
        int(rel[5:-3])
    ):
        return int(rel[5:-3])
    return None


def _leftovers(step_dir: Path, manifest: _manifest.Manifest) -> list[Finding]:
    listed = {str(f.get("path")) for f in manifest.files} | _ALLOWED_EXTRA
    if manifest.nodes:
        listed.add(_layout.NODE_MANIFEST_NAME)
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
    """Findings for one step directory (empty: complete); never raises on what it finds on disk."""
    step_dir = Path(step_dir)
    if step_dir.is_symlink():
        return [
            _err(
                "symlink",
                step_dir,
                "the step directory is a symlink",
                "replace it with the real directory; ckptguard never reads or deletes through links",
            )
        ]
    try:
        return _verify_step(step_dir, deep=deep, progress=progress)
    except Exception as exc:  # one bad step is one finding, never a failure of the whole root
        return [
            _err(
                "check-failed",
                step_dir,
                f"could not be checked ({type(exc).__name__}: {str(exc)[:300]})",
                "inspect the step by hand; do not restore it until `ckptguard verify` passes",
            )
        ]


def _verify_step(step_dir: Path, *, deep: bool, progress: Callable[[int], None] | None) -> list[Finding]:
    try:
        manifest = _manifest.read(step_dir)
    except RunStepError:  # several roles committed as one step: each role's part is checked as a step
        from . import runmanifest

        return runmanifest.verify(step_dir, deep=deep, progress=progress)
    except CheckpointError as exc:
        code = "no-manifest" if isinstance(exc, FileNotFoundError) else "bad-manifest"
        where = step_dir / _layout.MANIFEST_NAME
        what = str(exc).split(";")[0]
        if what.startswith(str(where)):  # the finding names the file already
            what = what[len(str(where)) :].lstrip(": ") or what
        return [
            _err(
                code,
                where,
                what,
                "this step is not committed: never restore it; resume from the tracker's step",
            )
        ]
    entries, findings = node_part(step_dir, manifest)
    if entries is None:
        return findings
    more, present = _check_files(step_dir, manifest, entries)
    findings += more
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


def node_part(step_dir: Path, manifest: _manifest.Manifest) -> tuple[list[dict[str, Any]] | None, list[Finding]]:
    """The files this disk must hold of the step: every file (one shared root), or on node-local
    roots (format 2 ``nodes``) the part of the node whose node manifest is here, which must match
    the global manifest. None, with the findings, when this disk holds no valid node part."""
    if not manifest.nodes:
        return list(manifest.files), []
    where = step_dir / _layout.NODE_MANIFEST_NAME
    try:
        node = _manifest.read_node(step_dir)
    except CheckpointError as exc:
        return None, [_err("bad-node-manifest", where, str(exc).split(": ", 1)[-1], RESTORE_HINT)]
    if node is None:
        return None, [
            _err(
                "no-node-manifest",
                where,
                f"is absent: the step was saved on node-local roots ({len(manifest.nodes)} nodes), and this disk "
                "holds no node's part of it (its node manifest is written with the node's files)",
                "run this on a node that saved the step, or copy that node's part here (`ckptguard transfer`)",
            )
        ]
    index = int(node["node"])
    if not 0 <= index < len(manifest.nodes):
        return None, [_err("bad-node-manifest", where, f"names node {index} of {len(manifest.nodes)}", RESTORE_HINT)]
    expected = manifest.node_files(index)

    def key(files: list[dict[str, Any]]) -> list[tuple[str, int, str]]:
        return sorted((str(f["path"]), int(f["size"]), str(f["xxh3"])) for f in files)

    if node["step"] != manifest.step or key(node["files"]) != key(expected):
        return None, [
            _err(
                "bad-node-manifest",
                where,
                f"lists other files than the global manifest gives node {index} ({manifest.nodes[index]['name']}) "
                f"of step {manifest.step}",
                RESTORE_HINT,
            )
        ]
    return expected, []


def leftover_findings(root: Path, *, max_age_s: float = 24 * 3600.0) -> list[Finding]:
    """A WARNING per crash leftover in ``root`` (temp directories, trash, temp files, lease
    take-over markers, foreign temp-like entries) and per unreadable hold file."""
    from .._disk import lease as _lease
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
    """The manifest's size and save-time record, when it has one of the shape ckptguard writes."""
    try:
        path = Path(step_dir) / _layout.MANIFEST_NAME
        data = _layout.read_json(path, limit=_manifest.MANIFEST_BYTES, what="manifest")
    except (CheckpointError, OSError):
        return None
    found = data.get("cost") if isinstance(data, dict) else None
    keys = ("bytes", "save_seconds")
    if not isinstance(found, dict) or not all(isinstance(found.get(k), (int, float)) for k in keys):
        return None
    for k in ("step_seconds", "save_fraction_of_step"):
        if found.get(k) is not None and not isinstance(found[k], (int, float)):
            return None
    return found

def files_needed(step_dir: Path, manifest: _manifest.Manifest, rank: int) -> set[str]:
    """Files (relative to the step) that ``rank`` reads when restoring on the same layout:
    its extras, the DCP metadata, the shards it wrote, and the files of replicated keys."""
    return {_layout.extras_name(rank)} | rank_reads(read_dcp_metadata(step_dir / _layout.STATE_DIR), rank)


def rank_reads(md: Any, rank: int) -> set[str]:
    """The DCP files (relative to the step) that ``rank`` reads on the same layout, given the
    metadata ``md``: the metadata itself, its own shards, and the file of each replicated key
    (stored once, by whichever rank DCP chose)."""
    needed = {f"{_layout.STATE_DIR}/{DCP_METADATA}"}
    writers: dict[str, set[str]] = {}
    for index, info in (md.storage_data or {}).items():
        writers.setdefault(index.fqn, set()).add(info.relative_path)
    for files in writers.values():
        mine = {f for f in files if f.startswith(f"__{rank}_")}
        if not mine and len(files) == 1:
            mine = files  # a replicated key: stored once, by whichever rank DCP chose
        needed |= {f"{_layout.STATE_DIR}/{f}" for f in mine}
    return needed


