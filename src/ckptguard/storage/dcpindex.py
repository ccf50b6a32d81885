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
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from .._disk.layout import read_small
from ..errors import CheckpointCorruptError, CheckpointIncompleteError, UnsafeCheckpointError
from .base import DCP_METADATA
from .dcpstructure import check_structure

__all__ = ["METADATA_BYTES", "MetadataView", "plain_name", "read_dcp_index"]

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
        "bfloat16",
        "bit",
        "bits16",
        "bits1x8",
        "bits2x4",
        "bits4x2",
        "bits8",
        "bool",
        "cdouble",
        "cfloat",
        "chalf",
        "channels_last",
        "channels_last_3d",
        "complex128",
        "complex32",
        "complex64",
        "contiguous_format",
        "double",
        "float",
        "float16",
        "float32",
        "float4_e2m1fn_x2",
        "float64",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "half",
        "int",
        "int1",
        "int16",
        "int2",
        "int3",
        "int32",
        "int4",
        "int5",
        "int6",
        "int64",
        "int7",
        "int8",
        "legacy_contiguous_format",
        "long",
        "preserve_format",
        "qint32",
        "qint8",
        "quint2x4",
        "quint4x2",
        "quint8",
        "short",
        "uint1",
        "uint16",
        "uint2",
        "uint3",
        "uint32",
        "uint4",
        "uint5",
        "uint6",
        "uint64",
        "uint7",
        "uint8",
    ]
)
TORCH_LAYOUTS = frozenset(
    [
        "torch._mkldnn",
        "torch.jagged",
        "torch.sparse_bsc",
        "torch.sparse_bsr",
        "torch.sparse_coo",
        "torch.sparse_csc",
        "torch.sparse_csr",
        "torch.strided",
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
    """Stands in for ``MetadataIndex`` (a dict key: hashed and compared on fqn and offset, as DCP's
    is)."""

    offset: Any = None
    index: Any = None

    # frozen in DCP: hashable, unlike the others
    def __hash__(self) -> int:  # type: ignore[override]
        return hash((self.__dict__.get("fqn"), self.offset))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MetadataIndex) and (self.__dict__.get("fqn"), self.offset) == (
            other.__dict__.get("fqn"),
            other.offset,
        )


class TensorProperties(_Record):
    def __setstate__(self, state: Any) -> None:
        # DCP's own __setstate__: five values; an unknown memory-format encoding raises there too.
        dtype, layout, requires_grad, memory_format, pin_memory = state
        if memory_format not in (0, 1, 2):
            raise RuntimeError(f"Invalid torch.memory_format encoding: {memory_format}")
        self.__dict__.update(
            dtype=dtype,
            layout=layout,
            requires_grad=requires_grad,
            memory_format=memory_format,
            pin_memory=pin_memory,
        )


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
    **{
        (_MD, n): _plain(n)
        for n in (
            "ChunkStorageMetadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "StorageMeta",
        )
    },
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
    """The restricted unpickler's allow-list, answered with stand-ins: no torch, and no code
    runs."""

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


# ---------------------------------------------------------------- the pickle's declared sizes,
# before unpickling

_UNTIL_NEWLINE = pickletools.UP_TO_NEWLINE
_COUNTED = {
    pickletools.TAKEN_FROM_ARGUMENT1: 1,
    pickletools.TAKEN_FROM_ARGUMENT4: 4,
    pickletools.TAKEN_FROM_ARGUMENT4U: 4,
    pickletools.TAKEN_FROM_ARGUMENT8U: 8,
}
# Opcodes a DCP metadata pickle never holds and that would allocate or call out: out-of-band buffers
# and bytearrays (the C unpickler allocates a bytearray8's declared length before reading it),
# persistent ids, extension codes.
_NEVER = frozenset(
    {"BYTEARRAY8", "NEXT_BUFFER", "READONLY_BUFFER", "PERSID", "BINPERSID", "EXT1", "EXT2", "EXT4"}
)
_MEMO = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_SIGNED = frozenset(
    ord(op.code)
    for op in pickletools.opcodes
    if op.arg is not None and op.arg.n == pickletools.TAKEN_FROM_ARGUMENT4
)


def _arg_tables() -> tuple[bytes, bytes, dict[int, str]]:
    """Per opcode byte: how its argument is read (0 fixed, 1 counted, 2 newline-ended, 3 refused or
    unknown, 4 a memo index, 5 STOP), its width (fixed bytes, or the count's bytes), and its
    name."""
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
    """Refuse, before any unpickling, a pickle whose opcodes declare more than its bytes hold: a
    counted string longer than what is left, a memo index beyond the number of bytes (the C
    unpickler grows its memo array to twice the index and clears it: a 4-byte index asks for 32
    GiB), or an opcode DCP never writes. One pass over the opcodes; the payloads are skipped, never
    copied."""
    pos, end, kinds, widths = 0, len(data), _KINDS, _WIDTHS
    while pos < end:
        code = data[pos]
        kind, width = kinds[code], widths[code]
        pos += 1
        if kind == 0:
            pos += width
        elif kind == 1:
            size = int.from_bytes(data[pos : pos + width], "little", signed=code in _SIGNED)
            pos += width + size
            if size < 0 or pos > end:
                _bad_pickle(
                    path,
                    f"{_NAMES[code]} at byte {pos - width - size - 1} declares {size} bytes, more "
                    f"than the file's {end}",
                )
        elif kind == 4:
            index = data[pos : data.find(b"\n", pos)] if width == 0 else data[pos : pos + width]
            value = (
                int(index) if width == 0 and index.isdigit() else int.from_bytes(index, "little")
            )
            if (width == 0 and not index.isdigit()) or value > end:
                _bad_pickle(
                    path,
                    f"{_NAMES[code]} at byte {pos - 1} names memo index {index[:20]!r}, beyond "
                    f"its {end} bytes",
                )
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
            _bad_pickle(
                path,
                f"opcode {_NAMES.get(code, hex(code))} at byte {pos - 1}, which DCP never writes",
            )
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
    return CheckpointCorruptError(
        f"{path} is not a readable DCP metadata file: {type(exc).__name__}: {exc}"
    )


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
                f"{path} names the data file {rel!r} for {getattr(index, 'fqn', index)!r}, "
                f"which leaves {path.parent} (absolute, '..', a subdirectory): DCP writes "
                f"plain names there, so the file was crafted or damaged. Do not restore it; "
                f"restore an earlier step."
            )


def plain_name(rel: str) -> bool:
    """True for a plain file name (what DCP writes in ``state/``): no directory part, no '..'."""
    return (
        bool(rel)
        and rel not in (".", "..")
        and "/" not in rel
        and "\\" not in rel
        and "\0" not in rel
    )
