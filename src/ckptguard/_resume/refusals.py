"""What a restore says when it refuses a step (``restore``): each error it raises, built with its
message.

Every message says what differs, where (step, directory, rank) and what to do. Built here, off the
path of a restore that succeeds: ``restore`` enters this module only to refuse. The diagnoses a
refusal carries are here too: whether the step's files changed on disk since the save
(``changed_files``, which tells a damaged checkpoint from a ``load_state_dict`` that dropped
something), and which tensors an item lost or gained in the load (``tensor_keys_changed``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .._disk.filedigest import file_digest
from .._records import manifest as _manifest
from .._records.entries import FileEntry
from .._records.manifest import safe_member
from .._state import state as _state
from ..errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointIncompleteError,
    StateMismatchError,
    UnsafeCheckpointError,
)

# a problem of the step's files (its DCP metadata), never blamed on the objects passed
DAMAGED = "damaged: "


def some(keys: list[str], n: int = 8) -> str:
    return f"{keys[:n]}{' ...' if len(keys) > n else ''}"


# ---------------------------------------------------------------- the plan (items and keys)


def kind_changed(name: str, saved_kind: str, kind: str) -> str:
    """An item passed as another kind than the one saved."""
    if "value" in (kind, saved_kind):
        # A plain value is a snapshot: the caller passes one of the type it saved and reads
        # the restored one back from the state dict (a float does not become a tensor).
        return (
            f"item {name!r} was saved as a {saved_kind} and is passed as a {kind} now: "
            f"pass the same type the run saved (e.g. a float for a float) and read it back "
            f"from the state after restore"
        )
    return f"item {name!r} is a {kind} now but was saved as a {saved_kind}"


def plan_refused(step: int, step_dir: Path, bad: dict[int, list[str]]) -> CheckpointError:
    """Rank 0's verdict on every rank's plan problems: a damaged step (``DAMAGED``) before a state
    that does not match, each named by its first rank."""
    damaged = {r: p for r, found in bad.items() for p in found if p.startswith(DAMAGED)}
    if damaged:
        r0 = min(damaged)
        return CheckpointCorruptError(
            f"restore of step {step} from {step_dir}: rank {r0}: "
            f"{damaged[r0].removeprefix(DAMAGED)}; restore an earlier step"
        )
    r0 = min(bad)
    return StateMismatchError(
        f"restore of step {step} from {step_dir}: the state does not match the "
        f"checkpoint (rank {r0}: {'; '.join(bad[r0])}). Restore into objects like the saving run's "
        "(modules and optimizers built the same way, plain values of the same type)."
    )


def read_failed(step: int, path: Path, rank: int, exc: BaseException) -> CheckpointCorruptError:
    """The tensor state of the step did not read (DCP's error, its last line)."""
    detail = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
    return CheckpointCorruptError(
        f"reading the tensor state of step {step} from {path} failed on rank {rank}: "
        f"{detail}. If shapes differ, restore into objects built like the saving run's; otherwise "
        "run `ckptguard verify --deep` on the step."
    )


# ---------------------------------------------------------------- the extras and the external files


def extras_foreign(path: Path, rank: int, lacking: list[str]) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"{path} (rank {rank}) is not the extras file ckptguard wrote for this step (its "
        f"'items' table lacks {lacking}); "
        "restore an earlier step"
    )


def extras_missing(path: Path, rank: int) -> CheckpointIncompleteError:
    return CheckpointIncompleteError(f"{path} is missing (rank {rank}); restore an earlier step")


def extras_unsafe(path: Path, rank: int, exc: BaseException) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{path} (rank {rank}) does not load with torch.load(weights_only=True): {exc}. It was not "
        f"written by ckptguard or was changed; do not load it unsafely: restore an earlier step."
    )


