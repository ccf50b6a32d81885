"""A bounded pool of exact-size host buffers, and the system calls that move their bytes.

Contract: a ``BufferPool`` owns up to ``count`` buffers of exactly ``size`` bytes (made as ``get``
needs them), each its own anonymous mapping (page-aligned, no allocator rounding, no cache that
outlives us), page locked with ``cudaHostRegister`` when CUDA is available and pinning is asked for.
``close()`` unregisters and unmaps every buffer: after it, the pool holds no host memory. A buffer
has one release, run once on whichever path comes first: ``release()``, its garbage collection (a
pool dropped without ``close()``) or the interpreter's exit (``weakref.finalize``), always
``cudaHostUnregister`` before ``munmap``: a range unmapped while still registered stays registered
in the driver, and every later buffer the kernel maps there fails ``cudaHostRegister`` with error
712. A refused registration raises ``PinError`` (an ``OSError`` naming the CUDA error); a pool given
``pin=True`` then falls back to pageable buffers, logged: pinning only speeds the copies up, and a
read or write must never fail, let alone look like a damaged checkpoint, for it. ``get`` waits at
most a timeout for a free buffer and raises ``StorageStallError`` (a ``TimeoutError``) naming what
it waited for.

``write_all`` and ``read_into`` turn every failed or short system call into an ``OSError`` with
``errno``, ``filename`` and the attributes the commit protocol reports: ``offset`` (file position
of the failing call), ``requested_bytes`` and ``returned_bytes`` (what the call returned: a short
count, 0, or -1 for an errno). ``_failedcall`` builds those, ``PinError`` and ``StorageStallError``.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import queue
import stat
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ._failedcall import PinError, call_failed, io_error, moved_nothing, pin_refused, stalled

__all__ = [
    "Buffer",
    "BufferPool",
    "IOStats",
    "PinError",
    "ReadAhead",
    "default_limit",
    "drop_cached",
    "halt_reads_ahead",
    "io_error",
    "read_into",
    "read_scattered",
    "start_writeback",
    "write_all",
]

# The system calls, looked up here at call time: a seam for tests that inject short writes.
_write = os.write
_preadv = os.preadv
log = logging.getLogger("ckptguard")


def _cudart() -> Any:
    """The CUDA runtime (a seam: tests count registrations with a fake)."""
    return torch.cuda.cudart()


@dataclass
class IOStats:
    """What one ``write`` or ``read`` of this rank did (per rank; bytes as int, times in s)."""

    bytes: int = 0
    """Bytes written to or read from data files (frames included)."""
    seconds: float = 0.0
    """Wall time of the whole call, collectives included."""
    io_seconds: float = 0.0
    """Time inside write/pread/fsync calls (the I/O thread)."""
    hash_seconds: float = 0.0
    """Time spent computing xxh3 (its own thread, overlapped with the writes)."""
    stall_seconds: float = 0.0
    """Time the caller's thread waited for a free buffer (the pipeline was I/O bound)."""
    short_writes: int = 0
    """Writes that returned fewer bytes than asked and were continued."""
    pool_bytes: int = 0
    """Host bytes the pool held while the call ran; it is released before the call returns."""
    files: int = 0
    """Data files written or opened."""


def write_all(fd: int, view: memoryview, path: str, offset: int) -> int:
    """Write all of ``view`` at the current position (``offset``); returns the short-write count."""
    done, short = 0, 0
    while done < len(view):
        try:
            n = _write(fd, view[done:])
        except OSError as exc:
            raise call_failed(
                exc, "write to", path, offset=offset + done, requested=len(view) - done
            ) from exc
        if n == 0:
            # A zero-byte write would loop forever; the device accepts nothing more.
            raise moved_nothing(
                "write to",
                path,
                offset=offset + done,
                requested=len(view) - done,
                cause="the write returned 0 bytes",
            )
        if n < len(view) - done:
            short += 1  # a short write (signal, quota edge, 2 GiB cap) continues where it stopped
        done += n
    return short


def read_into(fd: int, view: memoryview, path: str, offset: int) -> None:
    """Fill ``view`` from file position ``offset``; a file that ends early is an error."""
    done = 0
    while done < len(view):
        try:
            n = _preadv(fd, [view[done:]], offset + done)
        except OSError as exc:
            raise call_failed(
                exc, "read of", path, offset=offset + done, requested=len(view) - done
            ) from exc
        if n == 0:
            raise moved_nothing("read of", path, offset=offset + done, requested=len(view) - done)
        done += n


