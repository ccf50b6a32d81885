"""Reading DCP's pickled ``.metadata`` without running pickled code."""

from __future__ import annotations

import io
import pickle
import pickletools
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from ..errors import CheckpointCorruptError, CheckpointIncompleteError, UnsafeCheckpointError
from .base import DCP_METADATA

# ---------------------------------------------------------------- restricted unpickling

_DCP_METADATA_CLASSES = (
    "ChunkStorageMetadata",
    "_MEM_FORMAT_ENCODING",
    "TensorProperties",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "StorageMeta",
    "Metadata",
    "MetadataIndex",
)
# Exact (module, name) pairs only: a module-wide allowance would let protocol 4's dotted
# names reach through it ("filesystem", "os.system") to any callable.
_ALLOWED_NAMES = {
    *(("torch.distributed.checkpoint.metadata", n) for n in _DCP_METADATA_CLASSES),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
    ("torch.distributed.checkpoint.planner", "LoadItemType"),
    ("torch.distributed.checkpoint.planner", "WriteItemType"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
}


class SafeMetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP ``.metadata`` allowing only DCP's own classes and torch dtypes.

    A crafted ``.metadata`` can name any callable (``os.system``); plain ``pickle.load``
    would call it. We refuse any global outside the allow-list before it is resolved.
    """

    def find_class(self, module: str, name: str) -> Any:
        if "." not in name and (module, name) in _ALLOWED_NAMES:
            return super().find_class(module, name)
        if module == "torch" and "." not in name and isinstance(getattr(torch, name, None),
                                                               (torch.dtype, torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in DCP metadata")


def read_dcp_metadata(state_dir: Path) -> Metadata:
    path = state_dir / DCP_METADATA
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointIncompleteError(
            f"{path} is missing: the tensor state of this checkpoint was never finished; "
            "resume from an earlier committed step"
        ) from None
    try:
        md = SafeMetadataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as exc:
        if "is not allowed" in str(exc):
            raise UnsafeCheckpointError(
                f"{path} refers to {exc}: the file was not written by DCP, or was tampered "
                "with; it could run code if unpickled, so ckptguard will not read it. "
                "Do not load this checkpoint; restore an earlier step or rewrite it."
            ) from None
        raise CheckpointCorruptError(f"{path} is not a readable DCP metadata file: {exc}") from None
    except Exception as exc:
        raise CheckpointCorruptError(f"{path} is not a readable DCP metadata file: {exc}") from None
    if not isinstance(md, Metadata):
        raise CheckpointCorruptError(f"{path} holds a {type(md).__name__}, not DCP Metadata")
    return md


def pickle_globals(data: bytes) -> set[str]:
    """Every global a pickle names, without running it (for verify reports)."""
    names: set[str] = set()
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("GLOBAL", "INST") and isinstance(arg, str):
            names.add(arg.replace(" ", "."))
    return names


