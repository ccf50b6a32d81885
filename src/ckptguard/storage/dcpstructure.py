"""One structure check of DCP's ``.metadata``, shared by both readers (``dcpindex.read_dcp_index``
for the operator commands, ``unpickler.read_dcp_metadata`` for restore), so no command calls a step
good whose metadata restore refuses.

Contract: ``check_structure`` reads only the attributes DCP's classes and the torch-free stand-ins
share, never imports torch, allocates nothing the metadata declares, and raises
``CheckpointCorruptError`` (``ShortDataFile`` for a span past the end of its data file) naming the
file and the key.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, ClassVar

from ..errors import CheckpointCorruptError

__all__ = ["ITEMSIZE", "ShortDataFile", "check_structure"]

# Bytes per element of each dtype ``TORCH_DTYPE_NAMES`` holds (torch 2.13's ``dtype.itemsize``; a
# test compares the two): the sizes a ``.metadata`` declares are bounded without importing torch.
ITEMSIZE = {
    "bfloat16": 2,
    "bit": 1,
    "bits16": 2,
    "bits1x8": 1,
    "bits2x4": 1,
    "bits4x2": 1,
    "bits8": 1,
    "bool": 1,
    "cdouble": 16,
    "cfloat": 8,
    "chalf": 4,
    "complex128": 16,
    "complex32": 4,
    "complex64": 8,
    "double": 8,
    "float": 4,
    "float16": 2,
    "float32": 4,
    "float4_e2m1fn_x2": 1,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "half": 2,
    "int": 4,
    "int1": 1,
    "int16": 2,
    "int2": 1,
    "int3": 1,
    "int32": 4,
    "int4": 1,
    "int5": 1,
    "int6": 1,
    "int64": 8,
    "int7": 1,
    "int8": 1,
    "long": 8,
    "qint32": 4,
    "qint8": 1,
    "quint2x4": 1,
    "quint4x2": 1,
    "quint8": 1,
    "short": 2,
    "uint1": 1,
    "uint16": 2,
    "uint2": 1,
    "uint3": 1,
    "uint32": 4,
    "uint4": 1,
    "uint5": 1,
    "uint6": 1,
    "uint64": 8,
    "uint7": 1,
    "uint8": 1,
}
_ABSENT = object()


class _Bad(Exception):
    """One structural fault of a ``.metadata``, said in words (raised as CheckpointCorruptError by
    the caller)."""

    def __init__(self, message: str, data_file: str | None = None) -> None:
        super().__init__(message)
        self.data_file = data_file


class ShortDataFile(CheckpointCorruptError):
    """The metadata stores bytes past the end of ``data_file`` as it is on disk (a truncated or
    swapped data file, or a crafted span): nothing is read or allocated from it."""

    fields: ClassVar[tuple[str, ...]] = ("data_file",)  # crosses ranks with the error

    def __init__(self, message: str, data_file: str | None = None) -> None:
        super().__init__(message)
        self.data_file = data_file


def _field(obj: Any, name: str, where: str) -> Any:
    value = getattr(obj, name, _ABSENT)
    if value is _ABSENT:
        raise _Bad(f"{where} has no field {name!r}")
    return value


def _kind(obj: Any) -> str:
    return type(obj).__name__


def _ints(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise _Bad(f"{where} is {value!r}, not a tuple of non-negative ints")
    return tuple(value)


def _itemsize(props: Any, where: str) -> int:
    if _kind(props) != "TensorProperties":
        raise _Bad(f"{where}: its properties are a {_kind(props)}, not TensorProperties")
    name = str(_field(props, "dtype", where)).removeprefix("torch.")
    # str() of a torch.dtype and the stand-in's string read the same ("torch.float32")
    if name not in ITEMSIZE:
        raise _Bad(f"{where} has the dtype {name!r}, which is no torch dtype")
    return ITEMSIZE[name]


def _chunks(fqn: str, meta: Any) -> dict[tuple[int, ...], int]:
    """{chunk offsets: declared bytes} of one tensor entry, each chunk inside the tensor's size."""
    where = f"key {fqn!r}"
    size = _ints(_field(meta, "size", where), f"{where}: its size")
    item = _itemsize(_field(meta, "properties", where), where)
    chunks = _field(meta, "chunks", where)
    if not isinstance(chunks, list):
        raise _Bad(f"{where}: its chunks are a {_kind(chunks)}, not a list")
    out: dict[tuple[int, ...], int] = {}
    for chunk in chunks:
        if _kind(chunk) != "ChunkStorageMetadata":
            raise _Bad(f"{where} holds a {_kind(chunk)} among its chunks")
        offsets = _ints(_field(chunk, "offsets", where), f"{where}: its chunk offsets")
        sizes = _ints(_field(chunk, "sizes", where), f"{where}: its chunk sizes")
        if (
            len(offsets) != len(size)
            or len(sizes) != len(size)
            or any(o + n > d for o, n, d in zip(offsets, sizes, size, strict=True))
        ):
            raise _Bad(
                f"{where}: its chunk at {list(offsets)} of {list(sizes)} "
                f"leaves its size {list(size)}"
            )
        if offsets in out:
            raise _Bad(f"{where} lists the chunk at {list(offsets)} twice")
        count = item
        for n in sizes:
            count *= n
        out[offsets] = count
    return out