def read_scattered(fd: int, views: list[memoryview], path: str, offset: int) -> None:
    """Fill ``views`` in order from the contiguous file range starting at ``offset`` (preadv)."""
    views = [v for v in views if len(v)]
    pos, i = offset, 0
    while i < len(views):
        try:
            n = _preadv(fd, views[i:], pos)
        except OSError as exc:
            left = sum(len(v) for v in views[i:])
            raise call_failed(exc, "read of", path, offset=pos, requested=left) from exc
        if n == 0:
            left = sum(len(v) for v in views[i:])
            raise moved_nothing("read of", path, offset=pos, requested=left)
        pos += n
        # A short read continues inside the view it stopped in.
        while i < len(views) and n >= len(views[i]):
            n -= len(views[i])
            i += 1
        if n:
            views[i] = views[i][n:]


def _load_sync_file_range() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range() if sys.platform.startswith("linux") else None
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing these dirty pages to the device now, not waiting (Linux ``sync_file_range``).

    Without it the disk idles until the next fdatasync while the page cache fills, and a save
    runs below the disk's speed. Only a hint: a refusal (a filesystem without it) changes nothing,
    and durability still comes from the final fsync."""
    if _sync_file_range is not None and length > 0:
        _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


def drop_cached(fd: int, offset: int = 0, length: int = 0) -> None:
    """Ask the kernel to drop these (already synced) pages from the page cache."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


# ---------------------------------------------------------------- a restore's read-ahead
# The disk kept busy while a restore checks and plans. A restore spends 0.3-0.6 s before its
# first byte of tensor state is read (manifest and extras, the state's ``state_dict``, DCP's
# plan; an H100 machine, 6.2 GiB of state: ``benchmarks/results/issue41_h100``); on a cold page
# cache the disk idled all that time, the restore ending that much behind a plain read of its
# files. ``ReadAhead`` reads the rank's data file meanwhile, ``streams`` threads each from the
# start of one equal part (16 MiB reads into a scratch buffer): where the restore's read threads
# each start their stretch (``_spans.stretches``: parts of about equal bytes), so each finds its
# first bytes cached. (``posix_fadvise(WILLNEED)`` would copy no bytes, but the kernel caps one
# call at its readahead window, 8 MiB of a 32 MiB request here, and tells nothing of when they
# arrived.) Contract: one regular file (a link, a FIFO or an absent file: nothing read), at most
# ``limit`` bytes, never written; ``halt_reads_ahead`` (the reader, right before its threads
# start: they drop the pages they read, a read-ahead trailing them would read them again) stops
# it between two reads; ``close`` drops the file's pages (the restore leaves no page cache behind,
# as its reads do). A failed read is logged and the restore reads the bytes itself.

_CHUNK = 16 << 20
_MAX = 2 << 30  # about 1 s of a fast disk: more than a restore spends before its read
_HUNG_S = 5.0  # a read of a hung filesystem is left to its daemon thread after this
_RUNNING: dict[str, ReadAhead] = {}  # real path -> the read-ahead of that file now
_RUNNING_LOCK = threading.Lock()


def default_limit() -> int:
    """2 GiB, or an eighth of the memory the system has free now if that is less (page cache,
    dropped at close)."""
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
    """One rank's read-ahead of one data file (``path``: in the step directory, caller-checked)."""

    def __init__(
        self, path: Path, *, limit: int | None = None, streams: int = 4, drop: bool = True
    ) -> None:
        self.path = path
        # StreamingConfig.drop_page_cache: False keeps the pages (the user asked for them).
        self.drop = drop
        self.limit = default_limit() if limit is None else max(0, limit)
        self.streams = max(1, streams)
        self.done = 0  # bytes read so far, all streams
        self._halt = threading.Event()
        self._threads: list[threading.Thread] = []
        self._key = os.path.realpath(path)

    def start(self) -> ReadAhead:
        """Registered, and the streams started by one thread of its own: the caller (the restore)
        waits for one thread's start, not for each stream's."""
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
                # halt() joins every thread listed: the launcher first, then these.
                with _RUNNING_LOCK:
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
                "ckptguard: read-ahead of %s stopped at offset %d (%s); "
                "the restore reads it itself",
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
        """Halted, and the file's pages dropped from the page cache (after the restore's read, which
        drops its own)."""
        self.halt()
        with _RUNNING_LOCK:
            if _RUNNING.get(self._key) is self:
                del _RUNNING[self._key]
        if not self.drop or not self.done or any(t.is_alive() for t in self._threads):
            return
        fd = self._open()
        if fd is not None:
            # The whole file: the kernel's own readahead went past what was read. A refusal is
            # ignored: only the cache's size is at stake.
            with contextlib.suppress(OSError):
                drop_cached(fd)
            os.close(fd)


