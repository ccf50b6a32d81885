"""The checksum of a file, without torch: what the commit records and the operator tools compare.

Kept apart from ``digest`` (tensor digests, which import torch) so that the checks of a step
directory (``ckptguard list``, ``gc``, ``preflight``, ``adopt``) start in well under a second on a
busy node: ``import torch`` alone costs 1-2 s of CPU there.
"""

from __future__ import annotations

import os
import queue
import stat
import threading

import xxhash

from ..errors import UnsafeCheckpointError

__all__ = ["file_digest"]


def file_digest(path: str, *, chunk: int = 8 << 20) -> tuple[int, str]:
    """(size, xxh3-64 hex) of a file.

    A reader thread fills the next buffer while this thread hashes the current one
    (both release the GIL), so a cold read is limited by the disk, not by read + hash.
    """
    h = xxhash.xxh3_64()
    # O_NONBLOCK: a FIFO planted where a file of the step belongs is refused here, never waited on
    # (on a regular file the flag changes nothing).
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = (
                "a FIFO"
                if stat.S_ISFIFO(mode)
                else "a directory"
                if stat.S_ISDIR(mode)
                else "a device"
            )
            raise UnsafeCheckpointError(
                f"{path} is not a regular file ({kind}); ckptguard hashes only regular files: "
                f"replace it with the real file or remove it"
            )
        if os.fstat(fd).st_size <= chunk:
            with open(fd, "rb", closefd=False) as f:
                data = f.read()
            h.update(data)
            return len(data), h.hexdigest()
        reading = os.dup(
            fd
        )  # the reader thread reads the file checked above, not whatever the path names now
    finally:
        os.close(fd)
    free: queue.Queue[bytearray] = queue.Queue()
    for _ in range(3):
        free.put(bytearray(chunk))
    full: queue.Queue[tuple[bytearray, int] | BaseException | None] = queue.Queue()

    def reader() -> None:
        try:
            with open(reading, "rb", buffering=0) as f:
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
