"""Megatron-core: ``dist_checkpointing`` saves committed atomically by ckptguard, checked before
every load.

Contract: ``MegatronCheckpoint(root, model, optimizer)`` saves a Megatron-core model (one module or
a list of model chunks) and its optimizer (``DistributedOptimizer`` included) through Megatron's own
``megatron.core.dist_checkpointing.save`` of their ``sharded_state_dict()``; pinned and checked:
megatron-core 0.16.1. What ckptguard adds:

- commit: Megatron's writer writes into the in-flight step (``.tmp-iter_NNNNNNN-*/megatron/``,
  through ``ExternalFiles``); once it returned on every rank, ``check_files`` reads Megatron's
  ``metadata.json`` (its own completion marker, written last), DCP's ``.metadata`` (through the
  restricted unpickler: never plain ``pickle``), every data file it names (present, plain, no
  shorter than the last byte range it names) and ``common.pt`` (``torch.load(weights_only=True)``);
  the manifest lists every file with its size and xxh3; one rename publishes the step, and the
  tracker, Megatron's own ``latest_checkpointed_iteration.txt``, moves last of all. A save killed
  anywhere (inside Megatron's writer included) leaves the previous step as the resume target.
- per-rank extras: the ``megatron`` item holds what Megatron's files do not (its CUDA RNG tracker's
  states, ``tensor_parallel.random.get_cuda_rng_tracker()``) and the xxh3 of every local shard
  Megatron saved (model and optimizer, key by key); ckptguard saves the four RNG streams itself,
  and any other item the caller passes (the scheduler, counters, the data iterator position: a
  ``DataCursor`` or a ``PerRank`` value) goes into the same step.
- restore: ckptguard resolves the step, checks every listed file's size and xxh3 against the
  manifest, then the ``megatron`` item's load runs ``check_files`` again (the bytes Megatron's DCP
  reader will unpickle were just read through the allow-list) and Megatron's own
  ``dist_checkpointing.load``; each shard's xxh3 after the load must equal the saved one, or the
  restore raises ``StateMismatchError`` naming the keys (the proof's digest gate records it).
- Megatron-core 0.16's writer needs CUDA (``filesystem_async.py`` calls
  ``torch.cuda.synchronize()``, ``state_dict_saver.py`` ``torch.cuda.current_device()``): on a
  machine without it the save fails on every rank with an error naming the CUDA call Megatron made;
  nothing is committed.
- ``save_async``: Megatron's own async save (``async_sharded_save=True``, its writer process) into
  ``ROOT/.megatron-async-NNNNNNN/``; ``finalize()`` at each step boundary runs Megatron's
  finalization (collectives of the training's group: in the caller's thread) once every rank's write
  is done, and only then ckptguard's commit starts in the background: the folder moved into the
  in-flight step, ``check_files``, the manifest, the rename, the tracker. A kill before that leaves
  the previous step.
- not covered: Megatron's persistent async worker (``AsyncCallsQueue(persistent=True)``);
  ``ckpt_format`` other than ``torch_dist``; a resume with another TP/PP/DP layout (Megatron
  reshards its files, but the per-shard digests are then refused as a changed layout).

Layout of a committed step (``DIR_TEMPLATE``: Megatron-LM's ``iter_0000100``)::

    ROOT/latest_checkpointed_iteration.txt
    ROOT/iter_0000100/manifest.json, rank_00000.pt, state/ (ckptguard's extras and tensors)
    ROOT/iter_0000100/megatron/   .metadata, __0_0.distcp ..., common.pt, metadata.json (Megatron's)
"""

from __future__ import annotations

import json
import linecache
import logging
import os
import shutil
import stat
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._commit.savehandle import PendingSave
from .._core.parts import Parts
from .._disk.digest import digest
from .._disk.layout import read_small
from ..config import CheckpointConfig, ResumeMode, StorageOptions
from ..errors import (
    CheckpointCorruptError,
    CheckpointIncompleteError,
    CheckpointWriteError,
    ConfigError,
    ResumeError,
    StateMismatchError,
    UnsafeCheckpointError,
)
from ..manager import CheckpointManager
from ..storage.base import DCP_METADATA
from ..storage.streaming import StreamingStorage
from ..storage.unpickler import read_dcp_metadata
from .external import ExternalFiles

__all__ = [
    "DIR_TEMPLATE",
    "ITEM",
    "SUBDIR",
    "MegatronCheckpoint",
    "MegatronFiles",
    "MegatronState",
    "check_files",
    "cuda_call",
    "leaf_differences",
    "object_leaves",
]

log = logging.getLogger("ckptguard")

