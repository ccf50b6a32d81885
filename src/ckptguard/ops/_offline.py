"""A real restore without model code: ``python -m ckptguard.ops._offline STEP_DIR... [--budget-bytes
N]``.

Contract: in a fresh process, rank by rank and, within a rank, item by item, allocate the tensors
that rank held (the chunk it wrote, or a replicated key's one full chunk) from the checkpoint's own
DCP metadata, load them with ``dcp.load`` through ckptguard's streaming reader and restricted
metadata reader, rebuild the item from the rank's extras, recompute its digest for comparison with
the manifest, and drop the tensors. A correct save digest is not a restore test (docs/practices.md,
3.5); this is one. Host memory stays within the budget: tensors are loaded in batches of at most
``budget_bytes`` (a single tensor larger than the budget alone), through a reader pool of
``POOL_BYTES``, with one rank's extras at a time; never the whole checkpoint. Prints one JSON line
per item done (``{"progress": ..., "step_dir": ...}``) and then one per step (``{"step_dir": ...,
"result": ...}``) on stdout; one process checks every step given.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from .._disk import layout as _layout
from .._disk.boxsum import box_sum, combine_layout_free
from .._disk.digest import (
    STRUCTURE_SEED,
    digest,
    update_digest,
    update_tensor_header,
    update_with_tensor,
)
from .._records import manifest as _manifest
from .._state.state import TENSOR_REF, ItemKind
from ..errors import CheckpointCorruptError
from ..storage._pool import IOStats
from ..storage.streaming import StreamingConfig, StreamingReader, StreamingStorage
from ..storage.unpickler import read_dcp_metadata

DEFAULT_BUDGET = 512 << 20
"""Host bytes of restored tensors held at once, by default."""
POOL_BYTES = 32 << 20
"""The streaming reader's buffers (two of 16 MiB)."""

Box = tuple[tuple[int, ...], tuple[int, ...]]  # offsets, sizes
_TENSOR_KINDS = {ItemKind.MODULE.value, ItemKind.OPTIMIZER.value, ItemKind.TENSORS.value}
_DATA_FILE = re.compile(r"__(\d+)_\d+\.distcp\Z")


