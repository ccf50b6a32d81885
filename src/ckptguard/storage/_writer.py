"""One rank's DCP data file, streamed: tensor bytes -> pool buffers -> xxh3 and write, in order.

Contract: ``FileStreamer`` appends byte strings and tensors to one file. A tensor's exact
bytes (row-major, only its own elements, never the rest of its storage) reach the file
in pieces no larger than a pool buffer: a GPU tensor by asynchronous copies into pinned
buffers on a side stream, a non-contiguous one through a contiguous temporary of at most
one buffer, a large contiguous CPU tensor straight from its own memory. One thread
writes, one thread hashes, both in file order, so copies, checksums and writes overlap
and the xxh3 of the file comes out of the stream. ``finish`` fsyncs, optionally drops
the file's pages from the page cache, and returns (size, xxh3); the first error of any
stage is raised to the caller (an ``OSError`` with offset and byte counts, see
``_fastio_pool``), never lost in a thread.
"""

from __future__ import annotations

import contextlib
import errno as _errno
import os
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
import xxhash

from ..errors import StorageStallError
from ._pool import Buffer, BufferPool, IOStats, drop_cached, io_error, start_writeback, write_all


def tensor_pieces(t: torch.Tensor, limit: int) -> Iterator[torch.Tensor]:
    """Views of ``t`` in row-major order: contiguous ones of any size, others of at most ``limit``
    bytes."""
    if t.numel() == 0:
        return
    if t.is_contiguous() or t.dim() == 0:
        yield t
        return
    row = t[0].numel() * t.element_size()
    if row <= limit:
        step = max(1, limit // row)
        for start in range(0, t.shape[0], step):
            yield t[start : start + step]
        return
    for i in range(t.shape[0]):
        yield from tensor_pieces(t[i], limit)


def exact(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose elements are saved: local shard, no autograd, no lazy conj/neg bit."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    t = t.detach()
    # A lazy conjugate or negation shares memory with its source; its raw bytes are the
    # source's, so they would be saved unconjugated.
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t


class _Chunk:
    """A run of file bytes: from a pool buffer (returned after use) or a caller's CPU tensor."""

    __slots__ = ("buffer", "event", "keep", "pending", "view")

    def __init__(
        self, view: memoryview, buffer: Buffer | None, event: Any, keep: Any = None
    ) -> None:
        self.view, self.buffer, self.event, self.keep = view, buffer, event, keep
        self.pending = 2  # the writer and the hasher

    def ready(self) -> None:
        if self.event is not None:
            self.event.synchronize()  # the D2H copy into this buffer has landed


class FileStreamer:
    """Streams bytes and tensors into ``path`` through ``pool``; use as a context manager."""

    def __init__(
        self,
        path: str,
        pool: BufferPool,
        stats: IOStats,
        *,
        writeback_bytes: int | None,
        drop_cache: bool,
    ) -> None:
        self.path = path
        self.position = 0  # file offset of the next byte handed to us
        self._pool, self._stats = pool, stats
        self._writeback, self._drop = writeback_bytes, drop_cache
        self._hash = xxhash.xxh3_64()
        self._cur: Buffer | None = None
        self._fill = 0
        self._cur_event_needed = False
        self._stream: Any = None
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._written = 0
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        self._wq: queue.Queue[_Chunk | None] = queue.Queue()
        self._hq: queue.Queue[_Chunk | None] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._write_loop, name="ckptguard-write", daemon=True),
            threading.Thread(target=self._hash_loop, name="ckptguard-hash", daemon=True),
        ]
        for th in self._threads:
            th.start()

    # ------------------------------------------------------------ caller side

    def add_bytes(self, data: Any) -> None:
        mv = memoryview(data).cast("B")
        while len(mv):
            buf = self._buffer()
            n = min(len(mv), buf.size - self._fill)
            buf.view[self._fill : self._fill + n] = mv[:n]
            self._advance(n)
            mv = mv[n:]

    def add_tensor(self, t: torch.Tensor) -> None:
        t = exact(t)
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            return
        if t.device.type == "cpu" and t.is_contiguous() and nbytes >= self._pool.size // 2:
            self._add_cpu_in_place(t, nbytes)
            return
        on_cuda = t.device.type == "cuda"
        if on_cuda and self._stream is None:
            self._stream = torch.cuda.Stream(device=t.device)
            # The side stream must see every kernel that produced the tensors.
            self._stream.wait_stream(torch.cuda.current_stream(t.device))
        ctx = torch.cuda.stream(self._stream) if on_cuda else contextlib.nullcontext()
        with ctx:
            for piece in tensor_pieces(t, self._pool.size):
                # Non-contiguous pieces are at most one buffer, so the temporary is bounded.
                flat = piece.contiguous().reshape(-1).view(torch.uint8)
                self._copy_flat(flat, on_cuda)

    def finish(self) -> tuple[int, str]:
        """Flush, wait for both threads, fsync, drop the cache if asked; (size, xxh3)."""
        self._flush()
        self._stop()
        self._raise_if_failed()
        if self._written != self.position:
            raise OSError(
                _errno.EIO, f"wrote {self._written} of {self.position} B to {self.path}", self.path
            )
        t0 = time.perf_counter()
        try:
            os.fsync(self._fd)
        except OSError as exc:
            raise io_error(
                exc.errno or _errno.EIO,
                "fsync of",
                self.path,
                offset=self.position,
                requested=0,
                returned=-1,
            ) from exc
        if self._drop:
            drop_cached(self._fd)
        self._stats.io_seconds += time.perf_counter() - t0
        self._close_fd()
        return self.position, self._hash.hexdigest()

    def __enter__(self) -> FileStreamer:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is not None:
            self._flush_quietly()
            self._stop()
        self._close_fd()

    # ------------------------------------------------------------ packing

    def _buffer(self) -> Buffer:
        self._raise_if_failed()
        if self._cur is None:
            t0 = time.perf_counter()
            self._cur = self._pool.get(f"writing {self.path} at offset {self.position}")
            self._stats.stall_seconds += time.perf_counter() - t0
            self._fill = 0
        return self._cur

    def _advance(self, n: int) -> None:
        self._fill += n
        self.position += n
        if self._cur is not None and self._fill == self._cur.size:
            self._flush()

    def _copy_flat(self, flat: torch.Tensor, on_cuda: bool) -> None:
        start = 0
        while start < flat.numel():
            buf = self._buffer()
            n = min(flat.numel() - start, buf.size - self._fill)
            buf.tensor[self._fill : self._fill + n].copy_(
                flat[start : start + n], non_blocking=on_cuda
            )
            self._cur_event_needed |= on_cuda
            start += n
            self._advance(n)

    def _add_cpu_in_place(self, t: torch.Tensor, nbytes: int) -> None:
        # Written from the tensor's own memory: a copy would only cost bandwidth here.
        self._flush()
        flat = t.reshape(-1).view(torch.uint8)
        # numpy's stub: buffer only on 3.12+
        mv = memoryview(flat.numpy())  # type: ignore[arg-type]
        for start in range(0, nbytes, self._pool.size):
            self._raise_if_failed()
            self._emit(_Chunk(mv[start : start + self._pool.size], None, None, keep=flat))
        self.position += nbytes

    def _flush(self) -> None:
        if self._cur is None:
            return
        event = None
        if self._cur_event_needed:
            event = torch.cuda.Event()
            event.record(self._stream)
        buf, n = self._cur, self._fill
        self._cur, self._fill, self._cur_event_needed = None, 0, False
        if n == 0:
            self._pool.put(buf)
            return
        self._emit(_Chunk(buf.view[:n], buf, event))

    def _flush_quietly(self) -> None:
        try:
            self._flush()
        except Exception:
            if self._cur is not None:
                self._pool.put(self._cur)
                self._cur = None

    def _emit(self, chunk: _Chunk) -> None:
        self._wq.put(chunk)
        self._hq.put(chunk)

    def _stop(self) -> None:
        self._wq.put(None)
        self._hq.put(None)
        for th in self._threads:
            th.join(timeout=self._pool.timeout_s)
            if th.is_alive():
                raise StorageStallError(
                    _errno.ETIMEDOUT,
                    f"the {th.name} thread did not finish {self.path} within "
                    f"{self._pool.timeout_s} s",
                )

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _close_fd(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    # ------------------------------------------------------------ threads

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = exc

    def _done(self, chunk: _Chunk) -> None:
        with self._lock:
            chunk.pending -= 1
            last = chunk.pending == 0
        if last:
            chunk.keep = None
            if chunk.buffer is not None:
                self._pool.put(chunk.buffer)

    def _write_loop(self) -> None:
        synced = 0
        while (chunk := self._wq.get()) is not None:
            try:
                if self._error is None:  # after a failure, only return the buffers
                    chunk.ready()
                    t0 = time.perf_counter()
                    self._stats.short_writes += write_all(
                        self._fd, chunk.view, self.path, self._written
                    )
                    start_writeback(self._fd, self._written, len(chunk.view))
                    self._written += len(chunk.view)
                    if self._writeback and self._written - synced >= self._writeback:
                        self._sync_range(synced)
                        synced = self._written
                    self._stats.io_seconds += time.perf_counter() - t0
            except BaseException as exc:
                self._fail(exc)
            finally:
                self._done(chunk)

    def _sync_range(self, start: int) -> None:
        # Dirty pages of a multi-GiB file otherwise pile up in the page cache until the
        # final fsync, and the node's memory.current peaks with them.
        try:
            os.fdatasync(self._fd)
        except OSError as exc:
            raise io_error(
                exc.errno or _errno.EIO,
                "fdatasync of",
                self.path,
                offset=self._written,
                requested=0,
                returned=-1,
            ) from exc
        if self._drop:
            drop_cached(self._fd, start, self._written - start)

    def _hash_loop(self) -> None:
        while (chunk := self._hq.get()) is not None:
            try:
                if self._error is None:
                    chunk.ready()
                    t0 = time.perf_counter()
                    self._hash.update(chunk.view)
                    self._stats.hash_seconds += time.perf_counter() - t0
            except BaseException as exc:
                self._fail(exc)
            finally:
                self._done(chunk)
