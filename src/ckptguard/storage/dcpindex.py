"""DCP's ``.metadata`` read without torch, for the checks: which data file holds which key's chunk.

Contract: ``read_dcp_index`` reads the file exactly as ``read_dcp_metadata`` does (bounded, never
through a link or from a FIFO), refuses the same globals (the allow-list lives here and the
restricted unpickler uses it), raises the same errors with the same messages, and confines every
data file name to the state directory the same way; it only builds stand-ins for DCP's classes
instead of importing torch. What it returns has the attributes the checks read
(``storage_data``: ``MetadataIndex``-like keys with ``fqn`` and ``offset``, ``_StorageInfo``-like
values with ``relative_path``); tensors are never loaded from it (``read_dcp_metadata`` is what a
restore uses). The operator commands that check a step (``list``, ``gc``, ``adopt``, ``preflight``)
then start without torch's 1-2 s import, 20-60 s on a loaded node.

The stand-ins are stricter than DCP's classes, never looser: a shape, layout, dtype or enum value
torch would refuse is refused here, and a BUILD on a stand-in class (which on DCP's own classes
would change them for the rest of the process) fails.
"""

from __future__ import annotations

import collections
import io
import os
import pathlib
import pickle
import pickletools
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, NoReturn

from .._disk.layout import read_small
from ..errors import CheckpointCorruptError, CheckpointIncompleteError, UnsafeCheckpointError
from .base import DCP_METADATA

__all__ = ["METADATA_BYTES", "MetadataView", "ShortDataFile", "check_structure", "plain_name", "read_dcp_index"]

METADATA_BYTES = 1 << 30
"""Bound of one ``.metadata`` read; DCP's metadata of a large model is megabytes."""

DCP_METADATA_CLASSES = (
    "ChunkStorageMetadata",
    "_MEM_FORMAT_ENCODING",
    "TensorProperties",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "StorageMeta",
    "Metadata",
    "MetadataIndex",
)
_MD = "torch.distributed.checkpoint.metadata"
# Exact (module, name) pairs only: a module-wide allowance would let protocol 4's dotted
# names reach through it ("filesystem", "os.system") to any callable.
ALLOWED_NAMES = {
    *((_MD, n) for n in DCP_METADATA_CLASSES),
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

# ``torch.<name>`` globals the restricted unpickler allows: the dtypes and memory formats of torch
# 2.13 (a test compares this with torch's own list).
TORCH_DTYPE_NAMES = frozenset(
    [
        "bfloat16", "bit", "bits16", "bits1x8", "bits2x4", "bits4x2", "bits8", "bool", "cdouble", "cfloat", "chalf",
        "channels_last", "channels_last_3d", "complex128", "complex32", "complex64", "contiguous_format", "double",
        "float", "float16", "float32", "float4_e2m1fn_x2", "float64", "float8_e4m3fn", "float8_e4m3fnuz",
        "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "half", "int", "int1", "int16", "int2", "int3", "int32",
        "int4", "int5", "int6", "int64", "int7", "int8", "legacy_contiguous_format", "long", "preserve_format",
        "qint32", "qint8", "quint2x4", "quint4x2", "quint8", "short", "uint1", "uint16", "uint2", "uint3", "uint32",
        "uint4", "uint5", "uint6", "uint64", "uint7", "uint8"
    ]
)
TORCH_LAYOUTS = frozenset(
    [
        "torch._mkldnn", "torch.jagged", "torch.sparse_bsc", "torch.sparse_bsr", "torch.sparse_coo",
        "torch.sparse_csc", "torch.sparse_csr", "torch.strided"
    ]
)


def refused(exc: pickle.UnpicklingError) -> bool:
    return "is not allowed" in str(exc)


def _refuse(what: str) -> NoReturn:
    raise pickle.UnpicklingError(f"{what} is not allowed in DCP metadata")


class _Frozen(type):
    """A stand-in class: a pickle's BUILD on the class itself (not an instance) cannot change it."""

    def __setattr__(cls, name: str, value: Any) -> None:
        _refuse(f"a BUILD on the global(s) [{cls.__qualname__!r}]")

    def __delattr__(cls, name: str) -> None:
        _refuse(f"a BUILD on the global(s) [{cls.__qualname__!r}]")


class _Record(metaclass=_Frozen):
    """A DCP dataclass as its pickle builds it: NEWOBJ with no arguments, then BUILD writing its
    fields into the instance's ``__dict__`` (no ``__setstate__``, as DCP's dataclasses have none).
    Unhashable as DCP's (non-frozen) dataclasses are: a pickle that uses one as a dict key or set
    member fails here as it fails in restore."""

    __hash__ = None  # type: ignore[assignment]


class MetadataView(_Record):
    """Stands in for ``Metadata``; its defaults are DCP's."""

    planner_data: Any = None
    storage_data: Any = None
    storage_meta: Any = None
    version: Any = None


class MetadataIndex(_Record):
    """Stands in for ``MetadataIndex`` (a dict key: hashed and compared on fqn and offset, as DCP's is)."""

    offset: Any = None
    index: Any = None

    def __hash__(self) -> int:  # type: ignore[override]  # frozen in DCP: hashable, unlike the others
        return hash((self.__dict__.get("fqn"), self.offset))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MetadataIndex) and (self.__dict__.get("fqn"), self.offset) == (
            other.__dict__.get("fqn"), other.offset)