class _Layout:
    """For each key: its DCP metadata, and which rank wrote which chunk."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.md: Metadata = read_dcp_metadata(state_dir)
        self.boxes: dict[str, dict[int, Box]] = {}
        for index, info in (self.md.storage_data or {}).items():
            meta = self.md.state_dict_metadata.get(index.fqn)
            if not isinstance(meta, TensorStorageMetadata):
                continue
            chunk = next((c for c in meta.chunks if tuple(c.offsets) == tuple(index.offset)), None)
            match = _DATA_FILE.match(info.relative_path)
            if chunk is None or match is None:
                found = "no chunk" if chunk is None else "the data file " + repr(info.relative_path)
                raise CheckpointCorruptError(
                    f"{state_dir / '.metadata'}: key {index.fqn!r} at offset {list(index.offset)} "
                    f"has {found}; "
                    f"DCP writes a chunk per stored offset in files named __RANK_N.distcp: restore "
                    f"an earlier step"
                )
            self.boxes.setdefault(index.fqn, {})[int(match.group(1))] = (
                tuple(chunk.offsets),
                tuple(chunk.sizes),
            )

    def box(self, key: str, rank: int) -> Box | None:
        """What ``rank`` held of ``key``: the chunk it wrote, or the one full chunk of a replicated
        key."""
        per_writer = self.boxes.get(key)
        if per_writer is None:
            return None
        box = per_writer.get(rank)
        if box is None and len(per_writer) == 1:
            only = next(iter(per_writer.values()))
            box = only if only[1] == tuple(self.tensor_meta(key).size) else None
        return box

    def tensor_meta(self, key: str) -> TensorStorageMetadata:
        meta = self.md.state_dict_metadata[key]
        assert isinstance(meta, TensorStorageMetadata)
        return meta

    def nbytes(self, key: str, box: Box) -> int:
        count = 1
        for n in box[1]:
            count *= n
        return count * self.tensor_meta(key).properties.dtype.itemsize


class _BoxPlanner(DefaultLoadPlanner):
    """DCP's default load planner, asked for one box (offsets, sizes) of each key instead of the
    whole tensor."""

    def __init__(self, offsets: dict[str, tuple[int, ...]]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._offsets = offsets

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        requests = []
        for fqn, target in self.state_dict.items():
            chunk = ChunkStorageMetadata(
                offsets=torch.Size(self._offsets[fqn]), sizes=target.size()
            )
            md = self.metadata.state_dict_metadata[fqn]
            assert isinstance(
                md, TensorStorageMetadata
            )  # tensors only: _layout_of lists no bytes entries
            requests += create_read_items_for_chunk_list(fqn, md, [chunk])
        return LoadPlan(requests)

    def lookup_tensor(self, index: Any) -> torch.Tensor:
        return self.state_dict[index.fqn]  # the target is the box itself, whatever its offset


class _CachedReader(StreamingReader):
    """The streaming reader, with the metadata read (and checked) once for every batch."""

    def __init__(self, layout: _Layout, storage: StreamingStorage, stats: IOStats) -> None:
        super().__init__(layout.state_dir, storage, stats, pin=False)
        self._md = layout.md

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._md


class _Loader:
    """Loads a rank's tensors in budget-sized batches, in the order the digest walk asks for
    them."""

    def __init__(
        self, layout: _Layout, rank: int, keys: list[str], budget: int, storage: StreamingStorage
    ) -> None:
        self._layout, self._rank, self._storage = layout, rank, storage
        self._batch_of: dict[str, int] = {}
        self._batches: list[list[str]] = []
        size = 0
        for key in dict.fromkeys(keys):
            n = layout.nbytes(key, layout.box(key, rank))  # type: ignore[arg-type]
            if not self._batches or size + n > budget:
                self._batches.append([])
                size = 0
            self._batches[-1].append(key)
            self._batch_of[key] = len(self._batches) - 1
            size += n
        self._current: dict[str, torch.Tensor] = {}
        self._loaded = -1
        self.peak_bytes = 0
        self.bytes_read = 0

    def get(self, key: str) -> torch.Tensor:
        index = self._batch_of[key]
        if index != self._loaded:
            self._current = {}  # the previous batch is dropped before the next is allocated
            self._current = self._load(self._batches[index])
            self._loaded = index
        return self._current[key]

    def _load(self, keys: list[str]) -> dict[str, torch.Tensor]:
        offsets, targets = {}, {}
        for key in keys:
            box = self._layout.box(key, self._rank)
            assert box is not None
            offsets[key] = box[0]
            targets[key] = torch.empty(box[1], dtype=self._layout.tensor_meta(key).properties.dtype)
        size = sum(t.numel() * t.element_size() for t in targets.values())
        self.peak_bytes = max(self.peak_bytes, size)
        reader = _CachedReader(self._layout, self._storage, IOStats())
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(targets, storage_reader=reader, planner=_BoxPlanner(offsets), no_dist=True)
        self.bytes_read += size
        return targets


def _refs(node: Any) -> Iterator[str]:
    """The tensor keys of a skeleton, in the order ``digest`` visits them."""
    if isinstance(node, Mapping):
        if set(node) == {TENSOR_REF}:
            yield node[TENSOR_REF]
            return
        for key in sorted(node, key=repr):
            yield from _refs(node[key])
    elif isinstance(node, (list, tuple)):
        for item in node:
            yield from _refs(item)


def _walk(h: Any, node: Any, get: Callable[[str], torch.Tensor], structure: bool = False) -> None:
    """``digest.update_digest`` over the skeleton, each tensor fetched when reached (same bytes,
    same order).

    ``structure``: as ``structure_digest`` (format 3 tensor items): a tensor's dtype and shape
    only."""
    if isinstance(node, Mapping):
        if set(node) == {TENSOR_REF}:
            t = get(node[TENSOR_REF])
            if structure:
                update_tensor_header(h, t)
            else:
                update_with_tensor(h, t)
            return
        h.update(b"{")
        for key in sorted(node, key=repr):
            h.update(repr(key).encode() + b":")
            _walk(h, node[key], get, structure)
        h.update(b"}")
    elif isinstance(node, (list, tuple)):
        h.update(b"[" if isinstance(node, list) else b"(")
        for item in node:
            _walk(h, item, get, structure)
            h.update(b",")
        h.update(b"]")
    else:
        update_digest(h, node)


def skeleton_digest(
    skeleton: Any, get: Callable[[str], torch.Tensor], *, structure: bool = False
) -> str:
    """``digest(_unflatten(skeleton, tensors))`` (``structure``: ``structure_digest(...)``) without
    holding every tensor at once."""
    h = xxhash.xxh3_64()
    if structure:
        h.update(STRUCTURE_SEED)
    _walk(h, skeleton, get, structure)
    return h.hexdigest()


def _load_extras(step_dir: Path, rank: int) -> tuple[dict[str, Any] | None, str | None]:
    path = step_dir / _layout.extras_name(rank)
    try:
        extras = torch.load(path, weights_only=True, map_location="cpu")
    except (
        Exception
    ) as exc:  # a damaged or foreign file: this rank fails, the others are still checked
        return (
            None,
            f"rank {rank}: {path.name} does not load with torch.load(weights_only=True) ({exc})",
        )
    if not isinstance(extras, dict) or not isinstance(extras.get("items"), dict):
        return (
            None,
            f"rank {rank}: {path.name} holds no 'items' table; it was not written by ckptguard",
        )
    return extras, None


def recompute(
    step_dir: Path,
    *,
    budget_bytes: int = DEFAULT_BUDGET,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    manifest = _manifest.read(step_dir)
    layout = _Layout(step_dir / _layout.STATE_DIR)
    storage = StreamingStorage(StreamingConfig(pool_bytes=POOL_BYTES, buffer_bytes=POOL_BYTES // 2))
    result: dict[str, Any] = {
        "step": manifest.step,
        "ranks": {},
        "unverifiable": [],
        "failed": [],
        "budget_bytes": budget_bytes,
        "peak_tensor_bytes": 0,
        "bytes_read": 0,
    }
    world = manifest.world_size
    partials: dict[
        str, list[str]
    ] = {}  # format 3: every rank's layout-free partials, combined at the end
    ranks = list(range(world))
    if (
        manifest.nodes
    ):  # node-local roots: this disk holds its node's ranks' part (its node manifest says which)
        node = _manifest.read_node(step_dir)
        ranks = sorted(manifest.nodes[node.node].ranks) if node is not None else []
        result["elsewhere"] = [r for r in range(world) if r not in ranks]
    for rank in ranks:
        extras, problem = _load_extras(step_dir, rank)
        if extras is None:
            result["failed"].append(problem)
            continue
        digests = {}
        for name, kind in manifest.items.items():
            if name not in extras["items"]:
                result["failed"].append(
                    f"rank {rank} item {name}: absent from {_layout.extras_name(rank)}"
                )
                continue
            skeleton = extras["items"][name]
            if kind not in _TENSOR_KINDS:
                digests[name] = digest(skeleton)
                continue
            keys = list(_refs(skeleton))
            absent = [k for k in keys if k not in layout.md.state_dict_metadata]
            if absent:
                result["failed"].append(
                    f"rank {rank} item {name}: keys not in the DCP metadata: {absent[:4]}"
                )
                continue
            unheld = [k for k in keys if layout.box(k, rank) is None]
            if unheld:
                result["unverifiable"].append(
                    f"rank {rank} item {name}: no stored chunk for {unheld[0]!r}"
                )
                continue
            loader = _Loader(layout, rank, keys, budget_bytes, storage)
            if manifest.digest_covers_bytes(name):
                digests[name] = skeleton_digest(skeleton, loader.get)
            else:
                # Format 3: the per-rank digest covers the structure; the bytes go into the
                # layout-free sums.
                digests[name] = skeleton_digest(
                    skeleton, _summing(layout, rank, name, loader.get, partials), structure=True
                )
            result["peak_tensor_bytes"] = max(result["peak_tensor_bytes"], loader.peak_bytes)
            result["bytes_read"] += loader.bytes_read
            if progress is not None:
                progress({"rank": rank, "world": world, "item": name, "bytes": loader.bytes_read})
        if extras.get("rng") is not None:
            digests["_rng"] = digest(extras["rng"])
        result["ranks"][str(rank)] = digests
        del extras
    if any(not manifest.digest_covers_bytes(n) for n in manifest.items):
        # Every rank's chunks are needed for a key's total: on node-local roots it is not checked
        # here.
        result["layout_free"] = None if result.get("elsewhere") else combine_layout_free([partials])
    return result


def _summing(
    layout: _Layout,
    rank: int,
    item: str,
    get: Callable[[str], torch.Tensor],
    partials: dict[str, list[str]],
) -> Callable[[str], torch.Tensor]:
    """``get``, also adding each loaded chunk's layout-free sum to ``partials`` (as the save's pass
    did)."""

    def fetch(key: str) -> torch.Tensor:
        t = get(key)
        box = layout.box(key, rank)
        assert box is not None
        gshape = tuple(int(x) for x in layout.tensor_meta(key).size)
        partials[f"{key}@{box[0]}"] = [
            item,
            key,
            f"{t.dtype}|{gshape}",
            f"{box_sum(t, box[0], gshape):016x}",
        ]
        return t

    return fetch


def compare(step_dir: Path, recomputed: dict[str, Any]) -> list[str]:
    """Human lines for every item whose recomputed digest differs from the manifest's."""
    manifest = _manifest.read(step_dir)
    problems = list(recomputed.get("unverifiable", []))
    for rank, saved in manifest.digests.items():
        now = recomputed["ranks"].get(rank, {})
        for item, value in sorted(saved.items()):
            if item in now and now[item] != value:
                problems.append(
                    f"rank {rank} item {item}: restored digest {now[item]} != saved {value}"
                )
    structure = sorted(n for n in manifest.items if not manifest.digest_covers_bytes(n))
    if structure and recomputed.get("layout_free") is not None:
        # Format 3: those items' per-rank digests cover no tensor byte; their layout-free digests
        # do.
        saved_lf, now_lf = manifest.layout_free or {}, recomputed["layout_free"]
        for item in structure:
            a, b = saved_lf.get(item, {}), now_lf.get(item, {})
            keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            if keys:
                problems.append(
                    f"item {item}: restored layout-free digests differ from the "
                    f"save's for keys {keys[:8]}"
                )
    elif structure and not recomputed.get("elsewhere"):
        problems.append(
            f"items {structure}: their tensor bytes were not compared (no "
            f"layout-free digests recomputed)"
        )
    return problems


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m ckptguard.ops._offline")
    parser.add_argument("step_dirs", type=Path, nargs="+")
    parser.add_argument("--budget-bytes", type=int, default=DEFAULT_BUDGET)
    args = parser.parse_args(argv)
    # One process checks every step, rank by rank (torch is imported once, not once a step): a
    # progress line per item and a result line per step, each naming its step directory.
    for step_dir in args.step_dirs:

        def report(event: dict[str, Any], step_dir: Path = step_dir) -> None:
            print(json.dumps({"progress": event, "step_dir": str(step_dir)}), flush=True)

        try:
            result = recompute(step_dir, budget_bytes=max(1, args.budget_bytes), progress=report)
        except Exception as exc:  # this step fails, the next ones are still checked
            print(
                json.dumps(
                    {"step_dir": str(step_dir), "error": f"{type(exc).__name__}: {exc}"[:600]}
                ),
                flush=True,
            )
            continue
        print(json.dumps({"step_dir": str(step_dir), "result": result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
