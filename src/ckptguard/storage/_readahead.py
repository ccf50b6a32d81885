"""A restore's read-ahead.

The disk kept busy while a restore checks and plans. A restore spends 0.3-0.6 s before its first byte of tensor
state is read (the manifest and extras, the state's own ``state_dict``, DCP's plan; an H100 machine, 6.2 GiB of
state: ``benchmarks/results/issue41_h100``); on a cold page cache the disk idled all that time and the restore
ended that much behind a plain read of its files. ``ReadAhead`` reads the data file the rank wrote meanwhile,
``streams`` threads each from the start of one equal part (16 MiB reads into a scratch buffer): where the
restore's read threads will each start their stretch (``_spans.stretches``: parts of about equal bytes), so
every one of them finds its first bytes cached. (``posix_fadvise(WILLNEED)`` would not copy the bytes, but the
kernel caps one call at its readahead window, 8 MiB of a 32 MiB request on this machine, and tells nothing of
when they arrived.) Contract: one regular file (a link, a FIFO or an absent file: nothing is read), at most
``limit`` bytes, never written; ``halt_reads_ahead`` (the reader, right before its threads start: they drop the
pages they read, and a read-ahead trailing them would read those again) stops it between two reads; ``close``
drops the file's pages (the restore leaves no page cache behind, as its reads do). A failed read is logged and
the restore reads the bytes itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
import time
from pathlib import Path

from ._pool import drop_cached

log = logging.getLogger("ckptguard")

_CHUNK = 16 << 20
_MAX = 2 << 30  # about 1 s of a fast disk: more than a restore spends before its read
_HUNG_S = 5.0  # a read of a hung filesystem is left to its daemon thread after this
_RUNNING: dict[str, ReadAhead] = {}  # real path -> the read-ahead of that file now
_RUNNING_LOCK = threading.Lock()


def default_limit() -> int:
    """2 GiB, or an eighth of the memory the system has free now if that is less (page cache, dropped at close)."""
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0
    return max(0, min(_MAX, free // 8))


def halt_reads_ahead(directory: str | os.PathLike[str]) -> None:
    """Halt every read-ahead of a file in ``directory`` (the read of that directory starts now)."""
    inside = os.path.realpath(directory) + os.sep
    with _RUNNING_LOCK:
        found = [r for path, r in _RUNNING.items() if path.startswith(inside)]
    for ahead in found:
        ahead.halt()


class ReadAhead:
    """One rank's read-ahead of one data file (``path``: checked to lie in the step directory by the caller)."""

    def __init__(
        self, path: Path, *, limit: int | None = None, streams: int = 4, drop: bool = True
    ) -> None:
        self.path = path
        self.drop = (
            drop  # StreamingConfig.drop_page_cache: False keeps the pages (the user asked for them)
        )
        self.limit = default_limit() if limit is None else max(0, limit)
        self.streams = max(1, streams)
        self.done = 0  # bytes read so far, all streams
        self._halt = threading.Event()
        self._threads: list[threading.Thread] = []
        self._key = os.path.realpath(path)

    def start(self) -> ReadAhead:
        """Registered, and the streams started by one thread of its own: the caller (the restore) waits for one
        thread's start, not for each stream's."""
        if self.limit > 0:
            with _RUNNING_LOCK:
                _RUNNING[self._key] = self
            self._threads.append(
                threading.Thread(target=self._launch, name="ckptguard-readahead", daemon=True)
            )
            self._threads[0].start()
        return self

    def _launch(self) -> None:
        fd = self._open()
        if fd is None:
            return
        size = os.fstat(fd).st_size
        os.close(fd)
        part = -(-size // self.streams)
        for i in range(self.streams):
            begin = i * part
            end = min(size, begin + part, begin + self.limit // self.streams)
            if end > begin and not self._halt.is_set():
                thread = threading.Thread(
                    target=self._run,
                    args=(begin, end),
                    name=f"ckptguard-readahead-{i}",
                    daemon=True,
                )
                with (
                    _RUNNING_LOCK
                ):  # halt() joins every thread listed: the launcher first, then these
                    self._threads.append(thread)
                thread.start()

    def _open(self) -> int | None:
        try:  # O_NONBLOCK: a FIFO planted in the step's place must not hold the thread in open()
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return None  # absent or a link: nothing to read ahead
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return None
        return fd

    def _run(self, begin: int, end: int) -> None:
        fd = self._open()
        if fd is None:
            return
        try:
            scratch = memoryview(bytearray(min(_CHUNK, end - begin)))
            pos = begin
            while pos < end and not self._halt.is_set():
                got = os.preadv(fd, [scratch[: min(_CHUNK, end - pos)]], pos)
                if got <= 0:
                    break
                pos += got
                with _RUNNING_LOCK:
                    self.done += got
        except OSError as exc:
            log.info(
                "ckptguard: read-ahead of %s stopped at offset %d (%s); the restore reads it itself",
                self.path,
                pos,
                exc,
            )
        finally:
            os.close(fd)

    def halt(self) -> None:
        """No read after the ones in flight (waited for, at most a few seconds)."""
        self._halt.set()
        deadline = time.monotonic() + _HUNG_S
        for thread in self._threads[:1]:  # the launcher: no stream starts after it ended
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        with _RUNNING_LOCK:
            streams = self._threads[1:]
        for thread in streams:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Halted, and the file's pages dropped from the page cache (after the restore's read, which drops its own)."""
        self.halt()
        with _RUNNING_LOCK:
            if _RUNNING.get(self._key) is self:
                del _RUNNING[self._key]
        if not self.drop or not self.done or any(t.is_alive() for t in self._threads):
            return
        fd = self._open()
        if fd is not None:
            with contextlib.suppress(OSError):  # only the cache's size is at stake
                drop_cached(
                    fd
                )  # the whole file: the kernel's own readahead went past what was read
            os.close(fd)
