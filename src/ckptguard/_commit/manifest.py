"""The commit marker: ``manifest.json``, written last, describing one committed step.

Contract: a step directory is committed when it holds a manifest that parses, has a
known format version, and names the step of its directory. The manifest lists every
file with its size and xxh3, the topology, the versions that wrote it and per-rank,
per-item digests of the state. Readers accept every format version up to ours.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.torch_version import TorchVersion

from ..errors import CheckpointCorruptError, CheckpointIncompleteError, VersionMismatchError
from .layout import MANIFEST_NAME

FORMAT_VERSION = 1
READABLE_VERSIONS = (1,)


def ckptguard_version() -> str:
    from .. import __version__

    return __version__


def current_versions() -> dict[str, str]:
    return {
        "torch": torch.__version__,
        "ckptguard": ckptguard_version(),
        "python": platform.python_version(),
    }


@dataclass(frozen=True)
class Manifest:
    """A parsed ``manifest.json``."""

    path: Path
    format_version: int
    step: int
    chain_id: str
    dir_template: str
    topology: dict[str, Any]
    versions: dict[str, str]
    items: dict[str, str]  # item name -> ItemKind value
    files: list[dict[str, Any]]  # {"path", "size", "xxh3", "rank"}
    digests: dict[str, dict[str, str]]  # str(rank) -> item -> digest
    contract: dict[str, Any]  # {"phase", "hash"}
    created_unix: float

    @property
    def world_size(self) -> int:
        return int(self.topology["world_size"])

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "path"}
        return out


def build(
    *,
    step: int,
    chain_id: str,
    dir_template: str,
    topology: dict[str, Any],
    items: dict[str, str],
    files: list[dict[str, Any]],
    digests: dict[str, dict[str, str]],
    contract: dict[str, Any],
) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "step": step,
        "chain_id": chain_id,
        "dir_template": dir_template,
        "topology": topology,
        "versions": current_versions(),
        "items": items,
        "files": sorted(files, key=lambda f: f["path"]),
        "digests": digests,
        "contract": contract,
        "created_unix": time.time(),
    }


_REQUIRED = ("format_version", "step", "topology", "versions", "items", "files", "digests")


def read(step_dir: Path) -> Manifest:
    """Parse the manifest of ``step_dir``; raise if the step is not committed."""
    path = step_dir / MANIFEST_NAME
    try:
        raw = path.read_text()
    except FileNotFoundError:
        raise CheckpointIncompleteError(
            f"{step_dir} has no {MANIFEST_NAME}: it was never committed (a save died before "
            "publishing it) and must not be restored; resume from the tracker's step"
        ) from None
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise CheckpointCorruptError(
            f"{path} is not valid JSON ({exc}); the manifest is written atomically, so this "
            "file was damaged after the fact: restore an earlier step"
        ) from None
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise CheckpointCorruptError(f"{path} lacks the fields {missing}; it is not a manifest")
    version = data["format_version"]
    if version not in READABLE_VERSIONS:
        raise VersionMismatchError(
            f"{path} has format version {version}; this ckptguard {ckptguard_version()} reads "
            f"versions {list(READABLE_VERSIONS)}. Upgrade ckptguard to read it."
        )
    return Manifest(
        path=path,
        format_version=version,
        step=int(data["step"]),
        chain_id=str(data.get("chain_id", "")),
        dir_template=str(data.get("dir_template", "")),
        topology=data["topology"],
        versions=data["versions"],
        items=data["items"],
        files=data["files"],
        digests=data["digests"],
        contract=data.get("contract", {}),
        created_unix=float(data.get("created_unix", 0.0)),
    )


def check_torch_version(manifest: Manifest, *, allow_newer: bool) -> None:
    """Refuse, before any read, a checkpoint written by a newer torch than ours."""
    written = manifest.versions.get("torch", "0")
    if allow_newer or TorchVersion(written.split("+")[0]) <= torch.__version__.split("+")[0]:
        return
    raise VersionMismatchError(
        f"{manifest.path.parent} was written by torch {written}; this process runs torch "
        f"{torch.__version__}. Newer torch can write formats an older one misreads (e.g. "
        "DTensor layouts). Restore with the image that wrote it, or pass "
        "CheckpointConfig(allow_newer_torch=True) after checking it reads correctly."
    )