DIR_TEMPLATE = "iter_{step:07d}"
"""Megatron-LM's step directory names."""
SUBDIR = "megatron"
"""Where Megatron's own files of a step live: ``<step>/megatron/``."""
ITEM = "megatron"
"""The state item holding the Megatron part of the step (``MegatronState``)."""
CONFIG_FILE = "metadata.json"
COMMON_FILE = "common.pt"
COMMON_BYTES = 1 << 30
"""Bound of ``common.pt`` (non-sharded values: optimizer hyperparameters, the iteration)."""
_BACKENDS = {"sharded_backend": "torch_dist", "common_backend": "torch"}
METADATA_EXTRA = frozenset(
    ("torch.distributed.checkpoint.planner", n)
    for n in ("SavePlan", "WriteItem", "TensorWriteData")
)
"""What Megatron's ``.metadata`` names beyond plain DCP's: every rank's save plan
(``Metadata.all_local_plans``, for its cached-plan reuse); torch's own dataclasses, allowed by exact
name."""
_FORMAT = 2
"""The ``megatron`` item's format: 2 adds ``object_leaves`` (each ShardedObject's leaves by path,
what names the value that differs after a load). Format 1 is read too: during its restore the item
answers in format 1, so the restore's digest check compares like with like; the next save writes
format 2."""
_FORMATS = (1, 2)


def _megatron() -> Any:
    try:
        from megatron.core import dist_checkpointing
    except ImportError as exc:
        raise ConfigError(
            f"ckptguard.integrations.megatron needs megatron-core ({exc}); install it: "
            "pip install megatron-core==0.16.1 psutil"
        ) from None
    return dist_checkpointing


# ---------------------------------------------------------------- Megatron's files, checked


@dataclass(frozen=True)
class MegatronFiles:
    """What ``check_files`` found in one Megatron checkpoint directory."""

    directory: Path
    backend: str
    data_files: dict[str, int]
    """Each data file DCP's ``.metadata`` names, with the bytes its byte ranges need."""
    keys: int
    """Entries in DCP's ``.metadata`` (tensors and sharded objects)."""
    common_keys: list[str]
    """Top-level keys of ``common.pt``."""


def check_files(directory: str | os.PathLike[str]) -> MegatronFiles:
    """Check one ``dist_checkpointing`` directory (``torch_dist``) without running pickled code.

    Raises ``CheckpointIncompleteError`` for a missing or short file (a torn save),
    ``UnsafeCheckpointError`` for content that would run code when unpickled and
    ``CheckpointCorruptError`` for anything else Megatron did not write; each names the file."""
    d = Path(directory)
    backend = _check_config(d / CONFIG_FILE)
    md = read_dcp_metadata(
        d, extra=METADATA_EXTRA
    )  # the allow-list; refuses a link, a FIFO, a name leaving d
    need: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        end = int(info.offset) + int(info.length)
        need[info.relative_path] = max(need.get(info.relative_path, 0), end)
    for name, size in sorted(need.items()):
        _check_data_file(d / name, size)
    common = _check_common(d / COMMON_FILE)
    return MegatronFiles(d, backend, need, len(md.state_dict_metadata), sorted(map(str, common)))


def _plain_file(path: Path, what: str) -> os.stat_result:
    try:
        st = path.lstat()
    except FileNotFoundError:
        raise CheckpointIncompleteError(
            f"{path} ({what}) is missing: Megatron's save of this step never finished (it writes "
            f"{CONFIG_FILE} last); resume from an earlier committed step"
        ) from None
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeCheckpointError(
            f"{path} ({what}) is not a plain file (a link, a FIFO or a directory): Megatron "
            f"writes plain files, so it was put there by something else; do not load this "
            f"step, restore an earlier one"
        )
    return st


def _check_config(path: Path) -> str:
    _plain_file(path, "Megatron's checkpoint config")
    raw = read_small(path, limit=1 << 20, what="Megatron's metadata.json")
    try:
        cfg = json.loads(raw)
    except ValueError as exc:
        raise CheckpointCorruptError(
            f"{path} is not JSON ({exc}): not written by Megatron's dist_checkpointing"
        ) from None
    if not isinstance(cfg, dict):
        raise CheckpointCorruptError(
            f"{path} holds a {type(cfg).__name__}, not Megatron's checkpoint config"
        )
    for key, want in _BACKENDS.items():
        if cfg.get(key) != want:
            raise CheckpointCorruptError(
                f"{path}: {key} is {cfg.get(key)!r}; ckptguard checks Megatron's {want!r} format "
                f"only (megatron-core 0.16's default): save with dist_ckpt_format='torch_dist'"
            )
    return str(cfg["sharded_backend"])


