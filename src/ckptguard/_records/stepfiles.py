"""Which files of a committed step each node holds and each rank reads on the same layout: what verify
checks on a node-local root, what a restore fetches to a node (peer replicas, node-local roots, the tiers)
and what a node publishes.

Contract: names and manifest entries only (relative to the step directory); reads nothing but the step's
node manifest and DCP ``.metadata`` (through the torch-free reader the operator commands use); a node part
that does not match the global manifest is a finding, never a raise.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .._disk import layout as _layout
from ..errors import CheckpointError
from ..storage.base import DCP_METADATA
from ..storage.dcpindex import read_dcp_index
from . import manifest as _manifest
from .entries import FileEntry
from .findings import RESTORE_HINT, Finding, finding

__all__ = ["files_needed", "node_part", "rank_reads"]


def node_part(step_dir: Path, manifest: _manifest.Manifest) -> tuple[list[FileEntry] | None, list[Finding]]:
    """The files this disk must hold of the step: every file (one shared root), or on node-local
    roots (format 2 ``nodes``) the part of the node whose node manifest is here, which must match
    the global manifest. None, with the findings, when this disk holds no valid node part."""
    if not manifest.nodes:
        return list(manifest.files), []
    where = step_dir / _layout.NODE_MANIFEST_NAME
    try:
        node = _manifest.read_node(step_dir)
    except CheckpointError as exc:
        return None, [finding("bad-node-manifest", where, str(exc).split(": ", 1)[-1], RESTORE_HINT)]
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
        return None, [finding("bad-node-manifest", where, f"names node {index} of {len(manifest.nodes)}", RESTORE_HINT)]
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


def files_needed(step_dir: Path, manifest: _manifest.Manifest, rank: int) -> set[str]:
    """Files (relative to the step) that ``rank`` reads when restoring on the same layout:
    its extras, the DCP metadata, the shards it wrote, and the files of replicated keys."""
    return {_layout.extras_name(rank)} | rank_reads(read_dcp_index(step_dir / _layout.STATE_DIR), rank)


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