class TensorProperties(_Record):
    def __setstate__(self, state: Any) -> None:
        # DCP's own __setstate__: five values; an unknown memory-format encoding raises there too.
        dtype, layout, requires_grad, memory_format, pin_memory = state
        if memory_format not in (0, 1, 2):
            raise RuntimeError(f"Invalid torch.memory_format encoding: {memory_format}")
        self.__dict__.update(dtype=dtype, layout=layout, requires_grad=requires_grad,
                             memory_format=memory_format, pin_memory=pin_memory)


class _Call:
    """Stands in for an allowed function or enum: callable, and a BUILD on it is refused."""

    __slots__ = ("_fn", "_name")
    _fn: Callable[..., Any]
    _name: str

    def __init__(self, name: str, fn: Callable[[Any], Any]) -> None:
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_fn", fn)

    def __call__(self, *args: Any) -> Any:
        return self._fn(*args)

    @property
    def __dict__(self) -> NoReturn:  # type: ignore[override]  # what BUILD writes into
        _refuse(f"a BUILD on the global(s) [{self._name!r}]")

    def __setattr__(self, name: str, value: Any) -> None:
        _refuse(f"a BUILD on the global(s) [{self._name!r}]")


def _size(values: Any = ()) -> tuple[int, ...]:
    out = tuple(values)
    if not all(isinstance(v, int) for v in out):
        raise TypeError("torch.Size(): an element is not an int")
    return out


def _enum(name: str, values: tuple[int, ...]) -> _Call:
    def make(value: Any) -> int:
        if not isinstance(value, int) or value not in values:
            raise ValueError(f"{value!r} is not a valid {name}")
        return int(value)

    return _Call(name, make)


def _layout(name: Any) -> str:
    if name not in TORCH_LAYOUTS:
        raise KeyError(name)
    return str(name)


def _plain(name: str) -> type:
    """The other DCP dataclasses (chunks, tensor and bytes entries, storage info): fields only."""
    return _Frozen(name, (_Record,), {"__module__": __name__, "__qualname__": name})