def _check_data_file(path: Path, need: int) -> None:
    size = _plain_file(path, "a Megatron data file named in .metadata").st_size
    if size < need:
        raise CheckpointIncompleteError(
            f"{path} has {size} bytes but DCP's {DCP_METADATA} names byte ranges up to {need}: "
            f"the file is torn (a save killed while writing it, or a truncated copy); resume "
            f"from an earlier committed step"
        )


def _check_common(path: Path) -> Mapping[Any, Any]:
    size = _plain_file(path, "Megatron's common state").st_size
    if size > COMMON_BYTES:
        raise CheckpointCorruptError(
            f"{path} has {size} bytes, over the {COMMON_BYTES}-byte bound of common state"
        )
    try:
        common = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        text = str(exc)
        if "Weights only load failed" in text or "Unsupported global" in text:
            first = next(
                (line for line in text.splitlines() if "global" in line.lower()),
                text.splitlines()[0],
            )
            raise UnsafeCheckpointError(
                f"{path} names a class outside torch's safe-load allow-list ({first.strip()}): it "
                f"could run code if unpickled, so ckptguard will not read it, and Megatron would "
                f"be handed it only after this check; do not load this step, restore an earlier one"
            ) from None
        raise CheckpointCorruptError(
            f"{path} is not a readable torch file: {type(exc).__name__}: {exc}"
        ) from None
    if not isinstance(common, Mapping):
        raise CheckpointCorruptError(
            f"{path} holds a {type(common).__name__}, not Megatron's common state dict"
        )
    return common


# ---------------------------------------------------------------- CUDA calls Megatron makes


def cuda_call(exc: BaseException) -> str | None:
    """``file:line: source`` of the line in Megatron's code that called CUDA in ``exc``'s traceback,
    if any.

    Megatron-core 0.16's writer calls CUDA unconditionally (``torch.cuda.synchronize()``,
    ``torch.cuda.current_device()``); on a machine without a GPU that line is what to report."""
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        if f"{os.sep}megatron{os.sep}" not in frame.filename:
            continue
        line = (frame.line or linecache.getline(frame.filename, frame.lineno or 0)).strip()
        if "cuda" in line:
            short = frame.filename.split(f"{os.sep}megatron{os.sep}", 1)[1]
            return f"megatron/{short}:{frame.lineno}: {line}"
    return None


def _explain(exc: BaseException, what: str) -> BaseException:
    call = cuda_call(exc)
    if call is None or torch.cuda.is_available():
        return exc
    return ConfigError(
        f"Megatron's dist_checkpointing.{what} cannot run without CUDA: {call} raised "
        f"{type(exc).__name__}: {exc}. Megatron-core's torch_dist writer needs a GPU on every "
        f"rank; run the save on GPU ranks, or save this state through ckptguard's own path "
        f"(CheckpointManager) on the CPU"
    )


# ---------------------------------------------------------------- the Megatron state item


def _unwrap(chunk: Any) -> Any:
    """The model under Megatron's wrappers (``DistributedDataParallel``, ``Float16Module``), as
    Megatron-LM's ``unwrap_model``: a wrapper's default ``sharded_state_dict`` prefixes every key
    with ``module.``, which the wrapped model's ``load_state_dict`` then refuses."""
    _megatron()  # a ConfigError naming the package when it is missing
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    wrappers = (DistributedDataParallel, Float16Module, torch.nn.parallel.DistributedDataParallel)
    while isinstance(chunk, wrappers):
        chunk = chunk.module
    return chunk


def _chunks(model: Any) -> list[Any]:
    chunks = [_unwrap(c) for c in (model if isinstance(model, (list, tuple)) else [model])]
    for i, chunk in enumerate(chunks):
        if not callable(getattr(chunk, "sharded_state_dict", None)):
            raise ConfigError(
                f"model chunk {i} is a {type(chunk).__name__}, which has no sharded_state_dict(): "
                f"pass Megatron-core modules (GPTModel, or its DistributedDataParallel wrapper), "
                f"one or a list of model chunks"
            )
    return chunks


def _shard_name(sh: Any) -> str:
    offset = ",".join(str(int(o)) for o in getattr(sh, "global_offset", ()))
    flat = getattr(sh, "flattened_range", None)
    where = f"@{offset}" + (f"[{flat.start}:{flat.stop}]" if flat is not None else "")
    return f"{sh.key}{where}"


