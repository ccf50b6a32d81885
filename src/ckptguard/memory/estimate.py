"""Model size from safetensors headers, without loading a weight.

Contract: ``read_safetensors_header(path)`` reads at most ``8 + N`` bytes of a file (N: the
little-endian u64 header length, refused above 100 MB as safetensors itself does) and returns
its tensor entries. ``estimate_dir(dir)`` sums every ``*.safetensors`` file below ``dir``: the
bytes per dtype as stored, the total, and, if asked, the size expanded to one target dtype
(FP8 -> BF16 doubles, BF16 -> FP32 doubles). A header whose offsets do not match its file is
refused with the file named. This is the resident size of one copy of the weights, not a peak:
serializer copies and mapped source pages come on top (guide, 4).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckpointCorruptError, ConfigError

__all__ = ["DTYPE_BITS", "Estimate", "TensorEntry", "estimate_dir", "read_safetensors_header"]

MAX_HEADER = 100_000_000

# Bits per element; sub-byte types (F4, F6) are packed.
DTYPE_BITS = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
    "U64": 64,
    "F64": 64,
}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_safetensors_header(path: Path) -> tuple[list[TensorEntry], dict[str, str]]:
    """The tensor entries and ``__metadata__`` of one file; raises CheckpointCorruptError if
    malformed."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise CheckpointCorruptError(
                f"{path}: {len(head)} bytes, too short for a safetensors header"
            )
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > size:
            raise CheckpointCorruptError(
                f"{path}: header length {n} is past the file ({size} bytes) or over 100 MB"
            )
        raw = fh.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointCorruptError(f"{path}: header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointCorruptError(f"{path}: header is not a JSON object")
    meta = header.pop("__metadata__", {}) or {}
    entries: list[TensorEntry] = []
    end_max = 0
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = (
                info["dtype"],
                tuple(int(d) for d in info["shape"]),
                info["data_offsets"],
            )
        except (KeyError, TypeError, ValueError):
            raise CheckpointCorruptError(
                f"{path}: tensor {name!r} lacks dtype/shape/data_offsets"
            ) from None
        if dtype not in DTYPE_BITS:
            raise CheckpointCorruptError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
        if not (0 <= begin <= end):
            raise CheckpointCorruptError(f"{path}: tensor {name!r} has offsets {begin}..{end}")
        expected = math.ceil(math.prod(shape) * DTYPE_BITS[dtype] / 8)
        if end - begin != expected:
            raise CheckpointCorruptError(
                f"{path}: tensor {name!r} spans {end - begin} bytes but "
                f"{dtype}{list(shape)} needs {expected}"
            )
        end_max = max(end_max, end)
        entries.append(TensorEntry(name, dtype, shape, end - begin))
    if 8 + n + end_max != size:
        raise CheckpointCorruptError(
            f"{path}: data ends at {8 + n + end_max} but the file has {size} bytes"
        )
    return entries, {str(k): str(v) for k, v in meta.items()}


@dataclass
class Estimate:
    """Bytes of the weights in one directory (a per-copy figure, not a peak)."""

    files: int = 0
    tensors: int = 0
    bytes_by_dtype: dict[str, int] = field(default_factory=dict)
    elements_by_dtype: dict[str, int] = field(default_factory=dict)
    total_bytes: int = 0
    as_dtype: str | None = None
    expanded_bytes: int | None = None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def estimate_dir(model_dir: Path, *, as_dtype: str | None = None) -> Estimate:
    """Sum the headers of every ``*.safetensors`` file below ``model_dir``."""
    if as_dtype is not None and as_dtype not in DTYPE_BITS:
        raise ConfigError(
            f"as_dtype {as_dtype!r} is not a safetensors dtype; use one of {sorted(DTYPE_BITS)}"
        )
    if not model_dir.is_dir():
        raise ConfigError(f"{model_dir} is not a directory")
    files = sorted(model_dir.rglob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors files under {model_dir}")
    est = Estimate(as_dtype=as_dtype)
    for path in files:
        entries, _ = read_safetensors_header(path)
        est.files += 1
        for e in entries:
            est.tensors += 1
            est.bytes_by_dtype[e.dtype] = est.bytes_by_dtype.get(e.dtype, 0) + e.nbytes
            est.elements_by_dtype[e.dtype] = est.elements_by_dtype.get(e.dtype, 0) + e.numel
            est.total_bytes += e.nbytes
    if as_dtype is not None:
        numel = sum(est.elements_by_dtype.values())
        est.expanded_bytes = math.ceil(numel * DTYPE_BITS[as_dtype] / 8)
    return est
