"""Safetensors files as the export writes and checks them: Hugging Face's serializer to write, an
independent reader of the format (8 bytes of little-endian header length, the JSON header, the data) to
read back with plain reads and no mmap, and the layout-free digest of whole tensors.

Contract: ``write_shard`` writes and fsyncs one file and returns the digests of what it was handed;
``read_tensors`` yields each tensor of a file, validated against the header and the file's size (a
malformed file is a CheckpointCorruptError, never a crash); ``trim`` gives freed heap pages back to the
OS so a budget measured as RSS holds.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .._disk import layout as _layout
from .._disk.layoutfree import combine_layout_free, layout_free_partials
from ..errors import CheckpointCorruptError

__all__ = ["ST_DTYPES", "digests", "read_header", "read_tensors", "trim", "write_shard"]

_MiB = 1 << 20
# safetensors' dtype names (its format spec), for the independent read-back of what was written.
ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}

def digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """The layout-free digest of each whole tensor (what a save records for a tensor held by one rank)."""
    if not tensors:
        return {}
    return combine_layout_free([layout_free_partials({"x": tensors})]).get("x", {})


def trim() -> None:
    """Give freed heap memory back to the OS. glibc raises its mmap threshold after a large free, so the
    next tensors of that size come from the heap, whose freed pages stay in the RSS unless trimmed
    (measured: the budget overrun by a file's worth of tensors without this)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


_LIBC: list[Any] = []


def _libc() -> Any:
    if not _LIBC:
        import ctypes
        import ctypes.util

        name = ctypes.util.find_library("c")
        try:
            lib = ctypes.CDLL(name) if name else None
            _LIBC.append(lib if lib is not None and hasattr(lib, "malloc_trim") else None)
        except OSError:
            _LIBC.append(None)
    return _LIBC[0]


def read_header(path: Path) -> tuple[int, dict[str, Any]]:
    """(data start, header) of a safetensors file: 8 bytes of little-endian header length, then the JSON."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CheckpointCorruptError(f"{path}: {len(head)} bytes, shorter than a safetensors header")
        n = int.from_bytes(head, "little")
        if n > 100 * _MiB:
            raise CheckpointCorruptError(f"{path}: a header of {n} bytes; not a safetensors file")
        header = _layout.parse_json(f.read(n), where=str(path))
    if not isinstance(header, dict):
        raise CheckpointCorruptError(f"{path}: the safetensors header is not a JSON object")
    return 8 + n, header


def read_tensors(
    path: Path, names: list[str] | None = None, into: dict[str, torch.Tensor] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of a safetensors file, one at a time, read with plain file reads (no mmap); into the
    tensor ``into[name]`` when given (its dtype and shape must be the file's)."""
    start, header = read_header(path)
    size = path.stat().st_size
    with open(path, "rb", buffering=0) as f:
        for name in names if names is not None else sorted(k for k in header if k != "__metadata__"):
            info = header.get(name)
            if not isinstance(info, dict) or info.get("dtype") not in ST_DTYPES:
                raise CheckpointCorruptError(f"{path}: tensor {name!r} is absent or has an unknown dtype")
            a, b = (int(x) for x in info["data_offsets"])
            shape, dtype = [int(s) for s in info["shape"]], ST_DTYPES[info["dtype"]]
            t = into[name] if into is not None and name in into else torch.empty(shape, dtype=dtype)
            if list(t.shape) != shape or t.dtype != dtype or b - a != t.numel() * t.element_size() or start + b > size:
                raise CheckpointCorruptError(f"{path}: tensor {name!r} spans bytes {a}..{b} as {info['dtype']} "
                                             f"{shape}, which do not match {t.dtype} {list(t.shape)} or the file's "
                                             f"size {size}")
            f.seek(start + a)
            view = memoryview(t.view(-1).view(torch.uint8).numpy().data) if t.numel() else memoryview(bytearray())
            got = 0
            while got < len(view):
                n = f.readinto(view[got:])
                if not n:
                    raise CheckpointCorruptError(f"{path}: ends inside tensor {name!r}")
                got += n
            yield name, t


def write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Write one safetensors file with Hugging Face's serializer, fsync it; the digests meant to be in it."""
    from safetensors.torch import save_file

    meant = digests(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return meant
