"""The node manifest of a step saved on node-local roots: ``node_manifest.json``, what one node
verified it holds (its ranks' files and the copies it received), written before the global manifest.

Only a step of format 2 ``nodes`` has one (``manifest``: its ``node_manifest`` and ``read_node`` add
the format version and the read bound of a manifest); a shared root, one rank's save among them,
never writes or reads it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .._disk.layout import NODE_MANIFEST_NAME, read_json
from .._types import JsonObject
from ..errors import CheckpointCorruptError
from .entries import FileEntry, files_from_json, files_to_json, is_int


@dataclass(frozen=True)
class NodeManifest:
    """A parsed ``node_manifest.json``: what node ``node`` verified it holds of step ``step``."""

    step: int
    node: int
    name: str
    ranks: tuple[int, ...]
    files: tuple[FileEntry, ...]
    format_version: int
    created_unix: float = 0.0

    def to_json(self) -> JsonObject:
        return {
            "format_version": self.format_version,
            "step": self.step,
            "node": self.node,
            "name": self.name,
            "ranks": list(self.ranks),
            "files": files_to_json(self.files),
            "created_unix": self.created_unix,
        }


def build(
    *,
    step: int,
    index: int,
    name: str,
    ranks: Iterable[int],
    files: Iterable[FileEntry],
    format_version: int,
) -> NodeManifest:
    """The node manifest of node ``index``, written now in ``format_version``."""
    return NodeManifest(
        step=step,
        node=index,
        name=name,
        ranks=tuple(sorted(ranks)),
        files=tuple(sorted(files, key=lambda f: f.path)),
        format_version=format_version,
        created_unix=time.time(),
    )


def read(step_dir: Path, *, limit: int, format_version: int) -> NodeManifest | None:
    """The node manifest of ``step_dir`` read bounded by ``limit`` bytes (None when absent), a file
    without a version read as ``format_version``; CheckpointCorruptError if malformed."""
    path = step_dir / NODE_MANIFEST_NAME
    try:
        data = read_json(path, limit=limit, what="node manifest")
    except FileNotFoundError:
        return None
    try:
        if not (
            isinstance(data, dict)
            and is_int(data.get("node"))
            and is_int(data.get("step"))
            and isinstance(data.get("ranks"), list)
            and all(is_int(r) for r in data["ranks"])
        ):
            raise ValueError
        return NodeManifest(
            step=data["step"],
            node=data["node"],
            name=str(data.get("name", "")),
            ranks=tuple(data["ranks"]),
            files=files_from_json(data.get("files")),
            format_version=data.get("format_version", format_version),
            created_unix=float(data.get("created_unix", 0.0)),
        )
    except (ValueError, TypeError):
        raise CheckpointCorruptError(
            f"{path}: not a node manifest ckptguard wrote (damaged or edited)"
        ) from None