_FS = "torch.distributed.checkpoint.filesystem"
_PLANNER = "torch.distributed.checkpoint.planner"
_STANDINS: dict[tuple[str, str], Any] = {
    (_MD, "Metadata"): MetadataView,
    (_MD, "MetadataIndex"): MetadataIndex,
    (_MD, "TensorProperties"): TensorProperties,
    (_MD, "_MEM_FORMAT_ENCODING"): _enum("_MEM_FORMAT_ENCODING", (0, 1, 2)),
    **{(_MD, n): _plain(n) for n in ("ChunkStorageMetadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                      "StorageMeta")},
    (_FS, "_StorageInfo"): _plain("_StorageInfo"),
    (_FS, "_StoragePrefix"): _plain("_StoragePrefix"),
    (_PLANNER, "LoadItemType"): _enum("LoadItemType", (1, 2)),
    (_PLANNER, "WriteItemType"): _enum("WriteItemType", (1, 2, 3)),
    ("torch", "Size"): _Call("Size", _size),
    ("torch.serialization", "_get_layout"): _Call("_get_layout", _layout),
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "WindowsPath"): pathlib.WindowsPath,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "slice"): slice,
}
assert set(_STANDINS) == ALLOWED_NAMES


class _IndexUnpickler(pickle.Unpickler):
    """The restricted unpickler's allow-list, answered with stand-ins: no torch, and no code runs."""

    def find_class(self, module: str, name: str) -> Any:
        if "." not in name and (module, name) in ALLOWED_NAMES:
            return _STANDINS[(module, name)]
        if module == "torch" and "." not in name and name in TORCH_DTYPE_NAMES:
            return f"torch.{name}"
        _refuse(f"global {module}.{name}")


def read_bounded(path: Path) -> bytes:
    """The bytes of a ``.metadata`` file: bounded, never through a link or from a FIFO."""
    try:
        return read_small(path, limit=METADATA_BYTES, what="DCP metadata")
    except FileNotFoundError:
        raise CheckpointIncompleteError(
            f"{path} is missing: the tensor state of this checkpoint was never finished; "
            "resume from an earlier committed step"
        ) from None


# ---------------------------------------------------------------- the pickle's declared sizes, before unpickling

_UNTIL_NEWLINE = pickletools.UP_TO_NEWLINE
_COUNTED = {pickletools.TAKEN_FROM_ARGUMENT1: 1, pickletools.TAKEN_FROM_ARGUMENT4: 4,
            pickletools.TAKEN_FROM_ARGUMENT4U: 4, pickletools.TAKEN_FROM_ARGUMENT8U: 8}
# Opcodes a DCP metadata pickle never holds and that would allocate or call out: out-of-band buffers and
# bytearrays (the C unpickler allocates a bytearray8's declared length before reading it), persistent ids,
# extension codes.
_NEVER = frozenset({"BYTEARRAY8", "NEXT_BUFFER", "READONLY_BUFFER", "PERSID", "BINPERSID", "EXT1", "EXT2", "EXT4"})
_MEMO = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_SIGNED = frozenset(ord(op.code) for op in pickletools.opcodes
                    if op.arg is not None and op.arg.n == pickletools.TAKEN_FROM_ARGUMENT4)


def _arg_tables() -> tuple[bytes, bytes, dict[int, str]]:
    """Per opcode byte: how its argument is read (0 fixed, 1 counted, 2 newline-ended, 3 refused or
    unknown, 4 a memo index, 5 STOP), its width (fixed bytes, or the count's bytes), and its name."""
    kinds, widths, names = bytearray([3] * 256), bytearray(256), {}
    for op in pickletools.opcodes:
        code, n = ord(op.code), (0 if op.arg is None else op.arg.n)
        names[code] = op.name
        if op.name in _NEVER:
            continue
        if op.name == "STOP":
            kinds[code] = 5
        elif op.name in _MEMO:
            kinds[code], widths[code] = 4, max(n, 0)
        elif n == _UNTIL_NEWLINE:
            kinds[code], widths[code] = 2, 2 if op.name in ("GLOBAL", "INST") else 1
        elif n in _COUNTED:
            kinds[code], widths[code] = 1, _COUNTED[n]
        else:
            kinds[code], widths[code] = 0, n
    return bytes(kinds), bytes(widths), names


_KINDS, _WIDTHS, _NAMES = _arg_tables()