class Buffer:
    """One exact-size host buffer: a uint8 tensor and a memoryview over the same bytes."""

    def __init__(self, size: int, pin: bool) -> None:
        self.size = size
        # Pages faulted in by the kernel first (MAP_POPULATE), not inside cudaHostRegister:
        # registering faulted pages holds the driver 4x shorter, and a training thread's CUDA calls
        # wait on it (measured on an H100: 6.5 GiB pinned beside a loop cost it 1.43 s unpopulated,
        # 0.19 s populated in 16 MiB pieces). (2 MiB pages populated with MADV_POPULATE_WRITE
        # instead: the loop beside it ran slower, 5.9% against 2.2% at saves every 45 steps,
        # benchmarks/results/issue41_h100.)
        populate = getattr(mmap, "MAP_POPULATE", 0) if pin else 0
        self._map: mmap.mmap | None = mmap.mmap(
            -1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate
        )
        self.view = memoryview(self._map)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8, count=size)
        # Shared with the finalizer, which may run after this object is gone.
        self._registered = [False]
        self._unpin = weakref.finalize(self, _unpin, self.tensor.data_ptr(), self._registered)
        if pin:
            rc = int(_cudart().cudaHostRegister(self.tensor.data_ptr(), size, 0))
            if rc != 0:
                self.release()
                raise pin_refused(rc, size)
            self._registered[0] = True

    @property
    def pinned(self) -> bool:
        return self._registered[0]

    def release(self) -> None:
        """Unregister now and unmap, once: later calls, the collection, the exit do nothing more."""
        if self._map is None:
            return
        mapping, self._map = self._map, None
        shared = _views_beyond(self.tensor)
        del self.tensor
        self.view.release()
        self._unpin()
        # munmap: the pages go back to the system now, not at some later GC. torch.frombuffer holds
        # no buffer export, so close() would unmap under a slot still in use (measured: a segfault
        # on its next write); such a slot keeps the mapping, which goes with it (frombuffer's
        # reference). A memoryview slice still alive (a failed read's traceback) refuses
        # (BufferError): the same.
        if not shared:
            with contextlib.suppress(BufferError):
                mapping.close()


def _views_beyond(tensor: torch.Tensor) -> bool:
    """Another tensor shares ``tensor``'s storage (a slot, a staged copy's view)."""
    try:
        # The storage object made here counts once, ``tensor`` once.
        return int(torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)) > 2
    except (AttributeError, RuntimeError):
        return True  # unknown: leave the unmapping to the last reference


def _unpin(address: int, registered: list[bool]) -> None:
    """A buffer's one unregistration, before its pages can go: by ``release()``, its collection (the
    mapping is unmapped after this, when the buffer's references are cleared) or the interpreter's
    exit."""
    if registered[0]:
        registered[0] = False
        # At the interpreter's exit CUDA may already be torn down.
        with contextlib.suppress(Exception):
            _cudart().cudaHostUnregister(address)


class BufferPool:
    """At most ``count`` buffers of ``size`` bytes; ``get`` blocks until one is free.

    The first buffer is made at construction (a pool that cannot allocate fails there); the others
    when a ``get`` finds none free: pinning a buffer holds the driver 20-45 ms (an H100 machine, 32
    MiB), so made up front, a restore's or save's first byte waited for all of them (0.18-0.36 s for
    eight); made on demand, the first read or write runs while the next buffer is pinned."""

    def __init__(self, *, count: int, size: int, pin: bool, timeout_s: float) -> None:
        self.size = size
        self.count = count
        self.timeout_s = timeout_s
        self._pin = pin
        self._lock = threading.Lock()
        self._closed = False
        self._all: list[Buffer] = []
        self._free: queue.Queue[Buffer] = queue.Queue()
        try:
            self._free.put(self._add())
        except BaseException:
            self.close()
            raise

    def _add(self) -> Buffer:
        """One more buffer (lock held, or none runs yet); pageable from the first pin refusal on."""
        buf = self._buffer(self.size, self._pin)
        self._pin = buf.pinned
        self._all.append(buf)
        return buf

    @staticmethod
    def _buffer(size: int, pin: bool) -> Buffer:
        try:
            return Buffer(size, pin)
        except PinError as exc:
            log.warning(
                "ckptguard: %s; the I/O buffers stay pageable (correct, copies slower)", exc
            )
            return Buffer(size, False)

    @property
    def allocated_bytes(self) -> int:
        return sum(b.size for b in self._all)

    def get(self, what: str) -> Buffer:
        if self._closed:  # a released buffer handed out would fail later as "released memoryview"
            raise RuntimeError(
                f"the I/O buffer pool is closed (while {what}): a ckptguard bug, report it"
            )
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            if not self._closed and len(self._all) < self.count:
                try:
                    return self._add()
                except (MemoryError, OSError) as exc:
                    # No memory for one more: go on with those made.
                    self.count = len(self._all)
                    log.warning(
                        "ckptguard: one more %d B I/O buffer could not be made (%s) while %s; "
                        "going on with the %d made",
                        self.size,
                        exc,
                        what,
                        self.count,
                    )
        try:
            return self._free.get(timeout=self.timeout_s)
        except queue.Empty:
            raise stalled(self.timeout_s, what) from None

    def put(self, buf: Buffer) -> None:
        self._free.put(buf)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            bufs, self._all = self._all, []
        for buf in bufs:
            buf.release()

    def __enter__(self) -> BufferPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
