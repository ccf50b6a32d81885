"""Export a committed step's model to Hugging Face safetensors, every tensor checked as it is
written.

Contract: ``export_hf(step_dir, out)`` consolidates one module item of a committed step (any world
size, FSDP2/DTensor shards, expert-parallel ``#ep<r>`` keys) into
``model-0000i-of-0000n.safetensors`` files and ``model.safetensors.index.json`` under ``out``, with
the model's config and tokenizer files when the step holds them (``hf/`` of the HF integration, or
any ``ExternalFiles`` writer named ``hf``). The export:

- streams: each output tensor is read from the step's DCP files through ckptguard's streaming
  reader into its place in the current output file, and the files are planned from the DCP
  metadata so that the tensors held at once (one output file's, plus one source tensor before a
  cast, plus the reader's pool) stay within ``max_host_bytes``; a tensor that cannot fit is refused
  before anything is read;
- checks every tensor twice: after the read, each source key's bytes against the step's
  layout-free digest (``manifest.json``'s ``layout_free``; before a dtype cast, so a cast never
  hides a damaged shard), and after the file is written and fsynced, the file's bytes, read back
  by an independent parser of the safetensors header, against the digests of what was meant to
  be written. Any difference raises before anything is published;
- publishes atomically: everything goes into a hidden temp directory beside ``out``; the export's
  own manifest (``ckptguard_export.json``: the step, its chain and manifest checksum, every file
  with size and xxh3, every tensor's sources and digests) is written last (temp + rename) and the
  temp directory is then renamed to ``out``. A killed export leaves no ``out`` and no manifest; its
  temp directory (``owner.json`` names the process) is swept by the next export to the same ``out``
  once that process is dead.

Names: a DCP key ``<item>.<fqn>`` is exported as ``<fqn>``. An expert key ``<fqn>#ep<r>`` is
placed by the usual expert-parallel convention, EP rank r holding the r-th contiguous block of
experts: a per-expert name (``...experts.<i>...``) becomes ``...experts.<r * n + i>...`` (n experts
per EP rank), and a fused expert tensor (no index after ``experts``) is the concatenation of the EP
ranks' tensors along dimension 0.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .. import _faults
from .._disk import layout as _layout
from .._disk.boxsum import REPLICAS_DIFFER
from .._disk.digest import file_digest
from .._records import manifest as _manifest
from .._records.findings import Finding, Severity, finding
from .._records.manifest import safe_member
from .._state.expert import EP_SUFFIX
from ..errors import CheckpointCorruptError, CheckpointIncompleteError, ConfigError
from ..storage import StorageContext, StreamingConfig, StreamingStorage, read_dcp_metadata
from ..storage.dcp import current_versions
from .hffiles import digests, read_tensors, trim, write_shard

__all__ = [
    "DEFAULT_BUDGET",
    "EXPORT_MANIFEST",
    "Budget",
    "ExportCheck",
    "ExportResult",
    "Planned",
    "check_export",
    "export_hf",
    "is_export",
    "plan_export",
    "verify_export",
]

EXPORT_MANIFEST = "ckptguard_export.json"
EXPORT_KIND = "ckptguard-export"
EXPORT_FORMAT = 1
INDEX_NAME = "model.safetensors.index.json"
HF_DIR = "hf"
DEFAULT_BUDGET = 2 << 30
"""Host bytes of tensors the export holds at once, by default (per process)."""
_MiB = 1 << 20
_TMP_MARK = ".tmp-export-"
# The files of a model's folder that are not weights: copied when the step holds them.
CONFIG_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
)
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
_EP_KEY = re.compile(re.escape(EP_SUFFIX) + r"(\d+)\Z")


# ---------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Source:
    """One DCP key read into an output tensor: whole, or rows ``rows`` of dimension 0."""

    key: str
    digest: str
    """The step's layout-free digest of the key."""
    shape: tuple[int, ...]
    rows: tuple[int, int] | None = None


