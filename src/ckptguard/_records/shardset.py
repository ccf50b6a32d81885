"""A step's shard set against its manifest (``check_shard_set``, part of ``checks.verify_step``): every rank's
extras listed, every file DCP's ``.metadata`` points at listed and long enough, and the tensor keys the
metadata holds equal to those the manifest's layout-free table recorded. Findings, never a raise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .._disk import layout as _layout
from ..errors import CheckpointError, UnsafeCheckpointError
from ..storage.base import DCP_METADATA
from ..storage.dcpindex import read_dcp_index
from ..storage.dcpstructure import ShortDataFile
from . import manifest as _manifest
from .findings import RESTORE_HINT, Finding, finding


def check_shard_set(step_dir: Path, manifest: _manifest.Manifest) -> list[Finding]:
    """Every rank's extras and every file DCP's metadata points at must be listed."""
    listed = {f.path for f in manifest.files}
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
            finding(
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
            finding(
                "missing-file",
                state / DCP_METADATA,
                "DCP metadata is not in the manifest",
                RESTORE_HINT,
            ),
        ]
    try:
        md = read_dcp_index(state)
    except UnsafeCheckpointError as exc:
        return [
            *findings,
            finding(
                "unsafe-path",
                state / DCP_METADATA,
                str(exc).split(": DCP writes")[0].split("; ckptguard")[0],
                "do not restore this checkpoint: inspect it by hand, restore an earlier step",
            ),
        ]
    except (
        ShortDataFile
    ) as exc:  # a data file shorter than its spans: said once, as the file's own finding
        said = exc.data_file is not None and _short_said(step_dir, manifest, exc.data_file)
        return (
            findings
            if said
            else [*findings, finding("bad-metadata", state / DCP_METADATA, str(exc), RESTORE_HINT)]
        )
    except (CheckpointError, OSError) as exc:
        return [
            *findings,
            finding("bad-metadata", state / DCP_METADATA, str(exc).split(";")[0], RESTORE_HINT),
        ]
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
                    "the manifest lists this data file but the DCP metadata points at none of its bytes "
                    "(the metadata lost its tensor entries)",
                    RESTORE_HINT,
                )
            )
    return findings


def _missing_keys(state: Path, manifest: _manifest.Manifest, md: Any) -> list[Finding]:
    """A tensor the save recorded (its layout-free digest) that the DCP metadata does not hold: a key
    renamed or dropped in ``.metadata`` (its checksum fixed to match) would otherwise pass every check
    here and be refused only by the restore, which expects it."""
    table = md.state_dict_metadata
    recorded = manifest.layout_free or {}
    lost = sorted(
        key
        for keys in recorded.values()
        for key in keys
        if type(table.get(key)).__name__ != "TensorStorageMetadata"
    )
    # The other way round: a tensor of a recorded item (or of an item whose tensors only the table covers,
    # digest kind "structure") that the table lacks: restore compares both sets.
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


def _short_said(step_dir: Path, manifest: _manifest.Manifest, data_file: str) -> bool:
    """Whether the file checks already report ``state/<data_file>`` (its size on disk is not the manifest's)."""
    entry = next((f for f in manifest.files if f.path == f"{_layout.STATE_DIR}/{data_file}"), None)
    try:
        return entry is not None and (step_dir / entry.path).stat().st_size != entry.size
    except OSError:
        return True


def _item_of(key: str, items: list[str]) -> str | None:
    """The item a DCP key belongs to (``<item>.<name>``), the longest item name first."""
    return next((item for item in items if key.startswith(item + ".")), None)


def _some(keys: list[str]) -> str:
    return f"{keys[:3]}" + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")


def _extras_rank(rel: str) -> int | None:
    if (
        rel.startswith("rank_")
        and rel.endswith(".pt")
        and rel[5:-3].isdigit()
        and rel == _layout.extras_name(int(rel[5:-3]))
    ):
        return int(rel[5:-3])
    return None