def scan_pickle(path: Path, data: bytes) -> None:
    """Refuse, before any unpickling, a pickle whose opcodes declare more than its bytes hold: a counted
    string longer than what is left, a memo index beyond the number of bytes (the C unpickler grows its
    memo array to twice the index and clears it: a 4-byte index asks for 32 GiB), or an opcode DCP never
    writes. One pass over the opcodes; the payloads are skipped, never copied."""
    pos, end, kinds, widths = 0, len(data), _KINDS, _WIDTHS
    while pos < end:
        code = data[pos]
        kind, width = kinds[code], widths[code]
        pos += 1
        if kind == 0:
            pos += width
        elif kind == 1:
            size = int.from_bytes(data[pos:pos + width], "little", signed=code in _SIGNED)
            pos += width + size
            if size < 0 or pos > end:
                _bad_pickle(path, f"{_NAMES[code]} at byte {pos - width - size - 1} declares {size} bytes, more "
                            f"than the file's {end}")
        elif kind == 4:
            index = data[pos:data.find(b"\n", pos)] if width == 0 else data[pos:pos + width]
            value = int(index) if width == 0 and index.isdigit() else int.from_bytes(index, "little")
            if (width == 0 and not index.isdigit()) or value > end:
                _bad_pickle(path, f"{_NAMES[code]} at byte {pos - 1} names memo index {index[:20]!r}, beyond "
                            f"its {end} bytes")
            pos += width or len(index) + 1
        elif kind == 2:
            for _ in range(width):
                nl = data.find(b"\n", pos)
                if nl < 0:
                    _bad_pickle(path, f"it ends inside {_NAMES[code]}")
                pos = nl + 1
        elif kind == 5:
            return
        else:
            _bad_pickle(path, f"opcode {_NAMES.get(code, hex(code))} at byte {pos - 1}, which DCP never writes")
    _bad_pickle(path, "pickle data was truncated")


def _bad_pickle(path: Path, why: str) -> NoReturn:
    raise CheckpointCorruptError(f"{path} is not a readable DCP metadata file: {why}")


def unreadable(path: Path, exc: BaseException) -> Exception:
    """The error for a ``.metadata`` that did not unpickle (``exc``): refused, or not readable."""
    if isinstance(exc, pickle.UnpicklingError) and refused(exc):
        return UnsafeCheckpointError(
            f"{path} refers to {exc}: the file was not written by DCP, or was tampered "
            "with; it could run code if unpickled, so ckptguard will not read it. "
            "Do not load this checkpoint; restore an earlier step or rewrite it."
        )
    if isinstance(exc, pickle.UnpicklingError):
        return CheckpointCorruptError(f"{path} is not a readable DCP metadata file: {exc}")
    return CheckpointCorruptError(f"{path} is not a readable DCP metadata file: {type(exc).__name__}: {exc}")


def read_dcp_index(state_dir: str | os.PathLike[str]) -> MetadataView:
    """DCP's ``.metadata`` of ``state_dir`` as stand-ins (see the module doc); raises what
    ``read_dcp_metadata`` raises for the same file."""
    state_dir = Path(state_dir)
    path = state_dir / DCP_METADATA
    data = read_bounded(path)
    scan_pickle(path, data)
    try:
        md = _IndexUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # RecursionError, garbage, a refused global: all one error each
        raise unreadable(path, exc) from None
    if not isinstance(md, MetadataView):
        raise CheckpointCorruptError(f"{path} holds a {type(md).__name__}, not DCP Metadata")
    confine(path, md)
    check_structure(path, md)
    return md


