"""A node-local root's node manifest (``node_manifest.json``, format 2): what one node verified it holds of a
step, written before the global manifest; and which files of a step a disk must hold (``node_part``: every
file on a shared root, the node's part on node-local roots, checked against the global manifest; what verify
checks). Names and entries only: a node part that differs from the manifest is a finding."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .._disk import layout as _layout
from .._disk.layout import NODE_MANIFEST_NAME, read_json
from .._types import JsonObject
from ..errors import CheckpointCorruptError, CheckpointError
from .entries import FileEntry, files_from_json, files_to_json, is_int
from .findings import RESTORE_HINT, Finding, finding
from .manifest import FORMAT_VERSION, MANIFEST_BYTES, Manifest


@dataclass(frozen=True)
class NodeManifest:
    """A parsed ``node_manifest.json``: what node ``node`` verified it holds of step ``step``."""

    step: int
    node: int
    name: str
    ranks: tuple[int, ...]
    files: tuple[FileEntry, ...]
    format_version: int = FORMAT_VERSION
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


def node_manifest(
    *, step: int, index: int, name: str, ranks: Iterable[int], files: Iterable[FileEntry]
) -> NodeManifest:
    """The node manifest of node ``index`` (written with ``to_json``): what that node verified it holds."""
    return NodeManifest(
        step=step,
        node=index,
        name=name,
        ranks=tuple(sorted(ranks)),
        files=tuple(sorted(files, key=lambda f: f.path)),
        created_unix=time.time(),
    )


def read_node(step_dir: Path) -> NodeManifest | None:
    """This disk's node manifest of ``step_dir`` (None when absent); CheckpointCorruptError if malformed."""
    path = step_dir / NODE_MANIFEST_NAME
    try:
        data = read_json(path, limit=MANIFEST_BYTES, what="node manifest")
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
            format_version=data.get("format_version", FORMAT_VERSION),
            created_unix=float(data.get("created_unix", 0.0)),
        )
    except (ValueError, TypeError):
        raise CheckpointCorruptError(
            f"{path}: not a node manifest ckptguard wrote (damaged or edited)"
        ) from None


# ---------------------------------------------------------------- the files each node holds, each rank reads


def node_part(step_dir: Path, manifest: Manifest) -> tuple[list[FileEntry] | None, list[Finding]]:
    """The files this disk must hold of the step: every file (one shared root), or on node-local
    roots (format 2 ``nodes``) the part of the node whose node manifest is here, which must match
    the global manifest. None, with the findings, when this disk holds no valid node part."""
    if not manifest.nodes:
        return list(manifest.files), []
    where = step_dir / _layout.NODE_MANIFEST_NAME
    try:
        node = read_node(step_dir)
    except CheckpointError as exc:
        return None, [
            finding("bad-node-manifest", where, str(exc).split(": ", 1)[-1], RESTORE_HINT)
        ]
    if node is None:
        return None, [
            finding(
                "no-node-manifest",
                where,
                f"is absent: the step was saved on node-local roots ({len(manifest.nodes)} nodes), and this disk "
                "holds no node's part of it (its node manifest is written with the node's files)",
                "run this on a node that saved the step, or copy that node's part here (`ckptguard transfer`)",
            )
        ]
    index = node.node
    if not 0 <= index < len(manifest.nodes):
        return None, [
            finding(
                "bad-node-manifest",
                where,
                f"names node {index} of {len(manifest.nodes)}",
                RESTORE_HINT,
            )
        ]
    expected = manifest.node_files(index)

    def key(files: Iterable[FileEntry]) -> list[tuple[str, int, str]]:
        return sorted((f.path, f.size, f.xxh3) for f in files)

    if node.step != manifest.step or key(node.files) != key(expected):
        return None, [
            finding(
                "bad-node-manifest",
                where,
                f"lists other files than the global manifest gives node {index} ({manifest.nodes[index].name}) "
                f"of step {manifest.step}",
                RESTORE_HINT,
            )
        ]
    return expected, []