class MegatronState:
    """The Megatron part of a step, as a ckptguard ``Stateful`` item (``ITEM``).

    ``state_dict()`` is what ckptguard keeps in the extras: the CUDA RNG tracker's states and the
    xxh3 of every local shard of ``sharded_state_dict()``. ``load_state_dict`` loads Megatron's
    files from ``load_from`` (set by ``MegatronCheckpoint.restore``) into the model and optimizer,
    sets the tracker's states, and raises if a shard differs from the save. ``metadata`` goes to
    Megatron's ``sharded_state_dict(metadata=...)`` (e.g. ``{"distrib_optim_sharding_type":
    "dp_reshardable"}``)."""

    def __init__(
        self, model: Any, optimizer: Any = None, *, metadata: dict[str, Any] | None = None
    ) -> None:
        self.chunks = _chunks(model)
        self.optimizer = optimizer
        # megatron-core 0.16 refuses its own default (fully_sharded_model_space: "flattened_range is
        # not supported"); dp_reshardable is Megatron-LM's default: fully parallel, reshardable in
        # DP only.
        self.metadata = {"distrib_optim_sharding_type": "dp_reshardable", **(metadata or {})}
        self.load_from: Path | None = None
        self._loaded = False  # set by load_state_dict during a restore
        self._format = _FORMAT  # the restored step's, once one is restored

    def sharded_state_dict(self, *, is_loading: bool = False) -> dict[str, Any]:
        """Megatron-LM's layout: ``model`` (``model0``, ``model1``, ... for several chunks),
        ``optimizer``."""
        sd: dict[str, Any] = {}
        if len(self.chunks) == 1:
            sd["model"] = self.chunks[0].sharded_state_dict(metadata=self.metadata)
        else:
            for i, chunk in enumerate(self.chunks):
                sd[f"model{i}"] = chunk.sharded_state_dict(metadata=self.metadata)
        if self.optimizer is not None:
            model_sd = {k: v for k, v in sd.items() if k.startswith("model")}
            merged = model_sd.get("model", model_sd)
            sd["optimizer"] = self.optimizer.sharded_state_dict(
                merged, is_loading=is_loading, metadata=self.metadata
            )
        return sd

    def shard_digests(self) -> dict[str, str]:
        """xxh3 of every local piece Megatron saves: ``key@offset[range]`` -> digest; the
        non-sharded values (optimizer hyperparameters) under ``(common)``."""
        return self._fingerprint()[0]

    def _fingerprint(self) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
        """``shard_digests()`` and, for each non-tensor ``ShardedObject`` (the
        ``DistributedOptimizer``'s param_groups, the step), its leaves by path: what names the value
        that differs after a load."""
        from megatron.core.dist_checkpointing.mapping import (
            LocalNonpersistentObject,
            ShardedBase,
            ShardedObject,
            apply_factories,
        )

        sd = self.sharded_state_dict()
        apply_factories(sd)
        out: dict[str, str] = {}
        leaves: dict[str, dict[str, str]] = {}

        def walk(node: Any) -> Any:
            if isinstance(node, ShardedBase):
                name = _shard_name(node)
                out[name] = digest(node.data)
                if isinstance(node, ShardedObject) and not isinstance(node.data, torch.Tensor):
                    leaves[name] = object_leaves(node.data)
                return None
            if isinstance(node, LocalNonpersistentObject):
                return None
            if isinstance(node, Mapping):
                return {k: walk(v) for k, v in node.items()}
            if isinstance(node, (list, tuple)):
                return [walk(v) for v in node]
            return node

        out["(common)"] = digest(walk(sd))
        return out, leaves

    def state_dict(self) -> dict[str, Any]:
        if self.load_from is not None and not self._loaded:
            # ckptguard reads the item's structure before loading it: a fresh DistributedOptimizer
            # has no state to build a sharded state dict from yet (Megatron asserts), and none is
            # needed for it.
            return {"format": _FORMAT, "loading": str(self.load_from)}
        tracker = _tracker()
        states = (
            {k: v.clone() for k, v in tracker.get_states().items()} if tracker is not None else {}
        )
        shards, leaves = self._fingerprint()
        out = {"format": self._format, "cuda_rng_tracker": states, "shards": shards}
        return {**out, "object_leaves": leaves} if self._format >= 2 else out

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        directory = self.load_from
        if directory is None:
            raise ConfigError(
                f"the {ITEM!r} item loads Megatron's files of the step being restored: restore it "
                f"through MegatronCheckpoint.restore, not CheckpointManager.restore"
            )
        if saved.get("format") not in _FORMATS:
            raise CheckpointCorruptError(
                f"{directory.parent}: the {ITEM!r} item has format {saved.get('format')!r}, "
                f"this ckptguard reads {', '.join(map(str, _FORMATS))}: restore with the "
                f"ckptguard version that saved it"
            )
        self._format = int(saved["format"])
        check_files(
            directory
        )  # the bytes Megatron's DCP reader will unpickle, through the allow-list first
        dcp = _megatron()
        self._init_fresh_optimizer()
        sd = self.sharded_state_dict(is_loading=True)
        try:
            loaded = dcp.load(sd, str(directory))
        except Exception as exc:
            explained = _explain(exc, "load")
            if explained is exc:
                raise
            # from None: the commit reports the innermost cause, and this message already names it
            raise explained from None
        for i, chunk in enumerate(self.chunks):
            chunk.load_state_dict(loaded["model" if len(self.chunks) == 1 else f"model{i}"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(loaded["optimizer"])
            self._restore_adam_steps(loaded["optimizer"], directory)
        tracker = _tracker()
        if tracker is not None and saved.get("cuda_rng_tracker"):
            tracker.set_states({k: v.clone() for k, v in saved["cuda_rng_tracker"].items()})
        self._loaded = True
        self._compare(
            directory, dict(saved.get("shards") or {}), dict(saved.get("object_leaves") or {})
        )

    def _init_fresh_optimizer(self) -> None:
        """A DistributedOptimizer that never stepped has no state: megatron-core 0.16's torch
        fallback (no Apex, no Transformer Engine) then asserts in ``state_dict()`` (``assert
        len(steps) == 1``) while building the loading sharded state dict. Megatron's own dummy-state
        initialization (what it runs before an ``fsdp_dtensor`` load) gives it state, which the load
        then overwrites; the shard digests check that."""
        chained = getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]
        for opt in chained:
            inner = getattr(opt, "optimizer", None)
            init = getattr(opt, "_init_optimizer_states_with_dummy_values", None)
            if inner is not None and callable(init) and not inner.state:
                init()

    def _restore_adam_steps(self, loaded: Any, directory: Path) -> None:
        """Put back the Adam step that megatron-core 0.16's torch fallback (no Apex, no Transformer
        Engine) loses in a ``dp_reshardable`` load: ``load_state_dict`` sets every parameter's
        ``step`` to one tensor holding the saved step (from the param_groups), then
        ``_set_main_param_and_optimizer_states`` copies the loading template's ``step`` (the fresh
        optimizer's, 1) into that shared tensor. Seen on the H200: saved 5.0, after the load 1.0 in
        every parameter, so the bias correction would restart and, the tensor being shared, advance
        once per parameter per step. Each parameter gets a tensor of its own holding the saved step
        (as an optimizer that stepped has); the shard digests then check it."""
        chained = getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]
        parts = [loaded] if len(chained) == 1 else [v for _, v in sorted(loaded.items())]
        for i, (opt, part) in enumerate(zip(chained, parts, strict=True)):
            inner = getattr(opt, "optimizer", None)
            groups = (
                part.get("optimizer", {}).get("param_groups", [])
                if isinstance(part, Mapping)
                else []
            )
            steps = {g["step"] for g in groups if isinstance(g, Mapping) and "step" in g}
            if inner is None or len(steps) != 1:
                continue
            (step,) = steps
            wrong = [
                st
                for st in inner.state.values()
                if isinstance(st.get("step"), torch.Tensor) and float(st["step"]) != float(step)
            ]
            shared = len({id(st["step"]) for st in inner.state.values() if "step" in st}) < len(
                inner.state
            )
            if not wrong and not shared:
                continue
            found = sorted({float(st["step"]) for st in wrong})
            for st in inner.state.values():
                if isinstance(st.get("step"), torch.Tensor):
                    st["step"] = torch.tensor(
                        float(step), dtype=st["step"].dtype, device=st["step"].device
                    )
            log.warning(
                "%s: Megatron's load left Adam's step at %s in %d of %d parameters of "
                "optimizer %d (saved %s%s); ckptguard set each parameter's step to the saved "
                "one (megatron-core 0.16's torch fallback)",
                directory,
                found or float(step),
                len(wrong),
                len(inner.state),
                i,
                step,
                "; one tensor was shared by all" if shared else "",
            )

    def _compare(
        self, directory: Path, saved: dict[str, str], saved_leaves: dict[str, dict[str, str]]
    ) -> None:
        now, now_leaves = self._fingerprint()
        changed = sorted(k for k in saved.keys() & now.keys() if saved[k] != now[k])
        missing, extra = sorted(saved.keys() - now.keys()), sorted(now.keys() - saved.keys())
        if changed or missing or extra:
            parts = [
                f"{label}: {', '.join(keys[:6])}{' ...' if len(keys) > 6 else ''} ({len(keys)})"
                for label, keys in (
                    ("differ", changed),
                    ("saved only", missing),
                    ("live only", extra),
                )
                if keys
            ]
            where = [
                f"{k}: {d}"
                for k in changed
                if k in saved_leaves
                for d in leaf_differences(saved_leaves[k], now_leaves.get(k, {}))[:6]
            ]
            where += [
                f"{k} saved xxh3 {saved[k]}, now {now[k]}" for k in changed if k not in saved_leaves
            ][:3]
            raise StateMismatchError(
                f"Megatron's load of {directory} did not reproduce the saved "
                f"shards ({'; '.join(parts)})"
                + (f"; {'; '.join(where)}" if where else "")
                + ": build the model and optimizer with the saving run's configuration "
                "and parallel layout, then "
                "restore again"
            )


