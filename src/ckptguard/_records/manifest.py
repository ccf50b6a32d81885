"""The commit marker: ``manifest.json``, written last, describing one committed step.

Contract: a step directory is committed when it holds a manifest that parses, has a
known format version, and names the step of its directory. The manifest lists every
file with its size and xxh3, the topology, the versions that wrote it and per-rank,
per-item digests of the state. Readers accept every format version up to ours.

Format 2 adds ``nodes`` (written on node-local roots only): each node's ranks and the files
copied to it (replicated DCP files another node's rank wrote), so a node's part of the step is
its ranks' files plus those copies; and the node manifest, ``node_manifest.json``
(``nodemanifest``), that each node writes before the global manifest: its ranks' files and the
copies it verified.

Format 3 adds ``digest_kind`` (required): for every item, what its per-rank digests cover.
``"bytes"``: the whole item, every tensor byte included (every item of formats 1 and 2).
``"structure"``: the item's structure, each tensor's dtype and local shape and every non-tensor
value, not the tensor bytes, which the item's ``layout_free`` digests cover (tensor items:
modules, optimizers, tensor dicts). The save then reads each tensor byte once.

The files the manifest lists are also answered here: which of them each node holds (``node_part``:
what verify checks on a node-local root) and each rank reads on the same layout (``files_needed``,
``rank_reads``: what a restore fetches, what a node publishes); every listed path is opened through
``safe_member``. Names and entries only: nothing but the node manifest and DCP's ``.metadata``
(through the torch-free ``storage.dcpindex``) is read, and a node part that differs from the
manifest is a finding.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._disk import layout as _layout
from .._disk.layout import MANIFEST_NAME, parse_json, read_small
from .._types import JsonObject
from .._version import __version__
from ..errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointIncompleteError,
    RunStepError,
    VersionMismatchError,
)
from ..storage.base import DCP_METADATA
from ..storage.dcpindex import read_dcp_index
from . import nodemanifest
from .entries import (
    Cost,
    FileEntry,
    NodeEntry,
    Topology,
    files_from_json,
    files_to_json,
    is_int,
    nodes_from_json,
)
from .findings import RESTORE_HINT, Finding, finding
from .nodemanifest import NodeManifest as NodeManifest  # re-exported for its callers

FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
DIGEST_BYTES = "bytes"
DIGEST_STRUCTURE = "structure"
_DIGEST_KINDS = (DIGEST_BYTES, DIGEST_STRUCTURE)
_TENSOR_KINDS = ("module", "optimizer", "tensors")
"""The item kinds (``_state.state.ItemKind`` values) whose per-rank digest is a structure digest
(format 3)."""
RUN_KIND = "ckptguard-run"
"""The ``kind`` of a run step's manifest (``_records.runmanifest``): its roles' parts are steps of
this format."""


def ckptguard_version() -> str:
    return __version__


def safe_member(step_dir: Path, rel: str) -> Path | None:
    """``step_dir/rel`` if it stays inside ``step_dir`` without following a symlink out: every path
    a manifest lists (``FileEntry.path``) is opened through this, so an edited manifest cannot point
    outside the step."""
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


@dataclass(frozen=True)
class Manifest:
    """A parsed ``manifest.json``."""

    path: Path
    format_version: int
    step: int
    chain_id: str
    dir_template: str
    topology: Topology
    versions: dict[str, str]
    items: dict[str, str]  # item name -> ItemKind value
    files: tuple[FileEntry, ...]  # sorted by path
    digests: dict[str, dict[str, str]]  # str(rank) -> item -> digest
    contract: dict[str, Any]  # {"phase", "hash"}
    created_unix: float
    cost: Cost | None = None  # size and save time (optional in format 1: older manifests lack it)
    layout_free: dict[str, dict[str, str]] | None = (
        None  # item -> key -> digest no sharding changes (optional)
    )
    reshard: dict[str, dict[str, Any]] | None = (
        None  # item -> its declared reshard rule (optional, _resume/reshard)
    )
    nodes: tuple[NodeEntry, ...] | None = None  # format 2, node-local roots
    digest_kind: dict[str, str] | None = (
        None  # format 3: item -> "bytes" | "structure" (None: all "bytes")
    )

    def digest_covers_bytes(self, item: str) -> bool:
        """Whether ``item``'s per-rank digests cover its tensor bytes (formats 1 and 2: every
        item)."""
        return (self.digest_kind or {}).get(item, DIGEST_BYTES) == DIGEST_BYTES

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    def node_of(self, rank: int) -> int | None:
        """The index of the node that holds ``rank``'s files (None: one shared root holds every
        file)."""
        for index, node in enumerate(self.nodes or ()):
            if rank in node.ranks:
                return index
        return None

    def node_files(self, index: int) -> list[FileEntry]:
        """The files node ``index`` holds: its ranks' files and the copies it received."""
        node = (self.nodes or ())[index]
        ranks, copies = set(node.ranks), set(node.copies)
        return [f for f in self.files if f.rank in ranks or f.path in copies]

    def to_json(self) -> JsonObject:
        """The ``manifest.json`` object: every field but the path; the optional ones only when
        set."""
        out: dict[str, Any] = {
            "format_version": self.format_version,
            "step": self.step,
            "chain_id": self.chain_id,
            "dir_template": self.dir_template,
            "topology": self.topology.to_json(),
            "versions": self.versions,
            "items": self.items,
            "files": files_to_json(self.files),
            "digests": self.digests,
            "contract": self.contract,
            "created_unix": self.created_unix,
        }
        optional = {
            "cost": None if self.cost is None else self.cost.to_json(),
            "layout_free": self.layout_free,
            "reshard": self.reshard,
            "digest_kind": self.digest_kind,
            "nodes": None if self.nodes is None else [n.to_json() for n in self.nodes],
        }
        return {**out, **{k: v for k, v in optional.items() if v is not None}}


