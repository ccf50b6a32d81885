"""Bitwise digests of state, per item, so a save and a restore can be compared exactly.

A digest covers each leaf's path, type, dtype, shape and bytes (for a DTensor: the
local shard this rank holds). Two states with equal digests hold the same bytes in
the same structure; digests are compared only between the same rank and layout.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Mapping
from typing import Any

import torch
import xxhash

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


def update_with_tensor(h: xxhash.xxh3_64, t: torch.Tensor) -> None:
    local = t.to_local() if hasattr(t, "to_local") else t
    h.update(f"T{local.dtype}{tuple(local.shape)}".encode())
    flat = tensor_bytes_view(local)
    if flat.device.type == "cpu":
        h.update(flat.numpy().data)
    elif flat.device.type == "cuda":
        _update_from_cuda(h, flat)
    else:
        for start in range(0, flat.numel(), _CHUNK_BYTES):
            h.update(flat[start : start + _CHUNK_BYTES].cpu().numpy().data)


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
    flat.record_stream(stream)  # the caller's allocator must not reuse flat before the copies finish


def _update(h: xxhash.xxh3_64, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        update_with_tensor(h, obj)
    elif isinstance(obj, Mapping):
        h.update(b"{")
        for key in sorted(obj, key=repr):
            h.update(repr(key).encode() + b":")
            _update(h, obj[key])
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"[" if isinstance(obj, list) else b"(")
        for item in obj:
            _update(h, item)
            h.update(b",")
        h.update(b"]")
    else:
        h.update(f"{type(obj).__name__}:{obj!r};".encode())


def digest(obj: Any) -> str:
    """xxh3-64 hex digest of a nested structure of tensors and plain values."""
    h = xxhash.xxh3_64()
    _update(h, obj)
    return h.hexdigest()


def file_digest(path: str, *, chunk: int = 8 << 20) -> tuple[int, str]:
    """(size, xxh3-64 hex) of a file.

    A reader thread fills the next buffer while this thread hashes the current one
    (both release the GIL), so a cold read is limited by the disk, not by read + hash.
    """
    h = xxhash.xxh3_64()
    if os.path.getsize(path) <= chunk:
        with open(path, "rb") as f:
            data = f.read()
        h.update(data)
        return len(data), h.hexdigest()
    free: queue.Queue[bytearray] = queue.Queue()
    for _ in range(3):
        free.put(bytearray(chunk))
    full: queue.Queue[tuple[bytearray, int] | BaseException | None] = queue.Queue()

    def reader() -> None:
        try:
            with open(path, "rb", buffering=0) as f:
                while True:
                    buf = free.get()
                    n = f.readinto(buf)
                    if not n:
                        break
                    full.put((buf, n))
            full.put(None)
        except BaseException as exc:  # handed to the caller, never lost in the thread
            full.put(exc)

    thread = threading.Thread(target=reader, name="ckptguard-digest", daemon=True)
    thread.start()
    size = 0
    while (item := full.get()) is not None:
        if isinstance(item, BaseException):
            raise item
        buf, n = item
        h.update(memoryview(buf)[:n])
        size += n
        free.put(buf)
    thread.join()
    return size, h.hexdigest()