def confine(path: Path, md: Any) -> None:
    """Every data file ``md`` names must be a plain name inside ``path``'s directory."""
    tables = getattr(md, "state_dict_metadata", None), getattr(md, "storage_data", None)
    if not isinstance(tables[0], dict) or not isinstance(tables[1] or {}, dict):
        raise CheckpointCorruptError(f"{path} is not DCP metadata (its tables are not mappings)")
    for index, info in (md.storage_data or {}).items():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or not plain_name(rel):
            raise UnsafeCheckpointError(
                f"{path} names the data file {rel!r} for {getattr(index, 'fqn', index)!r}, which leaves "
                f"{path.parent} (absolute, '..', a subdirectory): DCP writes plain names there, so the "
                "file was crafted or damaged. Do not restore it; restore an earlier step."
            )


def plain_name(rel: str) -> bool:
    """True for a plain file name (what DCP writes in ``state/``): no directory part, no '..'."""
    return bool(rel) and rel not in (".", "..") and "/" not in rel and "\\" not in rel and "\0" not in rel



# ---------------------------------------------------------------- one check of the structure, for both readers

# Bytes per element of each dtype ``TORCH_DTYPE_NAMES`` holds (torch 2.13's ``dtype.itemsize``; a test
# compares the two): the sizes a ``.metadata`` declares are bounded without importing torch.
ITEMSIZE = {
    "bfloat16": 2, "bit": 1, "bits16": 2, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1, "bits8": 1, "bool": 1,
    "cdouble": 16, "cfloat": 8, "chalf": 4, "complex128": 16, "complex32": 4, "complex64": 8, "double": 8,
    "float": 4, "float16": 2, "float32": 4, "float4_e2m1fn_x2": 1, "float64": 8, "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1, "half": 2, "int": 4,
    "int1": 1, "int16": 2, "int2": 1, "int3": 1, "int32": 4, "int4": 1, "int5": 1, "int6": 1, "int64": 8,
    "int7": 1, "int8": 1, "long": 8, "qint32": 4, "qint8": 1, "quint2x4": 1, "quint4x2": 1, "quint8": 1,
    "short": 2, "uint1": 1, "uint16": 2, "uint2": 1, "uint3": 1, "uint32": 4, "uint4": 1, "uint5": 1, "uint6": 1,
    "uint64": 8, "uint7": 1, "uint8": 1,
}
_ABSENT = object()


class _Bad(Exception):
    """One structural fault of a ``.metadata``, said in words (raised as CheckpointCorruptError by the caller)."""

    def __init__(self, message: str, data_file: str | None = None) -> None:
        super().__init__(message)
        self.data_file = data_file


class ShortDataFile(CheckpointCorruptError):
    """The metadata stores bytes past the end of ``data_file`` as it is on disk (a truncated or swapped
    data file, or a crafted span): nothing is read or allocated from it."""

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
    if not isinstance(value, tuple) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                                for v in value):
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
        if len(offsets) != len(size) or len(sizes) != len(size) or any(
                o + n > d for o, n, d in zip(offsets, sizes, size, strict=True)):
            raise _Bad(f"{where}: its chunk at {list(offsets)} of {list(sizes)} leaves its size {list(size)}")
        if offsets in out:
            raise _Bad(f"{where} lists the chunk at {list(offsets)} twice")
        count = item
        for n in sizes:
            count *= n
        out[offsets] = count
    return out


def _entries(md: Any) -> dict[str, Any]:
    """The key table, every value a tensor or bytes entry."""
    table = md.state_dict_metadata
    for fqn, meta in table.items():
        if not isinstance(fqn, str) or _kind(meta) not in ("TensorStorageMetadata", "BytesStorageMetadata"):
            raise _Bad(f"key {fqn!r} holds a {_kind(meta)}, not a tensor or bytes entry")
    return dict(table)