_LEAF_REPR = 64
"""A leaf whose repr is this short (a learning rate, a step count) is kept as its repr, else as a
digest."""


def object_leaves(obj: Any, path: str = "") -> dict[str, str]:
    """Every leaf of a nested structure by path (``param_groups.0.lr``): ``type:repr`` for a short
    leaf, ``type|digest`` otherwise (a tensor: its dtype and shape with the digest)."""
    if isinstance(obj, Mapping):
        out: dict[str, str] = {}
        for key in sorted(obj, key=repr):
            out.update(object_leaves(obj[key], f"{path}.{key}" if path else str(key)))
        return out or {path: f"{type(obj).__name__}:{{}}"}
    if (
        isinstance(obj, (list, tuple))
        and obj
        and not all(isinstance(v, (int, float, str, bool)) for v in obj)
    ):
        out = {}
        for i, v in enumerate(obj):
            out.update(object_leaves(v, f"{path}.{i}" if path else str(i)))
        return out
    if isinstance(obj, torch.Tensor):
        return {path: f"Tensor[{obj.dtype},{tuple(obj.shape)}]|{digest(obj)}"}
    text = repr(obj)
    return {
        path: f"{type(obj).__name__}:{text}"
        if len(text) <= _LEAF_REPR
        else f"{type(obj).__name__}|{digest(obj)}"
    }


