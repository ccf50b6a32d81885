"""Step fingerprints: what each training step consumed and produced, for the replay gates.

Contract: ``fingerprint`` turns one ``record_step`` call into the fields of a ``step`` proof
record: a digest of the sample ids (normalized, so a list and a tensor of the same ids hash
alike), a bitwise digest of the batch tensors (GPU tensors through overlapped pinned chunks),
and the exact values of ``loss``, ``grad_norm`` and every extra scalar. JSON keeps a float
exactly (its repr round-trips), so two records compare bitwise after reading them back.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import xxhash

from .._disk.digest import digest
from .._types import JsonObject
from .rng import capture as _capture_rng
from .scalars import Metrics, scalar

# ids kept per step (prove shows 4): a shift within a step (a lost micro-batch) is seen in them
_HEAD = 16


def _ids_array(ids: Any) -> np.ndarray | None:
    """Integer ids as one int64 array, or None when they are not integers."""
    if isinstance(ids, torch.Tensor):
        if ids.is_floating_point() or ids.is_complex():
            return None
        return ids.detach().reshape(-1).to("cpu", torch.int64).numpy()
    if isinstance(ids, np.ndarray):
        return ids.reshape(-1).astype(np.int64) if np.issubdtype(ids.dtype, np.integer) else None
    if isinstance(ids, range):
        return np.arange(ids.start, ids.stop, ids.step, dtype=np.int64)
    if isinstance(ids, (list, tuple)) and all(
        isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in ids
    ):
        return np.asarray(ids, dtype=np.int64).reshape(-1)
    return None


def ids_multiset(hashes: np.ndarray) -> str:
    """An order-free digest of a multiset of ids: the sum mod 2**64 of a bijective mix of each id.

    Sums add, so the union over ranks and steps is the sum of the records' digests: a resharded
    resume (ranks and batch boundaries changed) is compared with the killed run over the same
    samples (``ops/prove``). A repeated or a skipped id changes the sum."""
    z = hashes.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return f"{int(z.sum(dtype=np.uint64)):016x}"


def ids_fields(ids: Any) -> JsonObject:
    arr = _ids_array(ids)
    if arr is not None:
        h = xxhash.xxh3_64(b"ids:int64:")
        h.update(np.ascontiguousarray(arr).data)
        return {
            "sample_ids": h.hexdigest(),
            "samples": int(arr.size),
            "ids_head": [int(i) for i in arr[:_HEAD]],
            "ids_sum": ids_multiset(arr.view(np.uint64)),
        }
    if isinstance(ids, (list, tuple)) and all(isinstance(i, str) for i in ids):
        h = xxhash.xxh3_64(b"ids:str:")
        for i in ids:
            h.update(i.encode() + b"\0")
        hashed = np.array([xxhash.xxh3_64_intdigest(i.encode()) for i in ids], dtype=np.uint64)
        return {
            "sample_ids": h.hexdigest(),
            "samples": len(ids),
            "ids_head": list(ids[:_HEAD]),
            "ids_sum": ids_multiset(hashed),
        }
    return {"sample_ids": digest(ids)}


def fingerprint(
    sample_ids: Any, batch: Any, loss: Any, grad_norm: Any, extra: Mapping[str, Any]
) -> JsonObject:
    """The fields of a ``step`` record."""
    out: dict[str, Any] = {}
    if sample_ids is not None:
        out.update(ids_fields(sample_ids))
    if batch is not None:
        out["batch"] = digest(batch)
    if loss is not None:
        out["loss"] = scalar("loss", loss)
    if grad_norm is not None:
        out["grad_norm"] = scalar("grad_norm", grad_norm)
    if extra:
        out["extra"] = {str(k): scalar(str(k), v) for k, v in sorted(extra.items())}
    return out


NUMERIC_FIELDS = ("loss", "grad_norm")


def step_metrics(fields: Mapping[str, Any]) -> Metrics:
    """The health evidence of a step record's fields (``fingerprint``): its extras, its loss and
    grad_norm."""
    return {**fields.get("extra", {}), **{k: fields[k] for k in NUMERIC_FIELDS if k in fields}}


def numerics(record: Mapping[str, Any]) -> Metrics:
    """A step record's produced values by name: loss, grad_norm and extra.<name>."""
    out = {k: record[k] for k in NUMERIC_FIELDS if k in record}
    out.update({f"extra.{k}": v for k, v in (record.get("extra") or {}).items()})
    return out


def same_bits(a: Any, b: Any) -> bool:
    """Bitwise equality of two recorded values (NaN equals NaN; 0.0 differs from -0.0)."""
    if isinstance(a, float) and isinstance(b, float):
        return a.hex() == b.hex() or (math.isnan(a) and math.isnan(b))
    return type(a) is type(b) and a == b


def difference(a: Any, b: Any) -> float | None:
    """|a - b| for two numbers, None when they are not both finite numbers."""
    if (
        isinstance(a, bool)
        or isinstance(b, bool)
        or not isinstance(a, (int, float))
        or not isinstance(b, (int, float))
    ):
        return None
    d = abs(float(a) - float(b))
    return d if math.isfinite(d) else None


def rng_digests() -> dict[str, str]:
    """A digest of each of this process's global RNG streams (torch's CPU generator, CUDA's where
    initialized, Python's, NumPy's), read without drawing from them. Recorded with the first step
    after a save and after a restore, so ``prove`` can tell one rank's stream that the restore did
    not put back, or a draw made at another point than in the killed run (``iter(DataLoader)``
    after ``restore()``), from a generator outside the global streams."""
    return {
        name: digest(value) for name, value in _capture_rng().items() if name != "cuda" or value
    }
