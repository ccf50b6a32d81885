"""The bytes of one DCP item: a ``torch.save`` archive whose tensor record we stream.

Contract: ``item_frame(shape, dtype)`` returns the exact bytes ``torch.save`` writes
around a compact tensor of that shape and dtype (zip headers, ``data.pkl``, trailing
records and central directory), split at the one gap where the tensor's raw bytes go.
Frame bytes, then exactly ``numel * itemsize`` raw bytes in row-major order, then the
tail is a file that ``torch.load(weights_only=True)`` reads back bitwise; that is what
DCP's ``FileSystemReader`` does with every tensor item. The frame comes from torch's
own writer (``skip_data`` over a fake tensor), so zip64, alignment and the pickle match
what ``torch.save`` writes for that torch version. The gap's CRC32 field is 0, as with
``torch.serialization.set_crc32_options(False)``: ``torch.load`` does not check it, and
computing it would need the data before its own header.

``read_record(f)`` is the reverse: where in an item's archive the tensor record lies and
how the tensor is laid out over it, parsed by an unpickler that builds nothing but a
descriptor (no torch function is ever called from pickled content).
"""

from __future__ import annotations

import collections
import errno
import io
import os
import pickle
import pickletools
import sys
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ..errors import CheckpointCorruptError, StorageFormatError, UnsafeCheckpointError
from ._pool import io_error


@dataclass(frozen=True)
class Frame:
    """The archive around one tensor: ``head`` + raw bytes (``data_bytes``) + ``tail``."""

    head: bytes
    data_bytes: int
    tail: bytes

    @property
    def size(self) -> int:
        return len(self.head) + self.data_bytes + len(self.tail)


class _Recorder:
    """A write sink for torch's zip writer that keeps the bytes and the one skipped gap."""

    def __init__(self) -> None:
        self.pos = 0
        self.parts: list[tuple[int, bytes]] = []
        self.gaps: list[tuple[int, int]] = []

    def write(self, data: Any) -> int:
        data = bytes(data)
        self.parts.append((self.pos, data))
        self.pos += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        # skip_data makes torch's writer seek over each storage's bytes instead of writing them.
        if whence != os.SEEK_CUR:
            raise io.UnsupportedOperation("the frame recorder only skips forward")
        self.gaps.append((self.pos, offset))
        self.pos += offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        pass


_frame_lock = threading.Lock()
_fake_mode: Any = None
_frames: dict[tuple[tuple[int, ...], torch.dtype], Frame] = {}
_FRAME_CACHE_MAX = 4096


def item_frame(shape: tuple[int, ...], dtype: torch.dtype) -> Frame:
    """The ``torch.save`` bytes around a compact CPU tensor of ``shape`` and ``dtype``."""
    key = (tuple(int(s) for s in shape), dtype)
    with _frame_lock:
        frame = _frames.get(key)
        if frame is None:
            frame = _build_frame(*key)
            if len(_frames) >= _FRAME_CACHE_MAX:
                # bounded: shapes of one model repeat, a stream of new ones must not grow us
                _frames.clear()
            _frames[key] = frame
        return frame


def _build_frame(shape: tuple[int, ...], dtype: torch.dtype) -> Frame:
    global _fake_mode

    if _fake_mode is None:
        _fake_mode = FakeTensorMode()
    with _fake_mode:
        # A fake tensor has shape, dtype and a "cpu" location but no memory: the frame of
        # an 8 GiB tensor costs nothing to build.
        fake = torch.empty(shape, dtype=dtype)
    rec = _Recorder()
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        # torch needs only write(); its stub says IO[bytes]
        torch.save(fake, rec)  # type: ignore[arg-type]
    nbytes = fake.numel() * fake.element_size()
    if nbytes == 0 and not rec.gaps:
        rec.gaps.append((rec.pos, 0))  # torch's writer skips nothing for an empty storage
    if len(rec.gaps) != 1 or rec.gaps[0][1] != nbytes:
        raise StorageFormatError(
            f"torch.save left gaps {rec.gaps} for a {dtype} tensor of shape {shape}; expected one"
        )
    gap_at = rec.gaps[0][0]
    blob = bytearray(rec.pos - nbytes)
    for pos, data in rec.parts:
        at = pos if pos < gap_at else pos - nbytes
        blob[at : at + len(data)] = data
    return Frame(head=bytes(blob[:gap_at]), data_bytes=nbytes, tail=bytes(blob[gap_at:]))