def build(
    *,
    path: Path,
    step: int,
    chain_id: str,
    dir_template: str,
    topology: Topology,
    items: dict[str, str],
    files: Iterable[FileEntry],
    digests: dict[str, dict[str, str]],
    contract: JsonObject,
    versions: dict[str, str],
    cost: Cost | None = None,
    layout_free: dict[str, dict[str, str]] | None = None,
    reshard: dict[str, JsonObject] | None = None,
    nodes: Sequence[NodeEntry] | None = None,
    digest_kind: dict[str, str] | None = None,
) -> Manifest:
    """The manifest of a step being committed at ``path`` (written by the caller with ``to_json``);
    ``versions``: ``storage.dcp.current_versions()`` of the writing process."""
    return Manifest(
        path=path,
        format_version=FORMAT_VERSION,
        step=step,
        chain_id=chain_id,
        dir_template=dir_template,
        topology=topology,
        versions=versions,
        items=items,
        files=tuple(sorted(files, key=lambda f: f.path)),
        digests=digests,
        contract=contract,
        created_unix=time.time(),
        cost=cost,
        layout_free=layout_free,
        reshard=reshard,
        nodes=None if nodes is None else tuple(nodes),
        digest_kind=digest_kind,
    )


_LAYOUT = ("dp", "tp", "pp", "ep")


def _digest_table(table: object) -> bool:
    """The ``layout_free`` shape: item -> key -> digest (restore and verify --deep iterate it as
    such)."""
    return isinstance(table, dict) and all(
        isinstance(keys, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in keys.items())
        for keys in table.values()
    )


_REQUIRED = ("format_version", "step", "topology", "versions", "items", "files", "digests")

MANIFEST_BYTES = 256 << 20
"""Bound of one manifest read: about a million file entries."""
MAX_WORLD_SIZE = 1 << 20
"""Largest world size a manifest may claim; per-rank checks then stay bounded by the files
listed."""


def _str_map(value: Any) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    )


