"""A real restore without model code: ``python -m ckptguard.ops._offline STEP_DIR``.

Contract: in a fresh process, allocate every tensor from the checkpoint's own DCP
metadata (shape, dtype), load it with DCP through the restricted metadata reader,
rebuild each rank's items from its extras, and recompute each rank's per-item digests
for comparison with the manifest. A correct save digest is not a restore test (the
guide, 3.5); this is one. Prints one JSON object on stdout.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .._commit import layout as _layout
from .._commit import manifest as _manifest
from .._resume.digest import digest
from .._resume.state import ItemKind, _unflatten
from ..storage.dcp import _SafeReader
from ..storage.unpickler import read_dcp_metadata

Shapes = dict[str, tuple[tuple[int, ...], torch.dtype]]
Owners = dict[str, dict[int, tuple[tuple[int, ...], tuple[int, ...]]]]


def _layout_of(step_dir: Path) -> tuple[Shapes, Owners]:
    """Each key's full shape and dtype; for each key, which rank wrote which chunk."""
    md = read_dcp_metadata(step_dir / _layout.STATE_DIR)
    shapes: Shapes = {}
    owners: Owners = {}
    for index, info in (md.storage_data or {}).items():
        meta = md.state_dict_metadata[index.fqn]
        if not isinstance(meta, TensorStorageMetadata):
            continue
        chunk = next(c for c in meta.chunks if tuple(c.offsets) == tuple(index.offset))
        writer = int(info.relative_path.split("_")[2])  # DCP names files "__R_I.distcp"
        shapes[index.fqn] = (tuple(meta.size), meta.properties.dtype)
        owners.setdefault(index.fqn, {})[writer] = (tuple(chunk.offsets), tuple(chunk.sizes))
    return shapes, owners


def _load_full(step_dir: Path, shapes: Shapes) -> dict[str, torch.Tensor]:
    full = {key: torch.empty(size, dtype=dtype) for key, (size, dtype) in shapes.items()}
    dcp.load(full, storage_reader=_SafeReader(step_dir / _layout.STATE_DIR), no_dist=True)
    return full


def _cut(t: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    for dim, (off, size) in enumerate(zip(offsets, sizes, strict=True)):
        t = t.narrow(dim, off, size)
    return t


def _local_view(rank: int, shapes: Shapes, owners: Owners, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What rank ``rank`` held: the chunk it wrote, or the one full chunk of a replicated key."""
    local = {}
    for key, per_writer in owners.items():
        chunk = per_writer.get(rank)
        if chunk is None and len(per_writer) == 1:
            only = next(iter(per_writer.values()))
            chunk = only if only[1] == shapes[key][0] else None
        if chunk is not None:
            local[key] = _cut(full[key], *chunk)
    return local


def recompute(step_dir: Path) -> dict[str, Any]:
    manifest = _manifest.read(step_dir)
    shapes, owners = _layout_of(step_dir)
    full = _load_full(step_dir, shapes)
    result: dict[str, Any] = {"step": manifest.step, "ranks": {}, "unverifiable": []}
    for rank in range(manifest.world_size):
        extras = torch.load(step_dir / _layout.extras_name(rank), weights_only=True, map_location="cpu")
        local = _local_view(rank, shapes, owners, full)
        digests = {}
        for name, kind in manifest.items.items():
            skeleton = extras["items"][name]
            try:
                value = _unflatten(skeleton, local) if kind in _TENSOR_KINDS else skeleton
            except KeyError as exc:
                result["unverifiable"].append(f"rank {rank} item {name}: no stored chunk for {exc}")
                continue
            digests[name] = digest(value)
        if extras.get("rng") is not None:
            digests["_rng"] = digest(extras["rng"])
        result["ranks"][str(rank)] = digests
    return result


_TENSOR_KINDS = {ItemKind.MODULE.value, ItemKind.OPTIMIZER.value, ItemKind.TENSORS.value}


def compare(step_dir: Path, recomputed: dict[str, Any]) -> list[str]:
    """Human lines for every item whose recomputed digest differs from the manifest's."""
    manifest = _manifest.read(step_dir)
    problems = list(recomputed.get("unverifiable", []))
    for rank, saved in manifest.digests.items():
        now = recomputed["ranks"].get(rank, {})
        for item, value in sorted(saved.items()):
            if item in now and now[item] != value:
                problems.append(f"rank {rank} item {item}: restored digest {now[item]} != saved {value}")
    return problems


if __name__ == "__main__":
    print(json.dumps(recompute(Path(sys.argv[1]))))
