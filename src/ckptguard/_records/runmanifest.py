"""The commit marker of a run step: one ``manifest.json`` listing every role, written last.

A run (``ckptguard.RunCheckpoint``) holds several roles (actor, critic, ref, driver, ...), each
on its own ranks. One run step directory holds every role's part, each a step directory of
the single-role format (so plain DCP reads ``<role>/state``)::

    step_00000100/
      manifest.json      the RUN manifest (kind "ckptguard-run"): step, chain, every role with
                         its ranks and the size and xxh3 of its part's manifest; written last
      actor/             manifest.json, state/ (DCP), rank_00000.pt ... (the actor's ranks)
      critic/ ...

Contract: a run step is committed when its run manifest parses, names its step, and every role
it lists has its part: a role manifest with the recorded size and xxh3, of the same step and
chain, whose own files check out. A step missing a role, or with a role's part damaged, is
not committed: restore refuses it naming the role, and verify and retention count it as
incomplete (retention never deletes it). The parts are written into the run's temp directory
and the whole directory is renamed once, so a crash between two roles leaves only a temp
directory and the tracker's step stays the resume target.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from .._disk import layout as _layout
from .._types import JsonObject
from ..errors import (
    CheckpointCorruptError,
    CheckpointIncompleteError,
    ConfigError,
    VersionMismatchError,
)
from . import manifest as _manifest

RUN_FORMAT_VERSION = 1
READABLE_RUN_VERSIONS = (1,)
RUN_KIND = _manifest.RUN_KIND

_ROLE_NAME = re.compile(r"[a-z][a-z0-9_-]{0,63}\Z")
_RESERVED = {_layout.STATE_DIR, _layout.CONTRACT_DIR, _layout.PROOF_DIR}


def check_role_name(name: Any) -> str:
    """A role name is a directory name inside the step: lowercase, short, not one of ours."""
    if not isinstance(name, str) or not _ROLE_NAME.match(name) or name in _RESERVED:
        raise ConfigError(
            f"role name {name!r} must match [a-z][a-z0-9_-]* (at most 64 characters) and not "
            f"be one of {sorted(_RESERVED)}: it names the role's directory inside each step, "
            f"e.g. 'actor' or 'critic'"
        )
    return name


@dataclass(frozen=True)
class RoleEntry:
    """One role as the run manifest records it."""

    ranks: list[int]  # ranks of the run's group that hold this role, in role-rank order
    manifest_bytes: int
    manifest_xxh3: str

    def to_json(self) -> JsonObject:
        return {
            "ranks": list(self.ranks),
            "manifest_bytes": self.manifest_bytes,
            "manifest_xxh3": self.manifest_xxh3,
        }

    @classmethod
    def from_json(cls, value: object) -> RoleEntry:
        if not isinstance(value, dict) or not _role_entry(value):
            raise ValueError(
                "'roles' must map role names to {ranks, manifest_bytes, manifest_xxh3}"
            )
        return cls(list(value["ranks"]), value["manifest_bytes"], value["manifest_xxh3"])


@dataclass(frozen=True)
class RunManifest:
    path: Path
    run_format_version: int
    step: int
    chain_id: str
    dir_template: str
    world_size: int
    roles: dict[str, RoleEntry]
    versions: dict[str, str]
    contract: dict[str, Any]
    created_unix: float

    def to_json(self) -> JsonObject:
        return {
            "kind": RUN_KIND,
            "run_format_version": self.run_format_version,
            "step": self.step,
            "chain_id": self.chain_id,
            "dir_template": self.dir_template,
            "world_size": self.world_size,
            "roles": {name: e.to_json() for name, e in self.roles.items()},
            "versions": self.versions,
            "contract": self.contract,
            "created_unix": self.created_unix,
        }


def build(
    *,
    step_dir: Path,
    step: int,
    chain_id: str,
    dir_template: str,
    world_size: int,
    roles: dict[str, list[int]],
    contract: JsonObject,
    versions: dict[str, str],
) -> RunManifest:
    """The run manifest of the parts already written under ``step_dir`` (a temp directory)."""
    entries = {}
    for name, ranks in roles.items():
        size, xxh3 = role_manifest_digest(step_dir / name)
        entries[name] = RoleEntry(sorted(ranks), size, xxh3)
    return RunManifest(
        path=step_dir / _layout.MANIFEST_NAME,
        run_format_version=RUN_FORMAT_VERSION,
        step=step,
        chain_id=chain_id,
        dir_template=dir_template,
        world_size=world_size,
        roles=entries,
        versions=versions,
        contract=contract,
        created_unix=time.time(),
    )


def role_manifest_digest(part: Path) -> tuple[int, str]:
    """(size, xxh3) of a role's manifest, read through the bounded reader: a FIFO or a link planted
    there is refused at once (UnsafeCheckpointError), never opened and waited on."""
    raw = _layout.read_small(
        part / _layout.MANIFEST_NAME, limit=_manifest.MANIFEST_BYTES, what="role manifest"
    )
    return len(raw), xxhash.xxh3_64_hexdigest(raw)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _role_entry(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and isinstance(value.get("ranks"), list)
        and all(_int(r) and r >= 0 for r in value["ranks"])
        and _int(value.get("manifest_bytes"))
        and isinstance(value.get("manifest_xxh3"), str)
    )


def read(step_dir: Path) -> RunManifest:
    """Parse the run manifest of ``step_dir``; raise if the step is not a committed run step."""
    path = step_dir / _layout.MANIFEST_NAME
    try:
        raw = _layout.read_small(path, limit=_manifest.MANIFEST_BYTES, what="run manifest")
    except FileNotFoundError:
        present = (
            sorted(p.name for p in step_dir.iterdir() if p.is_dir()) if step_dir.is_dir() else []
        )
        raise CheckpointIncompleteError(
            f"{step_dir} has no {_layout.MANIFEST_NAME}: the run step was never committed (a save "
            f"died before every role confirmed; role parts present: {present or 'none'}) and must "
            f"not be restored; resume from the tracker's step"
        ) from None
    data = _layout.parse_json(raw, where=str(path))
    if not isinstance(data, dict) or data.get("kind") != RUN_KIND:
        raise CheckpointCorruptError(
            f"{path} is not a run manifest (no kind {RUN_KIND!r}): the step was written by a "
            f"single-role CheckpointManager; restore it with CheckpointManager, not RunCheckpoint"
        )
    version = data.get("run_format_version")
    if not _int(version):
        raise CheckpointCorruptError(
            f"{path}: 'run_format_version' must be an int, not {version!r:.40}"
        )
    if version not in READABLE_RUN_VERSIONS:
        raise VersionMismatchError(
            f"{path} has run format version {version}; this ckptguard "
            f"{_manifest.ckptguard_version()} reads versions {list(READABLE_RUN_VERSIONS)}. "
            f"Upgrade ckptguard to read it."
        )
    roles = data.get("roles")
    problem = None
    if not _int(data.get("step")) or data["step"] < 0:
        problem = "'step' must be a non-negative int"
    elif (
        not isinstance(roles, dict) or not roles or not all(_role_entry(v) for v in roles.values())
    ):
        problem = "'roles' must map role names to {ranks, manifest_bytes, manifest_xxh3}"
    elif not all(isinstance(k, str) and _ROLE_NAME.match(k) and k not in _RESERVED for k in roles):
        problem = f"role names {sorted(map(str, roles))[:8]} are not names ckptguard writes"
    elif not _int(data.get("world_size")) or data["world_size"] < 1:
        problem = "'world_size' must be an int >= 1"
    if problem is not None or not isinstance(roles, dict):
        raise CheckpointCorruptError(
            f"{path}: {problem}; damaged or edited after the commit: restore an earlier step"
        )
    return RunManifest(
        path=path,
        run_format_version=version,
        step=data["step"],
        chain_id=str(data.get("chain_id", "")),
        dir_template=str(data.get("dir_template", "")),
        world_size=data["world_size"],
        roles={k: RoleEntry.from_json(v) for k, v in roles.items()},
        versions=data["versions"] if isinstance(data.get("versions"), dict) else {},
        contract=data["contract"] if isinstance(data.get("contract"), dict) else {},
        created_unix=float(data.get("created_unix", 0.0)),
    )
