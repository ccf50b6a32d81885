"""The checksum of a file, without torch: what the commit records and the operator tools compare.

Kept apart from ``digest`` (tensor digests, which import torch) so that the checks of a step
directory (``ckptguard list``, ``gc``, ``preflight``, ``adopt``) start in well under a second on a
busy node: ``import torch`` alone costs 1-2 s of CPU there.
"""

from __future__ import annotations

import os
import queue
import threading

import xxhash

__all__ = ["file_digest"]


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