# ---------------------------------------------------------------- reading an item


@dataclass(frozen=True)
class Record:
    """Where a saved tensor's bytes are inside its item, and their layout."""

    data_offset: int  # of the storage record, from the start of the item
    dtype: torch.dtype
    storage_offset: int  # in elements
    size: tuple[int, ...]
    stride: tuple[int, ...]
    conj: bool = False  # torch.save keeps a lazy conjugate/negation as a flag over the raw bytes
    neg: bool = False
    storage_numel: int | None = (
        None  # elements of the saved storage (None: not recorded, a guessed frame)
    )

    def logical(self, raw: torch.Tensor) -> torch.Tensor:
        """The saved tensor's values from a view of its raw bytes."""
        if self.conj:
            raw = raw.conj()
        if self.neg:
            raw = raw._neg_view()
        return raw


@dataclass(frozen=True)
class _StorageRef:
    key: str
    dtype: torch.dtype | None
    numel: int


class _StorageType:
    def __init__(self, dtype: torch.dtype | None) -> None:
        self.dtype = dtype


def _rebuild_v2(
    storage: _StorageRef,
    offset: int,
    size: Any,
    stride: Any,
    _rg: Any = None,
    _h: Any = None,
    meta: Any = None,
) -> tuple[Any, ...]:
    return storage, storage.dtype, offset, tuple(size), tuple(stride), dict(meta or {})


def _rebuild_v3(
    storage: _StorageRef,
    offset: int,
    size: Any,
    stride: Any,
    _rg: Any,
    _h: Any,
    dtype: Any,
    meta: Any = None,
) -> tuple[Any, ...]:
    return storage, dtype, offset, tuple(size), tuple(stride), dict(meta or {})


# The typed storage classes torch.save names for the dtypes that have one; newer dtypes
# go through UntypedStorage plus _rebuild_tensor_v3. A static map: touching the classes
# themselves raises TypedStorage deprecation warnings.
_LEGACY_STORAGES = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128,
}