@dataclass(frozen=True)
class Planned:
    """One tensor of the export: its HF name, global shape, dtypes and where its bytes come from."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    out_dtype: torch.dtype
    sources: tuple[Source, ...]
    extra_bytes: int = 0
    """Host bytes the fill holds besides the tensor itself (a merge's copy of the base weight)."""

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def out_bytes(self) -> int:
        return self.numel * self.out_dtype.itemsize

    @property
    def src_bytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def cast(self) -> bool:
        return self.out_dtype != self.dtype

    @property
    def held_besides(self) -> int:
        """Bytes held while this tensor is filled, besides the output tensors: its source before a
        cast."""
        return (self.src_bytes if self.cast else 0) + self.extra_bytes


def _module_item(manifest: _manifest.Manifest, item: str | None) -> str:
    modules = sorted(n for n, kind in manifest.items.items() if kind == "module")
    if item is not None:
        if manifest.items.get(item) != "module":
            raise ConfigError(
                f"step {manifest.step} ({manifest.path.parent}) has no model item {item!r}; its "
                f"model items: {modules or 'none'}; pass one of them with --item"
            )
        return item
    if len(modules) == 1:
        return modules[0]
    if not modules:
        raise ConfigError(
            f"step {manifest.step} ({manifest.path.parent}) holds no model item in its DCP "
            f"state (items: {sorted(manifest.items)}); a step of the HF integration keeps "
            f"the weights in HF's own files under {HF_DIR}/, which are usable as they are "
            f"(checked by `ckptguard verify`)"
        )
    raise ConfigError(
        f"step {manifest.step} holds several model items {modules}: pass the "
        f"one to export with --item"
    )


def _expected(manifest: _manifest.Manifest, item: str) -> dict[str, str]:
    table = (manifest.layout_free or {}).get(item)
    if not table:
        raise CheckpointCorruptError(
            f"step {manifest.step} ({manifest.path}) records no layout-free digests for item "
            f"{item!r} (written by an older ckptguard): its tensors cannot be checked as they are "
            f"exported; restore it and save it again with this version"
        )
    return table


def _ep_sources(
    item: str,
    base: str,
    per_rank: dict[int, tuple[str, tuple[int, ...]]],
    expected: dict[str, str],
    ep: int,
) -> tuple[str, tuple[int, ...], list[Source]]:
    """A fused expert tensor: the EP ranks' tensors concatenated along dimension 0."""
    ranks = sorted(per_rank)
    if ranks != list(range(ep)):
        raise CheckpointCorruptError(
            f"expert key {base!r}: the step holds EP ranks {ranks}, not 0..{ep - 1}; the experts "
            f"of the missing EP ranks are in no file: restore an earlier step"
        )
    shapes = [per_rank[r][1] for r in ranks]
    if any(len(s) == 0 or s[1:] != shapes[0][1:] for s in shapes):
        raise CheckpointCorruptError(
            f"expert key {base!r}: EP ranks' shapes {shapes} do not stack along dimension 0"
        )
    sources, row = [], 0
    for r in ranks:
        key, shape = per_rank[r]
        sources.append(Source(key, expected[key], shape, (row, row + shape[0])))
        row += shape[0]
    return base[len(item) + 1 :], (row, *shapes[0][1:]), sources


def _expert_index(parts: list[str]) -> int | None:
    """Where the per-expert index sits in a key's parts: the first number after a part naming
    experts."""
    for i in range(1, len(parts)):
        if parts[i].isdigit() and "expert" in parts[i - 1]:
            return i
    return None


def _renumbered(
    item: str, keys: dict[str, dict[int, tuple[str, tuple[int, ...]]]]
) -> dict[str, tuple[str, int]]:
    """Per-expert keys: DCP key -> (HF name, EP rank), the local index i of EP rank r made r * n +
    i."""
    local: dict[tuple[str, int], set[int]] = {}
    for base, per_rank in keys.items():
        parts = base.split(".")
        at = _expert_index(parts)
        if at is not None:
            for r in per_rank:
                local.setdefault((".".join(parts[:at]), r), set()).add(int(parts[at]))
    counts: dict[str, set[int]] = {}
    for (prefix, r), found in local.items():
        if found != set(range(len(found))):
            raise CheckpointCorruptError(
                f"experts under {prefix!r} on EP rank {r}: local indices {sorted(found)} "
                "are not 0..n-1; they cannot be numbered globally"
            )
        counts.setdefault(prefix, set()).add(len(found))
    if any(len(c) > 1 for c in counts.values()):
        raise CheckpointCorruptError(
            f"EP ranks hold different numbers of experts: {counts}; cannot number them"
        )
    out = {}
    for base, per_rank in keys.items():
        parts = base.split(".")
        at = _expert_index(parts)
        if at is None:
            continue
        n = next(iter(counts[".".join(parts[:at])]))
        for r, (key, _shape) in per_rank.items():
            name = [*parts[:at], str(r * n + int(parts[at])), *parts[at + 1 :]]
            out[key] = (".".join(name)[len(item) + 1 :], r)
    return out


def plan_export(
    step_dir: str | os.PathLike[str], *, item: str | None = None, dtype: torch.dtype | None = None
) -> list[Planned]:
    """Every output tensor of ``item`` (default: the step's one model item), from the DCP metadata
    alone."""
    step_dir = Path(step_dir)
    manifest = _manifest.read(step_dir)
    item = _module_item(manifest, item)
    expected = _expected(manifest, item)
    md = read_dcp_metadata(step_dir / _layout.STATE_DIR)
    plain: list[Planned] = []
    experts: dict[str, dict[int, tuple[str, tuple[int, ...]]]] = {}
    dtypes: dict[str, torch.dtype] = {}
    for key, meta in md.state_dict_metadata.items():
        if not key.startswith(item + ".") or not isinstance(meta, TensorStorageMetadata):
            continue
        if key not in expected:
            raise CheckpointCorruptError(
                f"key {key!r} of step {manifest.step} has no layout-free digest in "
                f"{manifest.path}: the step's metadata and manifest disagree"
            )
        shape, src = tuple(int(s) for s in meta.size), meta.properties.dtype
        dtypes[key] = src
        out = dtype if dtype is not None and src.is_floating_point else src
        match = _EP_KEY.search(key)
        if match is None:
            plain.append(
                Planned(key[len(item) + 1 :], shape, src, out, (Source(key, expected[key], shape),))
            )
        else:
            experts.setdefault(key[: match.start()], {})[int(match.group(1))] = (key, shape)
    ep = manifest.topology.ep
    named = _renumbered(item, experts)
    for base, per_rank in sorted(experts.items()):
        src = dtypes[per_rank[min(per_rank)][0]]
        out = dtype if dtype is not None and src.is_floating_point else src
        if all(key in named for key, _s in per_rank.values()):
            plain += [
                Planned(named[key][0], shape, src, out, (Source(key, expected[key], shape),))
                for key, shape in per_rank.values()
            ]
        else:
            name, shape, sources = _ep_sources(item, base, per_rank, expected, ep)
            plain.append(Planned(name, shape, src, out, tuple(sources)))
    bad = [p.name for p in plain if any(s.digest == REPLICAS_DIFFER for s in p.sources)]
    if bad:
        raise CheckpointCorruptError(
            f"step {manifest.step}: the save found replicas of {bad[:4]} that differ across "
            "ranks; their true value is unknown: restore an earlier step"
        )
    return sorted(plain, key=lambda p: p.name)


# ---------------------------------------------------------------- memory


@dataclass(frozen=True)
class Budget:
    """How ``max_host_bytes`` is spent: the reader's pool, one output file, one source tensor before
    its cast."""

    total: int
    pool: int
    shard: int
    cast: int

    @classmethod
    def of(cls, total: int, planned: list[Planned]) -> Budget:
        if not isinstance(total, int) or isinstance(total, bool) or total <= 0:
            raise ConfigError(f"max_host_bytes must be a positive int of bytes, got {total!r}")
        pool = max(8 * _MiB, min(64 * _MiB, total // 16)) // (2 * 4096) * (2 * 4096)
        cast = max([p.held_besides for p in planned] or [0])
        largest = max([p.out_bytes for p in planned] or [0])
        need = pool + cast + largest + _slack(total)
        if need > total:
            big = max(planned, key=lambda p: p.out_bytes + p.held_besides)
            besides = f", and {big.held_besides} bytes while it is read" if big.held_besides else ""
            raise ConfigError(
                f"--max-host-bytes {total} is too small: tensor {big.name!r} ({big.out_bytes} "
                f"bytes{besides}) "
                f"and the reader's pool ({pool} bytes) need {need} bytes at once; pass "
                f"--max-host-bytes {need} or more"
            )
        return cls(total, pool, total - pool - cast - _slack(total), cast)


def _slack(total: int) -> int:
    """Bytes kept for what is not a tensor (DCP's plans and metadata, the digest threads' heap
    arenas, fragments between files): measured at up to 55 MiB above the tensors with a 256 MiB
    budget (benchmarks/results/export_memory.md)."""
    return 48 * _MiB + total // 32


def shards(planned: list[Planned], limit: int) -> list[list[Planned]]:
    """The tensors in order, cut into files of at most ``limit`` bytes (a larger tensor alone)."""
    shards: list[list[Planned]] = []
    size = 0
    for p in planned:
        if not shards or size + p.out_bytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += p.out_bytes
    return shards


# ---------------------------------------------------------------- digests


def _check_sources(step_dir: Path, step: int, p: Planned, out: torch.Tensor) -> None:
    views = {s.key: (out if s.rows is None else out[s.rows[0] : s.rows[1]]) for s in p.sources}
    now = digests(views)
    for s in p.sources:
        if now[s.key] != s.digest:
            raise CheckpointCorruptError(
                f"{step_dir / _layout.STATE_DIR}: key {s.key!r} of step {step} reads back with "
                f"layout-free digest {now[s.key]}, the save recorded {s.digest}: a shard file "
                f"changed after the commit. Nothing was exported; run `ckptguard verify --deep "
                f"{step_dir}` to find the file, and export an earlier step"
            )


# ---------------------------------------------------------------- reading and writing


@dataclass
class ExportResult:
    """What an export wrote, and the figures of the run."""

    out: Path
    step: int
    item: str
    dtype: str | None
    files: list[str] = field(default_factory=list)
    tensors: int = 0
    bytes: int = 0
    budget: dict[str, int] = field(default_factory=dict)
    peak_tensor_bytes: int = 0
    seconds: float = 0.0
    copied: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "out": str(self.out)}


Progress = Callable[[dict[str, Any]], None]


class _Reader:
    """Source tensors from the step's DCP files, through ckptguard's streaming reader and restricted
    metadata."""

    def __init__(self, step_dir: Path, pool: int) -> None:
        self._state = step_dir / _layout.STATE_DIR
        buffer = pool // 2 // 4096 * 4096
        self._storage = StreamingStorage(
            StreamingConfig(pool_bytes=2 * buffer, buffer_bytes=buffer, read_threads=1)
        )
        self._ctx = StorageContext(rank=0, world_size=1, process_group=None)

    def fill(self, p: Planned, target: torch.Tensor) -> None:
        """Read ``p``'s sources into ``target`` (a tensor of ``p``'s source dtype and shape)."""
        views = {
            s.key: (target if s.rows is None else target[s.rows[0] : s.rows[1]]) for s in p.sources
        }
        self._storage.read(self._state, views, self._ctx)


Fill = Callable[[Planned, torch.Tensor], None]
"""Reads ``p``'s bytes into a tensor of its source dtype and shape, and checks them (raises if they
differ)."""


def _load_shard(
    fill: Fill,
    shard: list[Planned],
    result: ExportResult,
    progress: Progress | None,
    done: list[int],
) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for p in shard:
        out = torch.empty(p.shape, dtype=p.out_dtype)
        held = (
            sum(t.numel() * t.element_size() for t in tensors.values()) + out.nbytes + p.extra_bytes
        )
        if p.cast:
            src = torch.empty(p.shape, dtype=p.dtype)
            fill(p, src)  # checked before the cast
            out.copy_(src)
            held += src.nbytes
            del src
            trim()
        else:
            fill(p, out)
        result.peak_tensor_bytes = max(result.peak_tensor_bytes, held)
        tensors[p.name] = out
        done[0] += 1
        done[1] += p.out_bytes
        if progress is not None:
            progress({"tensors": done[0], "bytes": done[1], "name": p.name})
    return tensors


def check_file(path: Path, meant: dict[str, str], planned: dict[str, Planned]) -> None:
    """The written file, read back: every tensor's dtype, shape and layout-free digest as meant."""
    for name, t in read_tensors(path, sorted(meant)):
        p = planned[name]
        if t.dtype != p.out_dtype or tuple(t.shape) != p.shape:
            raise CheckpointCorruptError(
                f"{path}: tensor {name!r} was written as {t.dtype} {tuple(t.shape)}, "
                f"meant {p.out_dtype} {p.shape}; nothing was published"
            )
        now = digests({name: t})[name]
        del t
        trim()  # one tensor read back at a time, its pages given back before the next
        if now != meant[name]:
            raise CheckpointCorruptError(
                f"{path}: tensor {name!r} reads back from the written file with digest {now}, the "
                f"bytes handed to the serializer had {meant[name]}; the write was damaged (disk or "
                f"filesystem): nothing was published, retry the export on healthy storage"
            )


def copy_configs(
    step_dir: Path, manifest: _manifest.Manifest, tmp: Path, dtype: torch.dtype | None
) -> list[str]:
    """The step's config/tokenizer files (``hf/``), checked against the manifest's size and xxh3 as
    copied."""
    copied = []
    for entry in manifest.files:
        rel = entry.path
        if (
            not rel.startswith(HF_DIR + "/")
            or rel.count("/") != 1
            or rel.split("/")[1] not in CONFIG_FILES
        ):
            continue
        src = step_dir / rel
        data = _layout.read_small(src, limit=256 * _MiB, what="config file")
        if len(data) != entry.size or xxhash.xxh3_64(data).hexdigest() != entry.xxh3:
            raise CheckpointCorruptError(
                f"{src}: size or xxh3 differs from step {manifest.step}'s manifest; the file "
                "changed after the commit: nothing was exported"
            )
        name = rel.split("/")[1]
        if name == "config.json" and dtype is not None:
            data = retyped_config(src, data, dtype)
        (tmp / name).write_bytes(data)
        copied.append(name)
    return copied


def retyped_config(src: Path, data: bytes, dtype: torch.dtype) -> bytes:
    """config.json with the exported dtype, so ``from_pretrained(dtype="auto")`` loads what was
    written."""
    config = _layout.parse_json(data, where=str(src))
    if not isinstance(config, dict):
        raise CheckpointCorruptError(f"{src}: not a JSON object")
    name = str(dtype).removeprefix("torch.")
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = name
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()


# ---------------------------------------------------------------- the export


def _temp_dir(out: Path) -> Path:
    """A new hidden directory beside ``out``; dead exports' temp directories of the same ``out``
    swept first."""
    prefix = f".{out.name}{_TMP_MARK}"
    for old in sorted(out.parent.glob(prefix + "*")):
        ours = (
            re.fullmatch(re.escape(prefix) + r"[0-9a-f]{12}", old.name)
            and not old.is_symlink()
            and old.is_dir()
        )
        if ours and _layout.owner_is_dead(old, max_age_s=float("inf")):
            shutil.rmtree(old)
    tmp = out.parent / f"{prefix}{secrets.token_hex(6)}"
    tmp.mkdir()
    _layout.write_owner(tmp)
    return tmp


def _target(out: Path) -> Path:
    out = out.absolute()
    if out.is_symlink() or (out.exists() and (not out.is_dir() or any(out.iterdir()))):
        raise ConfigError(
            f"{out} exists and is not an empty directory: an export never overwrites; pick a new "
            "directory or remove that one"
        )
    if not out.parent.is_dir():
        raise ConfigError(
            f"{out.parent} does not exist: create the parent directory of the export first"
        )
    return out


def step_dir_of(
    root: str | os.PathLike[str], step: int | None, template: str = "step_{step:08d}"
) -> Path:
    """The committed step to export: ``root`` itself when it is a step directory, else ``step`` or
    the tracker's."""
    root = Path(root)
    root = root.absolute()
    if (root / _layout.MANIFEST_NAME).exists():
        if step is not None and _manifest.read(root).step != step:
            raise ConfigError(
                f"{root} is the step directory of step {_manifest.read(root).step}, not {step}"
            )
        return root
    naming = _layout.StepNaming(template)
    tracker = _layout.read_tracker(root)
    if tracker is None or tracker == 0:
        raise CheckpointIncompleteError(
            f"{root} has no committed step (tracker: {tracker}); pass the checkpoint "
            "root of a run that saved, or a step directory"
        )
    step = tracker if step is None else step
    if step > tracker:
        raise CheckpointIncompleteError(
            f"step {step} under {root} is newer than the tracker ({tracker}): not committed"
        )
    path = root / naming.name(step)
    _manifest.read(path)  # committed: raises naming the step otherwise
    return path


def export_hf(
    step_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    item: str | None = None,
    dtype: torch.dtype | None = None,
    max_host_bytes: int = DEFAULT_BUDGET,
    progress: Progress | None = None,
) -> ExportResult:
    """Export ``item`` of the committed step ``step_dir`` to ``out`` (see the module docstring)."""
    step_dir = Path(step_dir)
    out = Path(out)
    out = _target(out)
    manifest = _manifest.read(step_dir)
    item = _module_item(manifest, item)
    planned = plan_export(step_dir, item=item, dtype=dtype)
    if not planned:
        raise ConfigError(f"item {item!r} of step {manifest.step} holds no tensor to export")
    reader = _Reader(step_dir, Budget.of(max_host_bytes, planned).pool)

    def fill(p: Planned, target: torch.Tensor) -> None:
        reader.fill(p, target)
        _check_sources(step_dir, manifest.step, p, target)

    def configs(tmp: Path) -> list[str]:
        return copy_configs(step_dir, manifest, tmp, dtype)

    return publish(
        out,
        planned,
        fill,
        source_of(step_dir, manifest, item),
        configs,
        dtype=dtype,
        max_host_bytes=max_host_bytes,
        progress=progress,
    )


def source_of(step_dir: Path, manifest: _manifest.Manifest, item: str) -> dict[str, Any]:
    """What an export manifest says of the step it came from."""
    return {
        "step": manifest.step,
        "step_dir": str(step_dir),
        "chain_id": manifest.chain_id,
        "item": item,
        "manifest_xxh3": file_digest(str(manifest.path))[1],
    }


def publish(
    out: Path,
    planned: list[Planned],
    fill: Fill,
    source: dict[str, Any],
    configs: Callable[[Path], list[str]],
    *,
    dtype: torch.dtype | None,
    max_host_bytes: int,
    progress: Progress | None,
    extra: dict[str, Any] | None = None,
) -> ExportResult:
    """Write ``planned`` (bytes from ``fill``) into a temp directory beside ``out``, check, and
    publish it."""
    t0 = time.perf_counter()
    out = _target(out)
    budget = Budget.of(max_host_bytes, planned)
    result = ExportResult(
        out,
        int(source["step"]),
        str(source["item"]),
        str(dtype).removeprefix("torch.") if dtype else None,
        budget=budget.__dict__,
    )
    tmp = _temp_dir(out)
    try:
        body = _export_into(
            tmp, planned, shards(planned, budget.shard), fill, configs, result, progress
        )
        _faults.reached("export.before_manifest")
        _layout.atomic_write_json(
            tmp / EXPORT_MANIFEST, {**body, "source": source, **(extra or {})}
        )
        (
            tmp / _layout.OWNER_NAME
        ).unlink()  # after the manifest: the published export holds only what it lists
        os.rename(
            tmp, out
        )  # onto nothing or an empty directory: one step publishes the whole export
        _layout.fsync_dir(out.parent)
    except BaseException:
        if tmp.exists():
            shutil.rmtree(
                tmp, ignore_errors=True
            )  # ours (created above); a kill leaves it to the next sweep
        raise
    result.seconds = time.perf_counter() - t0
    return result


def _export_into(
    tmp: Path,
    planned: list[Planned],
    groups: list[list[Planned]],
    fill: Fill,
    configs: Callable[[Path], list[str]],
    result: ExportResult,
    progress: Progress | None,
) -> dict[str, Any]:
    """Every file of the export in ``tmp``, each checked; the export manifest's body."""
    by_name = {p.name: p for p in planned}
    weight_map: dict[str, str] = {}
    files: list[dict[str, Any]] = []
    written: dict[str, str] = {}
    done = [0, 0]
    for i, shard in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = _load_shard(fill, shard, result, progress, done)
        meant = write_shard(tmp / name, tensors)
        del tensors  # dropped before the read-back: one file's tensors are held at a time
        trim()
        _faults.reached("export.shard_written")
        check_file(tmp / name, meant, by_name)
        size, xxh3 = file_digest(str(tmp / name))
        files.append({"path": name, "size": size, "xxh3": xxh3})
        written.update(meant)
        weight_map.update({p.name: name for p in shard})
    total = sum(p.out_bytes for p in planned)
    _layout.atomic_write_json(
        tmp / INDEX_NAME,
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
    )
    result.copied = configs(tmp)
    for extra in [INDEX_NAME, *result.copied]:
        size, xxh3 = file_digest(str(tmp / extra))
        files.append({"path": extra, "size": size, "xxh3": xxh3})
    result.files = [f["path"] for f in files]
    result.tensors, result.bytes = len(planned), total
    return {
        "kind": EXPORT_KIND,
        "format_version": EXPORT_FORMAT,
        "dtype": result.dtype,
        "files": files,
        "tensors": {p.name: _tensor_entry(p, weight_map, written) for p in planned},
        "versions": current_versions(),
        "created_unix": time.time(),
    }


def _tensor_entry(
    p: Planned, weight_map: dict[str, str], written: dict[str, str]
) -> dict[str, Any]:
    return {
        "file": weight_map[p.name],
        "dtype": str(p.out_dtype).removeprefix("torch."),
        "shape": list(p.shape),
        "digest": written[p.name],
        **({"cast_from": str(p.dtype).removeprefix("torch.")} if p.cast else {}),
        "sources": [
            {"key": s.key, "digest": s.digest, **({"rows": list(s.rows)} if s.rows else {})}
            for s in p.sources
        ],
    }


# ---------------------------------------------------------------- verify an export


def is_export(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a directory an export published (its manifest is there)."""
    path = Path(path)
    return (path / EXPORT_MANIFEST).is_file()


def read_export_manifest(path: Path) -> dict[str, Any]:
    data = _layout.read_json(path / EXPORT_MANIFEST, limit=256 * _MiB, what="export manifest")
    ok = (
        isinstance(data, dict)
        and data.get("kind") == EXPORT_KIND
        and data.get("format_version") == EXPORT_FORMAT
        and isinstance(data.get("files"), list)
        and isinstance(data.get("tensors"), dict)
        and all(
            isinstance(f, dict)
            and isinstance(f.get("path"), str)
            and isinstance(f.get("size"), int)
            and isinstance(f.get("xxh3"), str)
            for f in data["files"]
        )
    )
    if not ok:
        raise CheckpointCorruptError(
            f"{path / EXPORT_MANIFEST}: not an export manifest ckptguard wrote (format "
            f"{EXPORT_FORMAT}); export the step again"
        )
    listed = {f["path"] for f in data["files"]}
    bad = next(
        (name for name, t in data["tensors"].items() if not _tensor_entry_ok(t, listed)), None
    )
    if (
        bad is not None
    ):  # the same refusal with and without --deep: plain verify never passes what --deep refuses
        raise CheckpointCorruptError(
            f"{path / EXPORT_MANIFEST}: tensor {str(bad)[:200]!r} is malformed (its file must "
            "be one the manifest lists; dtype, shape and digest as the export writes them); "
            "export the step again"
        )
    checked: dict[str, Any] = data
    return checked


def _tensor_entry_ok(entry: object, listed: set[str]) -> bool:
    shape = entry.get("shape") if isinstance(entry, dict) else None
    return (
        isinstance(entry, dict)
        and entry.get("file") in listed
        and isinstance(entry.get("dtype"), str)
        and isinstance(entry.get("digest"), str)
        and isinstance(shape, list)
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)
    )


@dataclass
class ExportCheck:
    """What ``check_export`` found, and exactly what it compared (the verdict line says no more)."""

    findings: list[Finding]
    compared: list[str]
    """"files and sizes", then "checksums" and "tensor digests" when they were compared."""
    not_compared: str | None = None
    """Why the tensor digests were not compared although asked for (``deep``)."""


def verify_export(path: str | os.PathLike[str], *, deep: bool = False) -> list[Finding]:
    """Findings for an export directory: every listed file present with its size; ``deep``: its xxh3
    and every tensor's layout-free digest, read back from the files."""
    return check_export(path, deep=deep).findings


def check_export(path: str | os.PathLike[str], *, deep: bool = False) -> ExportCheck:
    """``verify_export``'s findings and what was compared. Every file read is one the export
    manifest lists, inside ``path`` (no absolute name, no '..', no symlink, no FIFO): nothing
    outside is read."""
    path = Path(path)
    try:
        data = read_export_manifest(path)
    except (CheckpointCorruptError, OSError) as exc:
        return ExportCheck(
            [finding("bad-export", path / EXPORT_MANIFEST, str(exc), "export the step again")],
            [],
            "the export manifest is unreadable" if deep else None,
        )
    findings: list[Finding] = []
    fix = "the export was changed after it was published: export the step again"
    listed = {f["path"] for f in data["files"]}
    for f in data["files"]:
        rel = f["path"]
        lexical = bool(rel) and not os.path.isabs(rel) and ".." not in Path(rel).parts
        file = safe_member(path, rel)
        if lexical and (path / rel).is_symlink():
            findings.append(
                finding(
                    "symlink",
                    path / rel,
                    "is a symlink; an export holds plain files and none is read through a link",
                    fix,
                )
            )
        elif file is None or not file.is_file():
            findings.append(
                finding(
                    "missing",
                    path / f["path"],
                    "is listed in the export manifest but absent, "
                    "not a plain file, or outside the export",
                    fix,
                )
            )
        elif file.stat().st_size != f["size"]:
            size = file.stat().st_size
            findings.append(
                finding("size", file, f"is {size} bytes, the manifest says {f['size']}", fix)
            )
        elif deep and file_digest(str(file))[1] != f["xxh3"]:
            findings.append(finding("checksum", file, "xxh3 differs from the export manifest", fix))
    for extra in sorted(e.name for e in path.iterdir()):
        if extra not in listed and extra != EXPORT_MANIFEST:
            findings.append(
                Finding(
                    Severity.WARNING,
                    "unlisted",
                    str(path / extra),
                    "is not part of the export (added afterwards)",
                    "remove it, or ignore it",
                )
            )
    compared = ["files and sizes", *(["checksums"] if deep else [])]
    if not deep:
        return ExportCheck(findings, compared)
    if any(f.severity is Severity.ERROR for f in findings):
        return ExportCheck(findings, compared, "the files above failed their checks")
    findings += _tensor_findings(path, data)
    return ExportCheck(findings, [*compared, "tensor digests"])


def _tensor_findings(path: Path, data: dict[str, Any]) -> list[Finding]:
    by_file: dict[str, list[str]] = {}
    for name, t in data["tensors"].items():
        by_file.setdefault(t["file"], []).append(name)
    findings = []
    for file, names in sorted(by_file.items()):
        member = safe_member(
            path, file
        )  # listed and checked above; confined again before it is opened
        if member is None:
            findings.append(
                finding("bad-file", path / file, "leaves the export", "export the step again")
            )
            continue
        try:
            for name, t in read_tensors(member, sorted(names)):
                if digests({name: t})[name] != data["tensors"][name]["digest"]:
                    findings.append(
                        finding(
                            "tensor-digest",
                            member,
                            f"tensor {name!r} differs from the export",
                            "export the step again",
                        )
                    )
        except CheckpointCorruptError as exc:
            findings.append(finding("bad-file", member, str(exc), "export the step again"))
    return findings
