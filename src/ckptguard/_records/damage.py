"""The findings of a damaged step directory, built only once ``checks`` found the damage: ranks with
no extras listed, DCP metadata that cannot be read or has lost (or gained) tensor entries, and bytes
changed after the save (``verify --deep``).

``checks`` decides what is wrong; this says it: each finding names what, where and what to do. A
complete step builds none of them.
"""

from __future__ import annotations

from pathlib import Path

from .._disk import layout as _layout
from ..errors import CheckpointError, UnsafeCheckpointError
from ..storage.base import DCP_METADATA
from ..storage.dcpstructure import ShortDataFile
from .findings import RESTORE_HINT, Finding, finding
from .manifest import Manifest


def missing_ranks(step_dir: Path, world: int, present: set[int]) -> Finding:
    """The ranks of ``world`` with no extras in the manifest (``present``: those with, fewer than
    ``world``), the first 8 named; every rank missing means the manifest's world size is wrong."""
    missing = []
    for rank in range(world):
        if rank not in present:
            missing.append(rank)
            if len(missing) == 8:
                break
    count = world - len(present)
    names = ", ".join(str(r) for r in missing) + (" ..." if count > len(missing) else "")
    path = step_dir / _layout.extras_name(missing[0]) if count == 1 else step_dir
    return finding(
        "missing-rank",
        path,
        f"{count} of {world} ranks have no extras in the manifest (rank {names})"
        if count > 1
        else f"rank {missing[0]} of {world} has no extras in the manifest",
        RESTORE_HINT
        if count < world
        else "the manifest's world_size does not match its files: do not restore it; "
        "restore an earlier step",
    )


def unreadable_metadata(
    step_dir: Path, manifest: Manifest, exc: CheckpointError | OSError
) -> list[Finding]:
    """Why the step's DCP ``.metadata`` could not be read (``read_dcp_index`` raised ``exc``);
    none for a data file shorter than its spans that the file checks already report (said once,
    as that file's)."""
    where = step_dir / _layout.STATE_DIR / DCP_METADATA
    if isinstance(exc, UnsafeCheckpointError):
        return [
            finding(
                "unsafe-path",
                where,
                str(exc).split(": DCP writes")[0].split("; ckptguard")[0],
                "do not restore this checkpoint: inspect it by hand, restore an earlier step",
            )
        ]
    if isinstance(exc, ShortDataFile):
        said = exc.data_file is not None and _short_said(step_dir, manifest, exc.data_file)
        return [] if said else [finding("bad-metadata", where, str(exc), RESTORE_HINT)]
    return [finding("bad-metadata", where, str(exc).split(";")[0], RESTORE_HINT)]


def _short_said(step_dir: Path, manifest: Manifest, data_file: str) -> bool:
    """Whether the file checks already report ``state/<data_file>`` (its size on disk is not the
    manifest's)."""
    entry = next((f for f in manifest.files if f.path == f"{_layout.STATE_DIR}/{data_file}"), None)
    try:
        return entry is not None and (step_dir / entry.path).stat().st_size != entry.size
    except OSError:
        return True


def key_findings(state: Path, lost: list[str], unrecorded: list[str]) -> list[Finding]:
    """The tensors the save recorded that DCP's metadata does not hold (``lost``), and those it
    holds of a recorded item that the manifest's layout-free table does not record
    (``unrecorded``)."""
    findings = []
    if lost:
        findings.append(
            finding(
                "missing-key",
                state / DCP_METADATA,
                f"does not hold the tensor(s) {_some(lost)} the save recorded in the manifest "
                "(the metadata lost or renamed its entries)",
                RESTORE_HINT,
            )
        )
    if unrecorded:
        findings.append(
            finding(
                "unrecorded-key",
                state / DCP_METADATA,
                f"holds the tensor(s) {_some(unrecorded)}, which the manifest's layout-free table "
                "does not record (the manifest or the metadata was edited)",
                RESTORE_HINT,
            )
        )
    return findings


def _some(keys: list[str]) -> str:
    return f"{keys[:3]}" + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")


def changed_bytes(path: Path, xxh3: str, recorded: str) -> Finding:
    """A file whose xxh3 (``verify --deep``) is not the one the manifest recorded."""
    return finding(
        "checksum",
        path,
        f"xxh3 {xxh3} differs from the manifest's {recorded} (the bytes changed after the save)",
        RESTORE_HINT,
    )