class _DescriptorUnpickler(pickle.Unpickler):
    """Reads a tensor's ``data.pkl`` into a descriptor; any other global is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_v2
        if (module, name) == ("torch._utils", "_rebuild_tensor_v3"):
            return _rebuild_v3
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if (module, name) == ("torch.storage", "UntypedStorage"):
            return _StorageType(None)
        if module == "torch":
            obj = vars(torch).get(
                name
            )  # never getattr: torch's lazy __getattr__ would import a module first
            if isinstance(obj, torch.dtype):
                return obj
            if name in _LEGACY_STORAGES:
                return _StorageType(_LEGACY_STORAGES[name])
        raise UnsafeCheckpointError(
            f"global {module}.{name} in a tensor item's data.pkl: not a plain tensor; "
            f"ckptguard will not unpickle it"
        )

    def persistent_load(self, pid: Any) -> _StorageRef:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise CheckpointCorruptError(f"unexpected persistent id {pid!r} in a tensor item")
        _, stype, key, _location, numel = pid
        return _StorageRef(
            str(key), stype.dtype if isinstance(stype, _StorageType) else None, int(numel)
        )


# The opcodes torch.save's data.pkl of one tensor is made of (protocols 2 to 5). Anything else is
# refused before unpickling: BUILD, for one, would setattr on the allowed rebuild functions
# (their __defaults__) and change how every later item of the process is read.
_DATA_PKL_OPCODES = frozenset(
    {
        "PROTO",
        "FRAME",
        "STOP",
        "MARK",
        "GLOBAL",
        "STACK_GLOBAL",
        "BINPERSID",
        "REDUCE",
        "EMPTY_TUPLE",
        "TUPLE",
        "TUPLE1",
        "TUPLE2",
        "TUPLE3",
        "EMPTY_DICT",
        "SETITEM",
        "SETITEMS",
        "NONE",
        "NEWTRUE",
        "NEWFALSE",
        "BININT",
        "BININT1",
        "BININT2",
        "LONG1",
        "BINUNICODE",
        "SHORT_BINUNICODE",
        "BINPUT",
        "LONG_BINPUT",
        "BINGET",
        "LONG_BINGET",
        "MEMOIZE",
    }
)


def _check_opcodes(data: bytes, where: str) -> None:
    try:
        ops = {op.name for op, _, _ in pickletools.genops(data)}
    except Exception as exc:
        raise CheckpointCorruptError(
            f"{where}: data.pkl is not a pickle ({type(exc).__name__}: {exc})"
        ) from None
    extra = sorted(ops - _DATA_PKL_OPCODES)
    if extra:
        raise UnsafeCheckpointError(
            f"{where}: data.pkl uses pickle opcodes {extra}, which torch.save never writes "
            f"for a tensor; ckptguard will not unpickle it: the file was crafted or "
            f"damaged, restore an earlier step"
        )


def read_record(f: io.IOBase, where: str) -> Record:
    """Locate the tensor record in one item's archive; ``f`` is seekable over that item only."""
    try:
        # any seekable reader works
        zf = torch._C.PyTorchFileReader(f)  # type: ignore[call-overload]
        if zf.has_record("byteorder") and zf.get_record("byteorder").decode() != sys.byteorder:
            raise CheckpointCorruptError(
                f"{where}: written on a {zf.get_record('byteorder')!r}-endian machine"
            )
        pkl = zf.get_record("data.pkl")
        _check_opcodes(pkl, where)
        desc = _DescriptorUnpickler(io.BytesIO(pkl)).load()
        storage, dtype, offset, size, stride, meta = desc
        offset_in_item = zf.get_record_offset(f"data/{storage.key}")
    except (UnsafeCheckpointError, CheckpointCorruptError):
        raise
    except Exception as exc:
        failed = getattr(f, "error", None)
        if isinstance(failed, OSError):
            # the storage failed (errno, path, offset), not the item's format
            raise failed from None
        raise CheckpointCorruptError(
            f"{where}: not a readable tensor item ({type(exc).__name__}: {exc})"
        ) from None
    if not isinstance(dtype, torch.dtype):
        raise CheckpointCorruptError(f"{where}: tensor item without a dtype")
    unknown = set(meta) - {"conj", "neg"}
    if unknown:
        raise CheckpointCorruptError(
            f"{where}: tensor metadata {sorted(unknown)} is not understood by this reader"
        )
    return Record(
        data_offset=offset_in_item,
        dtype=dtype,
        storage_offset=offset,
        size=size,
        stride=stride,
        conj=bool(meta.get("conj")),
        neg=bool(meta.get("neg")),
        storage_numel=storage.numel,
    )


class FileSlice(io.RawIOBase):
    """A read-only, seekable window ``[start, start + length)`` of an open file descriptor."""

    def __init__(self, fd: int, start: int, length: int, path: str = "") -> None:
        super().__init__()
        self._fd, self._start, self._length, self._pos, self._path = fd, start, length, 0, path
        self.error: OSError | None = (
            None  # the first failed read: torch's zip reader hides it behind its own
        )

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buf: Any) -> int:
        n = max(0, min(len(buf), self._length - self._pos))
        try:
            data = os.pread(self._fd, n, self._start + self._pos)
        except OSError as exc:
            self.error = self.error or io_error(
                exc.errno or errno.EIO,
                "read of",
                self._path,
                offset=self._start + self._pos,
                requested=n,
                returned=-1,
            )
            raise self.error from exc
        buf[: len(data)] = data
        self._pos += len(data)
        return len(data)