def leaf_differences(saved: Mapping[str, str], now: Mapping[str, str]) -> list[str]:
    """``path saved X, now Y`` for each leaf that differs, is gone or is new."""
    return [
        f"{p} saved {saved.get(p, '(absent)')}, now {now.get(p, '(absent)')}"
        for p in sorted(saved.keys() | now.keys())
        if saved.get(p) != now.get(p)
    ]


_ASYNC_PREFIX = ".megatron-async-"
"""Megatron's async writes go to ``ROOT/.megatron-async-NNNNNNN/`` until ckptguard moves them into
the step."""


@dataclass
class _AsyncWrite:
    step: int
    prepared: Any  # Parts.commits.stage's (run, fence, start)
    resumed: float
    staging: Path


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _tracker() -> Any:
    try:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    except ImportError:
        return None
    return get_cuda_rng_tracker()


# ---------------------------------------------------------------- the front door


class MegatronCheckpoint:
    """Saves and restores a Megatron-core model and optimizer with ckptguard's commit and proof.

    ``state`` in ``save``/``restore``: any other ckptguard items (the scheduler, counters, the data
    iterator position), saved in the same step. ``config`` defaults to Megatron-LM's directory names
    (``DIR_TEMPLATE``); ``manager`` is the ``CheckpointManager`` underneath (its ``record_step``,
    ``committed_steps``, ``resolve``). ``strategy``: Megatron's ``sharded_strategy`` argument (None:
    its default ``torch_dist`` writer; a ``FullyParallelSaveStrategyWrapper`` works too)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        model: Any,
        optimizer: Any = None,
        *,
        config: CheckpointConfig | None = None,
        process_group: Any = None,
        metadata: dict[str, Any] | None = None,
        strategy: Any = None,
        validate_access_integrity: bool = True,
    ) -> None:
        _megatron()
        self.megatron = MegatronState(model, optimizer, metadata=metadata)
        self.strategy = strategy
        self.validate_access_integrity = validate_access_integrity
        self.last_files: MegatronFiles | None = None
        """What ``check_files`` found in the last save's Megatron directory."""
        self.last_write_seconds = 0.0
        """Seconds the last save spent in Megatron's own ``dist_checkpointing.save`` (the rest is
        ckptguard's)."""
        self._queue: Any = None  # Megatron's AsyncCallsQueue, made at the first save_async
        self._inflight: _AsyncWrite | None = (
            None  # a save_async whose Megatron write is not finalized yet
        )
        self._staged_dir: Path | None = (
            None  # the finished async write the commit moves into the step
        )
        self._saving = (
            False  # inside save(): Megatron's synchronous write runs in this (the caller's) thread
        )
        self._keep: Any = (
            None  # the host copies of Megatron's async write in flight (see _keeping_staged)
        )
        storage = ExternalFiles(StreamingStorage(), {SUBDIR: self._write})
        # ExternalFiles is foreground-only: a blocking budget never sends Megatron's collective
        # writer to a background commit (BACKGROUND acts as WARN; MegatronCheckpoint.save_async is
        # the background path).
        config = config or CheckpointConfig(storage=StorageOptions(dir_template=DIR_TEMPLATE))
        self._parts = (
            Parts()
        )  # Megatron's async writer ends before ckptguard's commit starts: the staged-commit calls
        self.manager = CheckpointManager(
            root, config=config, process_group=process_group, storage=storage, parts=self._parts
        )

    def _items(self, state: Mapping[str, Any] | None) -> dict[str, Any]:
        items = dict(state or {})
        if ITEM in items:
            raise ConfigError(
                f"state item name {ITEM!r} is the Megatron part's own; rename your item"
            )
        items[ITEM] = self.megatron
        return items

    def _write(self, directory: Path) -> Any:
        """``ExternalFiles`` writer: Megatron's own save into ``<tmp step>/megatron/``, then its
        files checked; for a ``save_async``, Megatron's finished files are moved in instead (rank 0,
        once every rank is here)."""
        staged = self._staged_dir
        if staged is not None:
            return lambda: self._move_in(staged, directory)
        if not self._saving:
            raise ConfigError(
                f"{directory}: Megatron's synchronous save runs collectives of the training's "
                f"process group and cannot run in a background commit: use "
                f"MegatronCheckpoint.save_async, not manager.save_async"
            )
        dcp = _megatron()
        started = time.perf_counter()
        try:
            dcp.save(
                self.megatron.sharded_state_dict(),
                str(directory),
                sharded_strategy=self.strategy,
                validate_access_integrity=self.validate_access_integrity,
            )
        except Exception as exc:
            explained = _explain(exc, "save")
            if explained is exc:
                raise
            # from None: the commit reports the innermost cause, and this message already names it
            raise explained from None
        self.last_write_seconds = time.perf_counter() - started
        # Megatron's save ends with a barrier after rank 0 wrote metadata.json: every rank's files
        # are complete.
        self.last_files = check_files(directory)

    def save(self, step: int, state: Mapping[str, Any] | None = None, **health: Any) -> Path | None:
        """Commit step ``step`` (Megatron's files and ``state``) on every rank, or raise on every
        rank. ``health``: ``CheckpointManager.save``'s ``healthy``/``loss``/``grad_norm``."""
        self.wait()  # a save_async in flight: finalized and committed first
        self._saving = True
        try:
            return self.manager.save(step, self._items(state), **health)
        finally:
            self._saving = False

    def _move_in(self, staged: Path, directory: Path) -> None:
        """Rank 0, after every rank's writer: Megatron's finalized async files become ``<tmp
        step>/megatron/``."""
        directory.rmdir()  # made empty by ExternalFiles
        os.rename(staged, directory)
        self.last_files = check_files(directory)

    def save_async(self, step: int, state: Mapping[str, Any] | None = None, **health: Any) -> bool:
        """Start step ``step``: Megatron's own async save (``async_sharded_save=True``: the tensors
        are staged to the host before it returns, its writer process writes them) into a staging
        folder under the root, and ckptguard's capture of ``state`` and the ``megatron`` item now.
        Collective, in the training thread. The step is committed only after Megatron's write
        finished on every rank: call ``finalize()`` at each step boundary (as Megatron-LM's
        ``maybe_finalize_async_save``; Megatron's finalization runs collectives of the training's
        group, so it runs in the caller's thread), then ckptguard checks the files and publishes in
        the background. A save_async while an earlier one is not finalized finalizes it first
        (blocking). False: the step is unhealthy and nothing was started. ``wait()`` joins all."""
        self.wait()  # an earlier save_async: finalized and committed first
        dcp = _megatron()
        from megatron.core.dist_checkpointing.strategies.async_utils import (
            AsyncCallsQueue,
        )  # lazy: megatron

        prepared = self._parts.commits.stage(
            step,
            self._items(state),
            health.get("healthy"),
            health.get("loss"),
            health.get("grad_norm"),
        )
        if prepared is None:
            return False
        resumed = time.monotonic()
        staging = self.manager.root / f"{_ASYNC_PREFIX}{step:07d}"
        try:
            self._make_staging(staging, step)
            started = time.perf_counter()
            try:
                request = dcp.save(
                    self.megatron.sharded_state_dict(),
                    str(staging),
                    sharded_strategy=self.strategy,
                    validate_access_integrity=self.validate_access_integrity,
                    async_sharded_save=True,
                )
            except Exception as exc:
                explained = _explain(exc, "save")
                if explained is exc:
                    raise
                raise explained from None
            self._queue = self._queue or AsyncCallsQueue()
            self._queue.schedule_async_request(self._keeping_staged(request))
        except BaseException:
            prepared[
                1
            ].live_read()  # no commit will read ckptguard's staged copies: training may go on
            raise
        self.last_write_seconds = time.perf_counter() - started
        self._inflight = _AsyncWrite(step, prepared, resumed, staging)
        return True

    def _make_staging(self, staging: Path, step: int) -> None:
        """Rank 0 makes Megatron's async folder (a killed run's are removed first); every rank hears
        whether it could (a broadcast, collective), so a failure raises on every rank instead of
        stranding them."""
        problem: list[str | None] = [None]
        if _rank() == 0:
            try:
                for old in self.manager.root.glob(
                    f"{_ASYNC_PREFIX}*"
                ):  # a killed run's unfinished async write
                    shutil.rmtree(old)
                staging.mkdir(parents=True)  # a new root: the save it starts creates it
            except OSError as exc:
                problem[0] = f"{type(exc).__name__}: {exc}"
        if torch.distributed.is_initialized():
            torch.distributed.broadcast_object_list(problem, src=0)
        if problem[0] is not None:
            raise CheckpointWriteError(
                f"step {step}: rank 0 cannot make Megatron's async folder {staging} "
                f"({problem[0]}); nothing was written and the tracker did not move: free space or "
                f"fix permissions under the root, then save again",
                step=step,
                failures=[],
            )

    def _keeping_staged(self, request: Any) -> Any:
        """Megatron's request with its host copies kept alive here until ``finalize``. Megatron 0.16
        stages the tensors into pinned host memory, forks its writer and drops its own references
        (``Process.start`` deletes the args): the pinned blocks go back to torch's caching host
        allocator, whose next pinned allocation in this process (a data loader's, a digest's)
        overwrites what the writer has not written yet. Seen on the H200: step 5's file held step
        6's position embeddings (refused by the shard gate)."""
        preload = getattr(request, "preload_fn", None)
        if preload is None:
            return request

        def preload_and_keep() -> Any:
            staged = preload()
            self._keep = staged
            return staged

        return request._replace(preload_fn=preload_and_keep)

    def finalize(self, *, blocking: bool = False) -> PendingSave | None:
        """Collective, at a step boundary: finalize Megatron's async write if it is done on every
        rank (or wait for it: ``blocking``), then start ckptguard's commit of its step in the
        background (its ``PendingSave``); None while the write still runs. Megatron's writer error
        is raised on every rank."""
        inflight = self._inflight
        if inflight is None or self._queue is None:
            return None
        try:
            if not self._queue.maybe_finalize_async_calls(blocking=blocking):
                return None
        except (
            BaseException
        ):  # Megatron's writer failed (raised on every rank): this step is not committed
            self._inflight, self._keep = None, None
            inflight.prepared[1].live_read()  # no commit will read ckptguard's staged copies
            if _rank() == 0:
                shutil.rmtree(inflight.staging, ignore_errors=True)
            raise
        self._inflight, self._keep = (
            None,
            None,
        )  # the writer is done on every rank: its host copies may go
        self._staged_dir = inflight.staging  # what the commit's writer moves in; reset by wait()
        return self._parts.commits.start(inflight.step, inflight.prepared, inflight.resumed)

    def wait(self) -> Path | None:
        """Finalize a Megatron async write in flight and wait for its commit; the committed step
        directory."""
        if self._inflight is not None:
            self.finalize(blocking=True)
        try:
            return self.manager.wait()
        finally:
            self._staged_dir = None

    def restore(
        self,
        state: dict[str, Any] | None = None,
        *,
        mode: ResumeMode = ResumeMode.AUTO,
        path: str | os.PathLike[str] | None = None,
    ) -> int:
        """Load the resolved step into the model, optimizer and ``state``; return its step (0:
        fresh). ``state``'s plain values are replaced in the mapping, as
        ``CheckpointManager.restore`` does."""
        items = self._items(state)
        res = self.manager.resolve(mode=mode, path=path)
        if res.fresh:
            return self.manager.restore(items, mode=mode, path=path)
        assert res.path is not None
        self.megatron.load_from, self.megatron._loaded = res.path / SUBDIR, False
        try:
            step = self.manager.restore(items, mode=mode, path=path)
        finally:
            # the restore compared the item in the restored step's format; saves write the current
            # one
            self.megatron.load_from, self.megatron._loaded, self.megatron._format = (
                None,
                False,
                _FORMAT,
            )
        if (
            step != res.step
        ):  # cannot happen under the write lease; the shard comparison would fail first
            raise ResumeError(
                f"{self.manager.root}: resolve chose step {res.step} but restore loaded "
                f"step {step}; another process changed the root while this one restored: "
                f"stop it, then restore again"
            )
        if state is not None:
            for name in state:
                state[name] = items[name]
        return step
