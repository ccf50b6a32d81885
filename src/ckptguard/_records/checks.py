"""Checks of one step directory, shared by restore, retention and the operator tools.

Contract: ``verify_step`` returns findings, never raises on bad content; paths from the
manifest that leave the step directory are findings and are never opened. The findings of a
damaged shard set, of unreadable DCP metadata and of changed bytes are worded in ``damage``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._disk import layout as _layout
from .._disk.filedigest import file_digest
from ..errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointIncompleteError,
    RunStepError,
)
from ..storage.base import DCP_METADATA
from ..storage.dcpindex import read_dcp_index
from . import manifest as _manifest
from . import runmanifest
from .damage import changed_bytes, key_findings, missing_ranks, unreadable_metadata
from .entries import Cost, FileEntry
from .findings import RESTORE_HINT, Finding, Severity, finding
from .manifest import node_part, safe_member
from .runmanifest import RunManifest

_ALLOWED_EXTRA = {_layout.MANIFEST_NAME}


def _check_files(
    step_dir: Path, manifest: _manifest.Manifest, entries: list[FileEntry] | None = None
) -> tuple[list[Finding], list[tuple[Path, FileEntry]]]:
    findings, ok = [], []
    for entry in manifest.files if entries is None else entries:
        rel = entry.path
        lexical = bool(rel) and not os.path.isabs(rel) and ".." not in Path(rel).parts
        path = (
            safe_member(step_dir, rel)
            if not (lexical and (step_dir / rel).is_symlink())
            else step_dir / rel
        )
        if path is None:
            findings.append(
                finding(
                    "unsafe-path",
                    step_dir / _layout.MANIFEST_NAME,
                    f"lists {rel!r}, which leaves the step directory "
                    f"(absolute, '..' or a symlink out)",
                    "do not restore or delete through this checkpoint; inspect it by hand",
                )
            )
            continue
        if path.is_symlink():
            findings.append(
                finding(
                    "symlink",
                    path,
                    "is a symlink; checkpoint files are regular files",
                    "replace it with the real file or restore an earlier step",
                )
            )
            continue
        if not path.is_file():
            findings.append(
                finding(
                    "missing-file",
                    path,
                    f"is listed in the manifest (rank {entry.rank}) but absent",
                    RESTORE_HINT,
                )
            )
            continue
        size = path.stat().st_size
        if size == 0 or size != entry.size:
            code = "empty-file" if size == 0 else "size-mismatch"
            said = f"has {size} bytes, the manifest says {entry.size}"
            findings.append(finding(code, path, said, RESTORE_HINT))
            continue
        ok.append((path, entry))
    return findings, ok


def _check_shard_set(step_dir: Path, manifest: _manifest.Manifest) -> list[Finding]:
    """Every rank's extras and every file DCP's metadata points at must be listed."""
    listed = {f.path for f in manifest.files}
    findings = []
    world = manifest.world_size
    # Ranks are counted from the names listed, never enumerated up to a world size the
    # manifest merely claims (10**8 would spin for minutes).
    present = {r for r in (_extras_rank(p) for p in listed) if r is not None and r < world}
    if len(present) < world:
        findings.append(missing_ranks(step_dir, world, present))
    state = step_dir / _layout.STATE_DIR
    if f"{_layout.STATE_DIR}/{DCP_METADATA}" not in listed:
        return [
            *findings,
            finding(
                "missing-file",
                state / DCP_METADATA,
                "DCP metadata is not in the manifest",
                RESTORE_HINT,
            ),
        ]
    try:
        md = read_dcp_index(state)
    except (CheckpointError, OSError) as exc:  # unsafe, unreadable, a data file cut short
        return [*findings, *unreadable_metadata(step_dir, manifest, exc)]
    findings += _missing_keys(state, manifest, md)
    referenced = {info.relative_path for info in (md.storage_data or {}).values()}
    for rel in sorted(referenced):
        if f"{_layout.STATE_DIR}/{rel}" not in listed:
            findings.append(
                finding(
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
        rel = f.path
        data_file = rel.startswith(prefix) and rel.endswith(".distcp") and f.size > 0
        if data_file and rel[len(prefix) :] not in referenced:
            findings.append(
                finding(
                    "unreferenced-shard",
                    step_dir / rel,
                    "the manifest lists this data file but the DCP metadata points at none of its "
                    "bytes (the metadata lost its tensor entries)",
                    RESTORE_HINT,
                )
            )
    return findings


def _missing_keys(state: Path, manifest: _manifest.Manifest, md: Any) -> list[Finding]:
    """A tensor the save recorded (its layout-free digest) that the DCP metadata does not hold: a
    key renamed or dropped in ``.metadata`` (its checksum fixed to match) would otherwise pass every
    check here and be refused only by the restore, which expects it."""
    table = md.state_dict_metadata
    recorded = manifest.layout_free or {}
    lost = sorted(
        key
        for keys in recorded.values()
        for key in keys
        if type(table.get(key)).__name__ != "TensorStorageMetadata"
    )
    # The other way round: a tensor of a recorded item (or of an item whose tensors only the table
    # covers, digest kind "structure") that the table lacks: restore compares both sets.
    covered = set(recorded) | {
        n for n, k in (manifest.digest_kind or {}).items() if k != _manifest.DIGEST_BYTES
    }
    items = sorted(covered, key=len, reverse=True)
    unrecorded = sorted(
        key
        for key, meta in table.items()
        if type(meta).__name__ == "TensorStorageMetadata"
        and _item_of(key, items) is not None
        and key not in recorded.get(str(_item_of(key, items)), {})
    )
    return key_findings(state, lost, unrecorded) if lost or unrecorded else []


def _item_of(key: str, items: list[str]) -> str | None:
    """The item a DCP key belongs to (``<item>.<name>``), the longest item name first."""
    return next((item for item in items if key.startswith(item + ".")), None)


def step_problem(step_dir: Path, step: int, found: Any) -> str | None:
    """Why restore would refuse the step directory of ``step`` whose manifest (or run manifest)
    ``found`` was read: the first ERROR of the check ``verify`` runs without ``--deep``, or a
    manifest that names another step; None when there is none (what ``list`` checks before it calls
    a step committed)."""
    if found.step != step:
        return f"its manifest says step {found.step}, the directory's name step {step}"
    errors = [f for f in verify_step(step_dir) if f.severity is Severity.ERROR]
    return f"{errors[0].code}: {errors[0].message}" if errors else None


def _extras_rank(rel: str) -> int | None:
    if (
        rel.startswith("rank_")
        and rel.endswith(".pt")
        and rel[5:-3].isdigit()
        and rel == _layout.extras_name(int(rel[5:-3]))
    ):
        return int(rel[5:-3])
    return None


def _leftovers(step_dir: Path, manifest: _manifest.Manifest) -> list[Finding]:
    listed = {f.path for f in manifest.files} | _ALLOWED_EXTRA
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


def verify_step(
    step_dir: Path, *, deep: bool = False, progress: Callable[[int], None] | None = None
) -> list[Finding]:
    """Findings for one step directory (empty: complete); never raises on what it finds on disk."""
    step_dir = Path(step_dir)
    if step_dir.is_symlink():
        return [
            finding(
                "symlink",
                step_dir,
                "the step directory is a symlink",
                "replace it with the real directory; ckptguard never reads "
                "or deletes through links",
            )
        ]
    try:
        return _verify_step(step_dir, deep=deep, progress=progress)
    except Exception as exc:  # one bad step is one finding, never a failure of the whole root
        return [
            finding(
                "check-failed",
                step_dir,
                f"could not be checked ({type(exc).__name__}: {str(exc)[:300]})",
                "inspect the step by hand; do not restore it until `ckptguard verify` passes",
            )
        ]


def _verify_step(
    step_dir: Path, *, deep: bool, progress: Callable[[int], None] | None
) -> list[Finding]:
    try:
        manifest = _manifest.read(step_dir)
    except (
        RunStepError
    ):  # several roles committed as one step: each role's part is checked as a step
        return verify_run_step(step_dir, deep=deep, progress=progress)
    except CheckpointError as exc:
        code = "no-manifest" if isinstance(exc, FileNotFoundError) else "bad-manifest"
        where = step_dir / _layout.MANIFEST_NAME
        what = str(exc).split(";")[0]
        if what.startswith(str(where)):  # the finding names the file already
            what = what[len(str(where)) :].lstrip(": ") or what
        return [
            finding(
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
                progress(entry.size)
            if xxh != entry.xxh3:
                findings.append(changed_bytes(path, xxh, entry.xxh3))
    return findings


def deep_bytes(step_dir: Path) -> int:
    try:
        return sum(f.size for f in _manifest.read(step_dir).files)
    except CheckpointError:
        return 0


def cost(step_dir: Path) -> Cost | None:
    """The manifest's size and save-time record, when it has one of the shape ckptguard writes (a
    save time included); read alone, so that a step whose manifest is damaged elsewhere still shows
    what it cost."""
    try:
        path = Path(step_dir) / _layout.MANIFEST_NAME
        data = _layout.read_json(path, limit=_manifest.MANIFEST_BYTES, what="manifest")
    except (CheckpointError, OSError):
        return None
    found = Cost.from_json(data.get("cost")) if isinstance(data, dict) else None
    return found if found is not None and found.save_seconds is not None else None


# ---------------------------------------------------------------- run steps (several roles)


def role_problem(step_dir: Path, run: RunManifest, role: str) -> str | None:
    """Why ``role``'s part of the run step is not there as committed (None: it is): the quick
    check."""
    part = step_dir / role
    if part.is_symlink() or not part.is_dir():
        return f"its part {part} is {'a symlink' if part.is_symlink() else 'missing'}"
    entry = run.roles[role]
    try:
        size, xxh3 = runmanifest.role_manifest_digest(part)
    except FileNotFoundError:
        return f"its part {part} has no {_layout.MANIFEST_NAME}"
    except (
        OSError,
        CheckpointError,
    ) as exc:  # a FIFO, link or device planted there: refused, never waited on
        return str(exc).split(";")[0]
    if (size, xxh3) != (entry.manifest_bytes, entry.manifest_xxh3):
        return (
            f"{part / _layout.MANIFEST_NAME} has {size} bytes and xxh3 {xxh3}, the run "
            f"manifest recorded {entry.manifest_bytes} bytes and xxh3 {entry.manifest_xxh3} "
            f"(replaced after the commit)"
        )
    errors = [
        f for f in verify_step(part) if f.severity.value == "ERROR" and f.code != "unexpected-file"
    ]
    return errors[0].line() if errors else None


def checked_run_step(step_dir: Path, *, roles: list[str] | None = None) -> RunManifest:
    """``read`` plus every role's part (quick check), and the roles equal to ``roles`` when given:
    a step missing a role, or with one damaged, raises naming the role."""
    run = runmanifest.read(step_dir)
    where = f"run step {run.step} at {step_dir}"
    if roles is not None and set(roles) != set(run.roles):
        missing, extra = sorted(set(roles) - set(run.roles)), sorted(set(run.roles) - set(roles))
        raise CheckpointIncompleteError(
            f"{where} holds the roles {sorted(run.roles)}, this run declares {sorted(roles)}"
            + (f"; role(s) {missing} have no part in it" if missing else "")
            + (f"; role(s) {extra} would not be restored" if extra else "")
            + ". Declare the same roles as the run that saved it, or restore an earlier step"
        )
    for role in sorted(run.roles):
        why = role_problem(step_dir, run, role)
        if why is not None:
            raise CheckpointIncompleteError(
                f"{where} is missing role {role!r}: {why}. A step missing a role is not "
                f"committed; restore an earlier step (restore(path=...)) or copy the role's "
                f"files back, then `ckptguard verify` it"
            )
        part = _manifest.read(step_dir / role)
        if part.step != run.step or part.chain_id != run.chain_id:
            raise CheckpointCorruptError(
                f"{where}: role {role!r} holds step {part.step} of chain {part.chain_id!r}, the "
                f"run manifest step {run.step} of chain {run.chain_id!r}; restore an earlier step"
            )
    return run


def verify_run_step(
    step_dir: Path, *, deep: bool, progress: Callable[[int], None] | None
) -> list[Any]:
    """Findings of a run step (``checks.verify_step`` for a run manifest): each role's part checked
    as a step, its findings naming the role, plus roles missing or replaced and stray entries."""

    def err(code: str, path: Path, message: str, fix: str) -> Finding:
        return Finding(Severity.ERROR, code, str(path), message, fix)

    try:
        run = runmanifest.read(step_dir)
    except Exception as exc:  # a finding, never a raise (verify_step's contract)
        return [
            err(
                "bad-manifest",
                step_dir / _layout.MANIFEST_NAME,
                str(exc).split(";")[0],
                "this run step is not committed: never restore it; resume from the tracker's step",
            )
        ]
    fix = (
        "a step missing a role is not committed: restore an earlier step, or copy the role's "
        "files back"
    )
    findings = []
    for role in sorted(run.roles):
        part = step_dir / role
        if part.is_symlink() or not part.is_dir():
            findings.append(
                err("missing-role", part, f"role {role!r} of run step {run.step} is missing", fix)
            )
            continue
        entry = run.roles[role]
        try:
            size, xxh3 = runmanifest.role_manifest_digest(part)
        except OSError:
            size, xxh3 = -1, ""
        except (
            CheckpointError
        ) as exc:  # a FIFO, link or device planted there: refused, never waited on
            findings.append(
                err(
                    "role-manifest",
                    part / _layout.MANIFEST_NAME,
                    f"role {role!r}: {exc}".split(";")[0],
                    fix,
                )
            )
            continue
        if size >= 0 and (size, xxh3) != (entry.manifest_bytes, entry.manifest_xxh3):
            findings.append(
                err(
                    "role-manifest",
                    part / _layout.MANIFEST_NAME,
                    f"role {role!r}: differs from what the run manifest recorded",
                    fix,
                )
            )
        with contextlib.suppress(
            CheckpointError
        ):  # an unreadable part manifest is verify_step's finding
            own = _manifest.read(part)
            if (
                own.step != run.step or own.chain_id != run.chain_id
            ):  # as ``checked_run_step`` (restore, list) refuses
                findings.append(
                    err(
                        "role-step",
                        part / _layout.MANIFEST_NAME,
                        f"role {role!r} holds step {own.step} of chain {own.chain_id!r}, the run "
                        f"manifest step {run.step} of chain {run.chain_id!r}",
                        fix,
                    )
                )
        for f in verify_step(part, deep=deep, progress=progress):
            findings.append(
                Finding(f.severity, f.code, f.path, f"role {role!r}: {f.message}", f.fix)
            )
    for entry_path in sorted(step_dir.iterdir()):
        if entry_path.name != _layout.MANIFEST_NAME and entry_path.name not in run.roles:
            findings.append(
                Finding(
                    Severity.ERROR,
                    "unexpected-file",
                    str(entry_path),
                    "is not a role of the run manifest (a leftover or a foreign write)",
                    "find out who wrote it, then delete it; the checkpoint itself is intact",
                )
            )
    return findings


def read_any(step_dir: Path) -> Any:
    """The commit marker of a single-role step (``manifest.read``) or of a run step
    (``checked_run_step``: every role's part in place); what the operator tools read to call a step
    committed."""
    try:
        return _manifest.read(step_dir)
    except RunStepError:
        return checked_run_step(step_dir)
