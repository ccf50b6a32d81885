"""Safetensors files as the export writes and checks them: Hugging Face's serializer to write, an
independent reader of the format (8 bytes of little-endian header length, the JSON header, the data)
to read back with plain reads and no mmap, and the layout-free digest of whole tensors.

Contract: ``write_shard`` writes and fsyncs one file and returns the digests of what it was handed;
``read_tensors`` yields each tensor of a file, validated against the header and the file's size (a
malformed file is a CheckpointCorruptError, never a crash); ``trim`` gives freed heap pages back to
the OS so a budget measured as RSS holds.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .._disk import layout as _layout
from .._disk.boxsum import combine_layout_free, layout_free_partials
from ..errors import CheckpointCorruptError

__all__ = [
    "ST_DTYPES",
    "digests",
    "read_header",
    "read_tensors",
    "tensor_span",
    "trim",
    "write_shard",
]

_MiB = 1 << 20
# safetensors' dtype names (its format spec), for the independent read-back of what was written.
ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """The layout-free digest of each whole tensor (what a save records for a tensor held by one
    rank)."""
    if not tensors:
        return {}
    return combine_layout_free([layout_free_partials({"x": tensors})]).get("x", {})


def trim() -> None:
    """Give freed heap memory back to the OS. glibc raises its mmap threshold after a large free, so
    the next tensors of that size come from the heap, whose freed pages stay in the RSS unless
    trimmed (measured: the budget overrun by a file's worth of tensors without this)."""
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


def _plain_file(path: str, flags: int) -> int:
    """``open``'s opener: never through a symlink, never blocking on a FIFO (checked regular
    after)."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)


def _check_regular(path: Path, fd: int) -> int:
    """The size of the file open on ``fd``; a FIFO, device or directory named as a safetensors file
    is refused."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointCorruptError(
            f"{path} is not a regular file (a FIFO, device or directory): not read"
        )
    return st.st_size


def read_header(path: str | os.PathLike[str]) -> tuple[int, dict[str, Any]]:
    """(data start, header) of a safetensors file: 8 bytes of little-endian header length, then the
    JSON."""
    path = Path(path)
    try:
        # closed by the with below: the open's error is ours
        f = open(path, "rb", opener=_plain_file)  # noqa: SIM115
    except OSError as exc:
        raise CheckpointCorruptError(
            f"{path} cannot be opened as a plain file ({exc.strerror or exc}): a "
            "symlink or a missing file is never read"
        ) from None
    with f:
        size = _check_regular(path, f.fileno())
        head = f.read(8)
        if len(head) != 8:
            raise CheckpointCorruptError(
                f"{path}: {len(head)} bytes, shorter than a safetensors header"
            )
        n = int.from_bytes(head, "little")
        if n > min(100 * _MiB, size - 8):  # bounded by the real bytes before the read
            raise CheckpointCorruptError(
                f"{path}: a header of {n} bytes in a file of {size}; not a safetensors file"
            )
        header = _layout.parse_json(f.read(n), where=str(path))
    if not isinstance(header, dict):
        raise CheckpointCorruptError(f"{path}: the safetensors header is not a JSON object")
    return 8 + n, header


def tensor_span(
    path: Path, name: str, info: object, data_bytes: int
) -> tuple[int, int, list[int], torch.dtype]:
    """(start, end, shape, dtype) of one header entry, every declared size checked against the
    others and against the ``data_bytes`` the file really holds after its header, before anything is
    allocated."""
    ok = isinstance(info, dict) and info.get("dtype") in ST_DTYPES
    shape, offsets = (
        (info.get("shape"), info.get("data_offsets")) if isinstance(info, dict) else (None, None)
    )
    ok = ok and isinstance(shape, list) and all(_count(s) for s in shape)
    ok = ok and isinstance(offsets, list) and len(offsets) == 2 and all(_count(o) for o in offsets)
    if not ok:
        raise CheckpointCorruptError(
            f"{path}: tensor {name!r} is absent or malformed in the header (dtype, shape "
            "and data_offsets as safetensors writes them)"
        )
    assert isinstance(info, dict) and isinstance(shape, list) and isinstance(offsets, list)
    dtype = ST_DTYPES[info["dtype"]]
    nbytes = dtype.itemsize
    for s in shape:
        nbytes *= s
    a, b = offsets
    if b - a != nbytes or b > data_bytes:
        raise CheckpointCorruptError(
            f"{path}: tensor {name!r} spans bytes {a}..{b} as {info['dtype']} {shape} "
            f"({nbytes} bytes), which does not fit the {data_bytes} bytes of data the "
            "file holds; nothing was allocated from it"
        )
    return a, b, shape, dtype


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_tensors(
    path: str | os.PathLike[str],
    names: list[str] | None = None,
    into: dict[str, torch.Tensor] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of a safetensors file, one at a time, read with plain file reads (no mmap); into
    the tensor ``into[name]`` when given (its dtype and shape must be the file's). Never through a
    symlink or from a FIFO; every span checked against the file's size before its tensor is
    allocated."""
    path = Path(path)
    start, header = read_header(path)
    with open(path, "rb", buffering=0, opener=_plain_file) as f:
        size = _check_regular(path, f.fileno())
        for name in (
            names if names is not None else sorted(k for k in header if k != "__metadata__")
        ):
            a, _end, shape, dtype = tensor_span(path, name, header.get(name), size - start)
            t = into[name] if into is not None and name in into else torch.empty(shape, dtype=dtype)
            if list(t.shape) != shape or t.dtype != dtype:
                raise CheckpointCorruptError(
                    f"{path}: tensor {name!r} is {dtype} {shape} in the file, "
                    f"{t.dtype} {list(t.shape)} where it is read into"
                )
            f.seek(start + a)
            view = (
                memoryview(t.view(-1).view(torch.uint8).numpy().data)
                if t.numel()
                else memoryview(bytearray())
            )
            got = 0
            while got < len(view):
                n = f.readinto(view[got:])
                if not n:
                    raise CheckpointCorruptError(f"{path}: ends inside tensor {name!r}")
                got += n
            yield name, t


def write_shard(path: str | os.PathLike[str], tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Write one safetensors file with Hugging Face's serializer, fsync it; the digests meant to be
    in it."""
    path = Path(path)
    from safetensors.torch import save_file

    meant = digests(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return meant