def _entries(md: Any) -> dict[str, object]:
    """The key table, every value a tensor or bytes entry."""
    table = md.state_dict_metadata
    for fqn, meta in table.items():
        if not isinstance(fqn, str) or _kind(meta) not in (
            "TensorStorageMetadata",
            "BytesStorageMetadata",
        ):
            raise _Bad(f"key {fqn!r} holds a {_kind(meta)}, not a tensor or bytes entry")
    return dict(table)


def _stored(md: Any) -> list[tuple[str, tuple[int, ...] | None, str, int, int, bool]]:
    """Each storage entry as (fqn, chunk offsets, file, offset, length, transformed)."""
    out = []
    for index, info in (md.storage_data or {}).items():
        fqn = _field(index, "fqn", "a storage index")
        if (
            _kind(index) != "MetadataIndex"
            or not isinstance(fqn, str)
            or _kind(info) != "_StorageInfo"
        ):
            raise _Bad(
                f"the storage table holds a {_kind(index)} (fqn {fqn!r}) -> {_kind(info)}, not a "
                "MetadataIndex with a str fqn -> _StorageInfo"
            )
        where = f"the storage entry of key {fqn!r}"
        raw = _field(index, "offset", where)
        offsets = None if raw is None else _ints(raw, f"{where}: its chunk offsets")
        start, length = _field(info, "offset", where), _field(info, "length", where)
        if not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (start, length)
        ):
            raise _Bad(f"{where} spans {start!r}+{length!r}, not two non-negative ints")
        transformed = bool(getattr(info, "transform_descriptors", None))
        out.append((fqn, offsets, str(info.relative_path), start, length, transformed))
    return out


def check_structure(path: Path, md: Any, *, data_files: bool = True) -> None:
    """What restore relies on in a ``.metadata`` (``path``), checked before anything is read or
    allocated from it, the same for DCP's classes and for the stand-ins: every key a tensor or bytes
    entry, every tensor chunk inside its tensor and stored exactly once, every stored span a pair of
    non-negative ints, and no chunk declared larger than its stored bytes. ``data_files``: every
    span also inside its data file as it is on disk (the checks; restore's readers refuse a span
    past the end of its file when they reach it, with that file's own error, before reading or
    allocating from it).

    Both readers (``read_dcp_index`` for the operator commands, ``read_dcp_metadata`` for restore)
    call it, so no command calls a step good whose metadata restore refuses."""
    try:
        _check(path, md, data_files)
    except _Bad as exc:
        message = (
            f"{path}: {exc}: the metadata was crafted or damaged; nothing was allocated or read "
            f"from it. Restore an earlier step."
        )
        raise (
            CheckpointCorruptError(message)
            if exc.data_file is None
            else ShortDataFile(message, exc.data_file)
        ) from None


def _check(path: Path, md: Any, data_files: bool) -> None:
    table = _entries(md)
    chunks = {
        fqn: _chunks(fqn, meta)
        for fqn, meta in table.items()
        if _kind(meta) == "TensorStorageMetadata"
    }
    stored: dict[str, int] = {}
    seen: set[tuple[str, tuple[int, ...] | None]] = set()
    sizes: dict[str, int | None] = {}
    unbounded: set[str] = set()
    for fqn, offsets, rel, start, length, transformed in _stored(md):
        if fqn not in table or (fqn, offsets) in seen:
            raise _Bad(
                f"the storage table names key {fqn!r} at {offsets}, which is "
                + ("stored twice" if fqn in table else "no key of the metadata")
            )
        seen.add((fqn, offsets))
        if rel not in sizes:
            sizes[rel] = _file_size(path.parent / rel) if data_files else None
        if sizes[rel] is not None and start + length > int(sizes[rel] or 0):
            raise _Bad(
                f"key {fqn!r} is stored at bytes {start}..{start + length} of {rel}, which holds "
                f"{sizes[rel]} bytes",
                data_file=rel,
            )
        if fqn not in chunks:
            continue
        if offsets not in chunks[fqn]:
            raise _Bad(
                f"the storage table names a chunk of key {fqn!r} at {offsets}, "
                f"which the key does not have"
            )
        declared = chunks[fqn][offsets]
        # DCP stores a chunk raw or through torch.save, never in fewer bytes; a transform
        # (compression) may.
        if not transformed and declared > length:
            raise _Bad(
                f"key {fqn!r} at offset {list(offsets or ())} declares {declared} "
                f"bytes stored in {length}"
            )
        stored[fqn] = stored.get(fqn, 0) + declared
        if transformed:
            unbounded.add(fqn)
    for fqn, meta in table.items():
        _check_covered(
            fqn, meta, chunks.get(fqn), seen, None if fqn in unbounded else stored.get(fqn, 0)
        )


def _check_covered(
    fqn: str,
    meta: Any,
    chunks: dict[tuple[int, ...], int] | None,
    seen: set[tuple[str, tuple[int, ...] | None]],
    stored: int | None,
) -> None:
    if chunks is None:
        if not any(f == fqn for f, _ in seen):
            raise _Bad(f"bytes key {fqn!r} has no storage entry")
        return
    missing = [list(o) for o in chunks if (fqn, o) not in seen]
    if missing:
        raise _Bad(f"key {fqn!r}: its chunk at {missing[0]} has no storage entry")
    total = ITEMSIZE[str(meta.properties.dtype).removeprefix("torch.")]
    for n in meta.size:
        total *= n
    if stored is not None and total > stored:
        raise _Bad(f"key {fqn!r} declares {total} bytes but its stored chunks hold {stored}")


def _file_size(path: Path) -> int | None:
    """The size of a data file as it is on disk; None when it is absent or no plain file (the checks
    of the step's files report that, and the readers refuse it when they open it)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None