def _shape_problem(data: JsonObject) -> str | None:
    """Why ``data`` is not shaped like a manifest ckptguard writes, or None."""
    if not is_int(data["step"]) or data["step"] < 0:
        return f"'step' must be a non-negative int, not {data['step']!r:.40}"
    if not _str_map(data["versions"]):
        return "'versions' must map names to version strings"
    if not _str_map(data["items"]):
        return "'items' must map item names to kinds"
    digests = data["digests"]
    if not isinstance(digests, dict) or not all(_str_map(d) for d in digests.values()):
        return "'digests' must map ranks to {item: digest} objects"
    if not isinstance(data.get("contract", {}), dict):
        return "'contract' must be an object"
    if not isinstance(data.get("chain_id", ""), str) or not isinstance(
        data.get("dir_template", ""), str
    ):
        return "'chain_id' and 'dir_template' must be strings"
    if not isinstance(data.get("created_unix", 0.0), (int, float)):
        return "'created_unix' must be a number"
    if data["format_version"] >= 3:
        kinds: Any = data.get("digest_kind")
        if (
            not _str_map(kinds)
            or set(kinds) != set(data["items"])
            or not set(kinds.values()) <= set(_DIGEST_KINDS)
        ):
            # A reader that took a missing table as "bytes" would compare structure digests with
            # bytes digests.
            return f"'digest_kind' must map every item to one of {list(_DIGEST_KINDS)} (format 3)"
        wrong = sorted(
            n
            for n, k in data["items"].items()
            if isinstance(k, str)
            and kinds[n] != (DIGEST_STRUCTURE if k in _TENSOR_KINDS else DIGEST_BYTES)
        )
        if wrong:
            # The save writes one kind per item kind; an edited kind would make restore and verify
            # compare differently (one a structure digest, the other the bytes): refused alike, on
            # read.
            return (
                f"'digest_kind' of {wrong} disagrees with the item kind (tensor "
                f'items record "structure", '
                'every other item "bytes")'
            )
        if DIGEST_STRUCTURE in kinds.values() and not isinstance(data.get("layout_free"), dict):
            # The tensor bytes of such items are covered by their layout-free digests alone.
            return (
                "items with 'digest_kind' \"structure\" need the 'layout_free' table, which is "
                "absent"
            )
    return None