def _stored(md: Any) -> list[tuple[str, tuple[int, ...] | None, str, int, int, bool]]:
    """Each storage entry as (fqn, chunk offsets, file, offset, length, transformed)."""
    out = []
    for index, info in (md.storage_data or {}).items():
        fqn = _field(index, "fqn", "a storage index")
        if _kind(index) != "MetadataIndex" or not isinstance(fqn, str) or _kind(info) != "_StorageInfo":
            raise _Bad(f"the storage table holds a {_kind(index)} (fqn {fqn!r}) -> {_kind(info)}, not a "
                       "MetadataIndex with a str fqn -> _StorageInfo")
        where = f"the storage entry of key {fqn!r}"
        raw = _field(index, "offset", where)
        offsets = None if raw is None else _ints(raw, f"{where}: its chunk offsets")
        start, length = _field(info, "offset", where), _field(info, "length", where)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (start, length)):
            raise _Bad(f"{where} spans {start!r}+{length!r}, not two non-negative ints")
        transformed = bool(getattr(info, "transform_descriptors", None))
        out.append((fqn, offsets, str(info.relative_path), start, length, transformed))
    return out


def check_structure(path: Path, md: Any, *, data_files: bool = True) -> None:
    """What restore relies on in a ``.metadata`` (``path``), checked before anything is read or allocated
    from it, the same for DCP's classes and for the stand-ins: every key a tensor or bytes entry, every
    tensor chunk inside its tensor and stored exactly once, every stored span a pair of non-negative
    ints, and no chunk declared larger than its stored bytes. ``data_files``: every span also inside its
    data file as it is on disk (the checks; restore's readers refuse a span past the end of its file
    when they reach it, with that file's own error, before reading or allocating from it).

    Both readers (``read_dcp_index`` for the operator commands, ``read_dcp_metadata`` for restore) call
    it, so no command calls a step good whose metadata restore refuses."""
    try:
        _check(path, md, data_files)
    except _Bad as exc:
        message = (f"{path}: {exc}: the metadata was crafted or damaged; nothing was allocated or read from it. "
                   "Restore an earlier step.")
        raise (CheckpointCorruptError(message) if exc.data_file is None else ShortDataFile(message, exc.data_file)
               ) from None


def _check(path: Path, md: Any, data_files: bool) -> None:
    table = _entries(md)
    chunks = {fqn: _chunks(fqn, meta) for fqn, meta in table.items() if _kind(meta) == "TensorStorageMetadata"}
    stored: dict[str, int] = {}
    seen: set[tuple[str, tuple[int, ...] | None]] = set()
    sizes: dict[str, int | None] = {}
    unbounded: set[str] = set()
    for fqn, offsets, rel, start, length, transformed in _stored(md):
        if fqn not in table or (fqn, offsets) in seen:
            raise _Bad(f"the storage table names key {fqn!r} at {offsets}, which is "
                       + ("stored twice" if fqn in table else "no key of the metadata"))
        seen.add((fqn, offsets))
        if rel not in sizes:
            sizes[rel] = _file_size(path.parent / rel) if data_files else None
        if sizes[rel] is not None and start + length > int(sizes[rel] or 0):
            raise _Bad(f"key {fqn!r} is stored at bytes {start}..{start + length} of {rel}, which holds "
                       f"{sizes[rel]} bytes", data_file=rel)
        if fqn not in chunks:
            continue
        if offsets not in chunks[fqn]:
            raise _Bad(f"the storage table names a chunk of key {fqn!r} at {offsets}, which the key does not have")
        declared = chunks[fqn][offsets]
        # DCP stores a chunk raw or through torch.save, never in fewer bytes; a transform (compression) may.
        if not transformed and declared > length:
            raise _Bad(f"key {fqn!r} at offset {list(offsets or ())} declares {declared} bytes stored in {length}")
        stored[fqn] = stored.get(fqn, 0) + declared
        if transformed:
            unbounded.add(fqn)
    for fqn, meta in table.items():
        _check_covered(fqn, meta, chunks.get(fqn), seen, None if fqn in unbounded else stored.get(fqn, 0))


def _check_covered(fqn: str, meta: Any, chunks: dict[tuple[int, ...], int] | None,
                   seen: set[tuple[str, tuple[int, ...] | None]], stored: int | None) -> None:
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
    """The size of a data file as it is on disk; None when it is absent or no plain file (the checks of
    the step's files report that, and the readers refuse it when they open it)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None
