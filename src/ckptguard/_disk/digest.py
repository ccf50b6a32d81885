"""Bitwise digests of state, per item, so a save and a restore can be compared exactly.

A digest covers each leaf's path, type, dtype, shape and bytes (for a DTensor: the
local shard this rank holds). Two states with equal digests hold the same bytes in
the same structure; digests are compared only between the same rank and layout.

The layout-free digest (``layout_free_partials``, ``combine_layout_free``) depends only on
each tensor's global shape, dtype and values: every rank sums its shard, the sums are
combined, and a save on N ranks compares with a restore on M.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import xxhash

from .filedigest import file_digest as file_digest  # re-exported: its callers predate filedigest

# Hash GPU tensors through a bounded host buffer instead of one full host copy.
_CHUNK_BYTES = 64 << 20


def tensor_bytes_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor on its own device."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


Feed = Callable[[torch.Tensor, int], None]
_FUSED_CHUNK = (
    8 << 20
)  # bytes xxh3 reads in this thread while the pool sums the previous ones layout-free


def update_with_tensor(h: xxhash.xxh3_64, t: torch.Tensor, feed: Feed | None = None) -> None:
    """Hash ``t``; ``feed(chunk, offset)`` (CPU tensors) sees the same bytes, chunk by chunk."""
    local = t.to_local() if hasattr(t, "to_local") else t
    h.update(f"T{local.dtype}{tuple(local.shape)}".encode())
    flat = tensor_bytes_view(local)
    if flat.device.type == "cpu" and feed is not None:
        # The feed sees each chunk one chunk ahead of xxh3: the pool's sums (slower than memory)
        # pull the bytes in from DRAM, and xxh3 then reads them from the shared L3 cache.
        arr = flat.numpy()
        starts = range(0, arr.size, _FUSED_CHUNK)
        feed(flat[:_FUSED_CHUNK], 0)
        for i, start in enumerate(starts):
            if i + 1 < len(starts):
                feed(flat[starts[i + 1] : starts[i + 1] + _FUSED_CHUNK], starts[i + 1])
            h.update(arr[start : start + _FUSED_CHUNK].data)
    elif flat.device.type == "cpu":
        h.update(flat.numpy().data)
    elif flat.device.type == "cuda":
        _update_from_cuda(h, flat)
    else:
        for start in range(0, flat.numel(), _CHUNK_BYTES):
            h.update(flat[start : start + _CHUNK_BYTES].cpu().numpy().data)


def release_host_cache() -> None:
    """Hand torch's caching host allocator's free pinned blocks back after a save's or a restore's
    digests (the digests of GPU tensors go through pinned chunks, ``_update_from_cuda``; freed, they
    stay cached otherwise: docs/practices.md, memory budget)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
        if empty is not None:
            empty()


def _update_from_cuda(h: xxhash.xxh3_64, flat: torch.Tensor) -> None:
    """Hash GPU bytes through two pinned chunks: the next chunk's D2H copy runs on a side
    stream while this thread hashes the current one (pageable .cpu() chunks ran at a
    third of the speed, and a full host copy would double the host peak)."""
    n = flat.numel()
    size = min(_CHUNK_BYTES, n)
    if size == 0:
        return
    bufs = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    stream = torch.cuda.Stream(device=flat.device)
    stream.wait_stream(torch.cuda.current_stream(flat.device))

    def issue(slot: int, start: int) -> tuple[torch.cuda.Event, int]:
        count = min(size, n - start)
        with torch.cuda.stream(stream):
            bufs[slot][:count].copy_(flat[start : start + count], non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return event, count

    starts = list(range(0, n, size))
    pending = issue(0, 0)
    for k in range(len(starts)):
        event, count = pending
        if k + 1 < len(starts):
            pending = issue((k + 1) % 2, starts[k + 1])
        event.synchronize()
        h.update(bufs[k % 2][:count].numpy().data)
    flat.record_stream(
        stream
    )  # the caller's allocator must not reuse flat before the copies finish


def update_digest(
    h: xxhash.xxh3_64,
    obj: Any,
    on_tensor: Callable[[torch.Tensor], Feed | None] | None = None,
    *,
    structure: bool = False,
) -> None:
    if isinstance(obj, torch.Tensor):
        if structure:
            update_tensor_header(h, obj)
        else:
            update_with_tensor(h, obj, on_tensor(obj) if on_tensor is not None else None)
    elif isinstance(obj, Mapping):
        h.update(b"{")
        for key in sorted(obj, key=repr):
            h.update(repr(key).encode() + b":")
            update_digest(h, obj[key], on_tensor, structure=structure)
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"[" if isinstance(obj, list) else b"(")
        for item in obj:
            update_digest(h, item, on_tensor, structure=structure)
            h.update(b",")
        h.update(b"]")
    else:
        h.update(f"{type(obj).__name__}:{obj!r};".encode())


def update_tensor_header(h: xxhash.xxh3_64, t: torch.Tensor) -> None:
    """What a structure digest takes of a tensor: its local dtype and shape, never its bytes."""
    local = t.to_local() if hasattr(t, "to_local") else t
    h.update(f"T{local.dtype}{tuple(local.shape)}".encode())


DIGEST_BYTES = "bytes"
DIGEST_STRUCTURE = "structure"
STRUCTURE_SEED = (
    b"ckptguard-structure|"  # a structure digest never equals a bytes digest of the same object
)


def structure_digest(obj: Any) -> str:
    """xxh3-64 of ``obj``'s structure: keys, containers, every non-tensor leaf, and each tensor's
    dtype and (local) shape, not its bytes. A tensor item's bytes are covered by its layout-free
    digest instead."""
    h = xxhash.xxh3_64()
    h.update(STRUCTURE_SEED)
    update_digest(h, obj, structure=True)
    return h.hexdigest()


def digest(obj: Any) -> str:
    """xxh3-64 hex digest of a nested structure of tensors and plain values."""
    h = xxhash.xxh3_64()
    update_digest(h, obj)
    return h.hexdigest()