def read(step_dir: Path) -> Manifest:
    """Parse the manifest of ``step_dir``; raise if the step is not committed.

    The file is read bounded, never through a link or from a FIFO, and every field is
    checked for the shape ckptguard writes, so a damaged or crafted manifest is one
    CheckpointCorruptError, never a KeyError or TypeError further on."""
    path = step_dir / MANIFEST_NAME
    try:
        raw = read_small(path, limit=MANIFEST_BYTES, what="manifest")
    except FileNotFoundError:
        raise CheckpointIncompleteError(
            f"{step_dir} has no {MANIFEST_NAME}: it was never committed (a save died before "
            "publishing it) and must not be restored; resume from the tracker's step"
        ) from None
    try:
        data = parse_json(raw, where=str(path))
    except CheckpointCorruptError as exc:
        raise CheckpointCorruptError(
            f"{exc}; the manifest is written atomically, so this file was damaged after the fact: "
            "restore an earlier step"
        ) from None
    if not isinstance(data, dict):
        raise CheckpointCorruptError(
            f"{path} holds a JSON {type(data).__name__}, not a manifest object"
        )
    if data.get("kind") == RUN_KIND:
        # A run step is committed as a whole; one role's part read as the step would miss the
        # others.
        roles = sorted(data["roles"]) if isinstance(data.get("roles"), dict) else []
        raise RunStepError(
            f"{step_dir} is a run step of several roles ({', '.join(map(str, roles[:8]))}) written "
            f"by ckptguard.RunCheckpoint: restore it with RunCheckpoint(...).restore, or one "
            f"role's part alone with restore(path='{step_dir}/<role>')"
        )
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise CheckpointCorruptError(f"{path} lacks the fields {missing}; it is not a manifest")
    version = data["format_version"]
    if not is_int(version):
        raise CheckpointCorruptError(
            f"{path}: 'format_version' must be an int, not {version!r:.40}"
        )
    if version not in READABLE_VERSIONS:
        raise VersionMismatchError(
            f"{path} has format version {version}; this ckptguard {ckptguard_version()} reads "
            f"versions {list(READABLE_VERSIONS)}. Upgrade ckptguard to read it."
        )
    problem = _shape_problem(data)
    try:
        if problem is not None:
            raise ValueError(problem)
        topology = Topology.from_json(data["topology"], max_world=MAX_WORLD_SIZE)
        # Every format writes the four sizes; one missing would make every restore refuse the step
        # as saved by another layout, after verify had passed it.
        lacking = [
            k
            for k in _LAYOUT
            if not (
                is_int(topology.layout.get(k)) and 1 <= topology.layout[k] <= topology.world_size
            )
        ]
        if lacking:
            raise ValueError(f"'topology' lacks a size in 1..world_size for {lacking}")
        table = data.get("layout_free")
        if table is not None and not _digest_table(table):
            raise ValueError(
                "'layout_free' must map each item to an object of key -> digest string"
            )
        files = files_from_json(data["files"])
        nodes = nodes_from_json(data["nodes"], topology.world_size) if "nodes" in data else None
    except ValueError as exc:
        raise CheckpointCorruptError(
            f"{path}: {exc}; this is not a manifest ckptguard wrote (damaged or edited): "
            "restore an earlier step"
        ) from None
    return Manifest(
        path=path,
        format_version=version,
        step=data["step"],
        chain_id=data.get("chain_id", ""),
        dir_template=data.get("dir_template", ""),
        topology=topology,
        versions=data["versions"],
        items=data["items"],
        files=files,
        digests=data["digests"],
        contract=data.get("contract", {}),
        created_unix=float(data.get("created_unix", 0.0)),
        cost=Cost.from_json(data.get("cost")),
        layout_free=data["layout_free"] if isinstance(data.get("layout_free"), dict) else None,
        reshard=_rules(data.get("reshard")),
        nodes=nodes,
        digest_kind=data["digest_kind"] if version >= 3 else None,
    )


def _rules(value: Any) -> dict[str, JsonObject] | None:
    """The optional per-item reshard rules; a malformed table reads as none (the restore then asks
    for rules)."""
    if isinstance(value, dict) and all(
        isinstance(v, dict) and isinstance(v.get("rule"), str) for v in value.values()
    ):
        return value
    return None


def node_manifest(
    *, step: int, index: int, name: str, ranks: Iterable[int], files: Iterable[FileEntry]
) -> NodeManifest:
    """The node manifest of node ``index`` (written with ``to_json``): what that node verified it
    holds."""
    return nodemanifest.build(
        step=step, index=index, name=name, ranks=ranks, files=files, format_version=FORMAT_VERSION
    )


def read_node(step_dir: Path) -> NodeManifest | None:
    """This disk's node manifest of ``step_dir`` (None when absent); CheckpointCorruptError if
    malformed."""
    return nodemanifest.read(step_dir, limit=MANIFEST_BYTES, format_version=FORMAT_VERSION)


# ---------------------------------------------------------------- the files each node holds, each
# rank reads


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
                f"is absent: the step was saved on node-local roots ({len(manifest.nodes)} "
                f"nodes), and this disk holds no node's part of it (its node manifest is "
                f"written with the node's files)",
                "run this on a node that saved the step, or copy that node's part "
                "here (`ckptguard transfer`)",
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
                f"lists other files than the global manifest gives node {index} "
                f"({manifest.nodes[index].name}) of step {manifest.step}",
                RESTORE_HINT,
            )
        ]
    return expected, []


def files_needed(step_dir: Path, manifest: Manifest, rank: int) -> set[str]:
    """Files (relative to the step) that ``rank`` reads when restoring on the same layout:
    its extras, the DCP metadata, the shards it wrote, and the files of replicated keys."""
    return {_layout.extras_name(rank)} | rank_reads(
        read_dcp_index(step_dir / _layout.STATE_DIR), rank
    )


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