def external_missing(where: str, path: Path | None) -> CheckpointIncompleteError:
    return CheckpointIncompleteError(
        f"{where} is listed in the manifest but "
        f"{'leaves the step directory' if path is None else 'absent'}; restore an earlier step "
        f"(restore(path=...)) or copy the file back, then run `ckptguard verify`"
    )


def external_changed(where: str, size: int, xxh3: str, entry: FileEntry) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"{where} has {size} bytes and xxh3 {xxh3}, the manifest says {entry.size} bytes and xxh3 "
        f"{entry.xxh3}: it changed after the commit and is not handed to the framework. Restore an "
        f"earlier step (restore(path=...)) or copy the file back from where it was written"
    )


def unlisted_external(step_dir: Path, rel: str, folder: str, step: int) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"{step_dir / rel} is in the external folder {folder}/ of step {step} but not in its "
        f"manifest (planted or left after the commit); the framework would load it unchecked, so "
        f"nothing is restored. Find out who wrote it and delete it (`ckptguard verify` lists it), "
        f"or restore an earlier step"
    )


# ---------------------------------------------------------------- the restored state against the
# save


def skeleton_differs(name: str, kind: str, saved: Any, now: Any) -> str:
    """An item whose structure or non-tensor values differ from its extras file after the load."""
    return (
        f"state item {name!r} ({kind}) differs after restore from what was saved (its "
        f"structure or a non-tensor value such as a "
        f"hyperparameter{tensor_keys_changed(saved, now)}). Do not train on: fix the object's "
        f"load_state_dict, or restore into an object built with the saved configuration."
    )


def structure_only(manifest: _manifest.Manifest, name: str) -> CheckpointCorruptError:
    """Its saved digest does not cover the tensor bytes and nothing else recorded does: never a
    pass."""
    return CheckpointCorruptError(
        f"restore of step {manifest.step} from {manifest.path.parent}: item {name!r} "
        f"records only a structure digest (format 3) and the manifest has no layout-free "
        f"digests for its tensors, so its bytes cannot be compared; the manifest was "
        f"edited: restore an earlier step"
    )


def digests_differ(step: int, bad: dict[int, list[str]]) -> StateMismatchError:
    return StateMismatchError(
        f"restore of step {step}: "
        + " | ".join(f"rank {r}: {'; '.join(p)}" for r, p in bad.items())
    )


def tensor_keys_changed(saved: Any, now: Any) -> str:
    """The tensors the item lost or gained in the load (an optimizer moment dropped, AReaL PR#1468),
    or ''."""
    before, after = _state.tensor_keys(saved), _state.tensor_keys(now)
    lost, gained = sorted(before - after), sorted(after - before)
    parts = ([f"tensors saved and missing after the load: {some(lost)}"] if lost else []) + (
        [f"tensors the save did not hold: {some(gained)}"] if gained else []
    )
    return f"; {'; '.join(parts)}" if parts else ""


def changed_files(manifest: _manifest.Manifest, rank: int) -> list[str]:
    """When an item's digest differs, say whether the bytes on disk changed since the save.

    A flipped byte in a shard otherwise reads as "fix load_state_dict"; the files' xxh3 tell
    the two apart. Only this rank's files and the shared ones are hashed (what it read)."""

    step_dir = manifest.path.parent
    changed = []
    for entry in manifest.files:
        if entry.rank not in (None, rank) and not entry.path.startswith("state/"):
            continue
        path = safe_member(step_dir, entry.path)
        if path is None or not path.is_file():
            continue
        if file_digest(str(path))[1] != entry.xxh3:
            changed.append(str(path))
    if not changed:
        return [
            "the files' checksums still match the manifest, so the difference "
            "comes from the restore path"
        ]
    return [
        f"file(s) changed on disk since the save (xxh3 differs from the manifest): "
        f"{', '.join(changed[:5])}; the checkpoint is damaged, not the code: run `ckptguard verify "
        f"--deep {step_dir}` and restore(path=<an older committed step>)"
    ]
