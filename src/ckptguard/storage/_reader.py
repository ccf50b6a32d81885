"""DCP items into their target tensors through the pool, with no full host copy.

Contract: for each ``ReadItem`` of this rank, the tensor record is located inside the
item's ``torch.save`` archive (``_fastio_format.read_record``: nothing is unpickled but a
descriptor), and exactly the requested box of the saved tensor is copied into the
target, CPU or GPU, in file spans of at most one pool buffer. A prefetch thread preads
the next spans while the caller's thread copies the previous one to the target (on a
side stream, asynchronously, for a GPU target); with ``threads`` > 1, that many threads
pread interleaved spans, so the disk sees several requests at once. Host memory: the pool, plus items of at
most ``SMALL_ITEM`` bytes read whole. Items written by plain ``dcp.save`` read the same,
whatever their strides. Targets come from the planner's ``resolve_tensor`` up front, as
DCP's default planner returns views of the state; ``commit_tensor`` follows the copies.
"""

from __future__ import annotations

import collections
import errno as _errno
import io
import os
import queue
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadItemType

from ..errors import CheckpointCorruptError, StateMismatchError, StorageStallError, UnsafeCheckpointError
from ._format import FileSlice, Record, read_record
from ._pool import BufferPool, IOStats, drop_cached, read_into

SMALL_ITEM = 64 << 10  # items up to this size are read whole: one pread instead of a dozen


@dataclass(frozen=True)
class _Job:
    fd: int
    path: str
    file_pos: int
    nbytes: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dest: torch.Tensor
    rec: Record


def _extent(size: tuple[int, ...], stride: tuple[int, ...]) -> int:
    return 1 + sum((n - 1) * st for n, st in zip(size, stride, strict=True))


def file_blocks(
    size: tuple[int, ...], stride: tuple[int, ...], offset: int, dest: torch.Tensor, limit: int
) -> Iterator[tuple[int, int, tuple[int, ...], tuple[int, ...], torch.Tensor]]:
    """(first element, extent in elements, block size, block stride, dest view) covering a strided view.

    Blocks run along the dimension of largest stride, so each is one file span of at most
    ``limit`` elements; a slice that alone exceeds the limit is split one level deeper.
    """
    if any(n == 0 for n in size):
        return
    if _extent(size, stride) <= limit:
        yield offset, _extent(size, stride), size, stride, dest
        return
    d = max((i for i, n in enumerate(size) if n > 1), key=lambda i: stride[i])
    rest = _extent(size, stride) - (size[d] - 1) * stride[d]
    per = (limit - rest) // stride[d] + 1 if rest <= limit else 0
    if per >= 1:
        for a in range(0, size[d], per):
            k = min(per, size[d] - a)
            sub = (*size[:d], k, *size[d + 1 :])
            yield offset + a * stride[d], _extent(sub, stride), sub, stride, dest.narrow(d, a, k)
        return
    sub_size, sub_stride = size[:d] + size[d + 1 :], stride[:d] + stride[d + 1 :]
    for a in range(size[d]):
        yield from file_blocks(sub_size, sub_stride, offset + a * stride[d], dest.select(d, a), limit)


class ItemReader:
    """Reads one rank's share of a DCP checkpoint into the planner's tensors."""

    def __init__(self, pool: BufferPool, stats: IOStats, *, drop_cache: bool, threads: int = 1) -> None:
        self._pool, self._stats, self._drop = pool, stats, drop_cache
        self._threads = max(1, threads)
        self._lock = threading.Lock()
        self._stream: Any = None
        self._error: BaseException | None = None
        self._cancel = threading.Event()

    def read(self, state_dir: Path, items: list[Any], storage_data: dict[Any, Any], planner: Any) -> None:
        fds: dict[str, int] = {}
        try:
            jobs, commits = self._plan(state_dir, items, storage_data, planner, fds)
            self._run(jobs)
            for req, dest in commits:
                planner.commit_tensor(req, dest)
        finally:
            for fd in fds.values():
                if self._drop:
                    drop_cached(fd)
                os.close(fd)

    # ------------------------------------------------------------ planning

    def _open(self, state_dir: Path, rel: str, fds: dict[str, int]) -> tuple[int, str]:
        # The name comes from the checkpoint's metadata: it must name a plain file in state_dir.
        if "/" in rel or "\\" in rel or rel in ("", ".", ".."):
            raise UnsafeCheckpointError(
                f"{state_dir}/.metadata names the data file {rel!r}, which is not a file inside {state_dir}; "
                "the checkpoint was not written by DCP or was changed: do not read it"
            )
        path = str(state_dir / rel)
        if rel not in fds:
            # Never through a link, never a FIFO (the open would block) or a device.
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise UnsafeCheckpointError(
                    f"{path} is not a regular file; the checkpoint's data files are: restore an earlier step"
                )
            fds[rel] = fd
            self._stats.files += 1
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fds[rel], 0, 0, os.POSIX_FADV_SEQUENTIAL)
        return fds[rel], path

    def _plan(
        self, state_dir: Path, items: list[Any], storage_data: dict[Any, Any], planner: Any, fds: dict[str, int]
    ) -> tuple[list[_Job], list[tuple[Any, torch.Tensor]]]:
        jobs: list[_Job] = []
        commits: list[tuple[Any, torch.Tensor]] = []
        ordered = sorted(
            items, key=lambda r: (storage_data[r.storage_index].relative_path, storage_data[r.storage_index].offset)
        )
        for req in ordered:
            info = storage_data[req.storage_index]
            fd, path = self._open(state_dir, info.relative_path, fds)
            where = f"{path} item {req.storage_index.fqn!r} at offset {info.offset}"
            if getattr(info, "transform_descriptors", None):
                raise CheckpointCorruptError(
                    f"{where} was written through DCP stream extensions {list(info.transform_descriptors)}; "
                    "StreamingStorage reads plain items only: read this checkpoint with DCPStorage"
                )
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(self._pread(fd, path, info.offset, info.length)))
                continue
            dest = planner.resolve_tensor(req).detach()
            if tuple(dest.shape) != tuple(req.lengths):
                raise StateMismatchError(f"{where}: target shape {tuple(dest.shape)} != requested {tuple(req.lengths)}")
            if info.length <= SMALL_ITEM:
                self._read_small(fd, path, info, req, dest, where)
                commits.append((req, dest))
                continue
            rec = read_record(FileSlice(fd, info.offset, info.length), where)
            offset = rec.storage_offset + sum(o * s for o, s in zip(req.storage_offsets, rec.stride, strict=True))
            item_pos = info.offset + rec.data_offset
            isz = rec.dtype.itemsize
            _check_box(rec.size, rec.stride, req, where)
            for first, extent, size, stride, view in file_blocks(
                tuple(req.lengths), rec.stride, offset, dest, self._pool.size // isz
            ):
                jobs.append(_Job(fd, path, item_pos + first * isz, extent * isz, rec.dtype, size, stride, view, rec))
            commits.append((req, dest))
        return jobs, commits

    def _pread(self, fd: int, path: str, offset: int, length: int) -> bytearray:
        data = bytearray(length)
        read_into(fd, memoryview(data), path, offset)
        self._stats.bytes += length
        return data

    def _read_small(self, fd: int, path: str, info: Any, req: Any, dest: torch.Tensor, where: str) -> None:
        data = self._pread(fd, path, info.offset, info.length)
        rec = read_record(io.BytesIO(data), where)
        _check_box(rec.size, rec.stride, req, where)
        if rec.dtype.itemsize == 0 or dest.numel() == 0:
            return
        raw = torch.frombuffer(data, dtype=torch.uint8)[rec.data_offset :]
        usable = raw.numel() // rec.dtype.itemsize * rec.dtype.itemsize
        base = raw[:usable].view(rec.dtype)
        # as_strided takes an offset from the start of the storage, not of the view.
        src = base.as_strided(rec.size, rec.stride, base.storage_offset() + rec.storage_offset)
        for dim, (o, n) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
            src = src.narrow(dim, o, n)
        dest.copy_(rec.logical(src))

    # ------------------------------------------------------------ streaming

    def _run(self, jobs: list[_Job]) -> None:
        if not jobs:
            return
        ready: queue.Queue[tuple[_Job, Any] | None] = queue.Queue()
        # Several preads in flight (interleaved spans of the same files): one at a time left a
        # virtual disk's queue mostly empty and the load below its sequential read speed.
        count = min(self._threads, len(jobs), max(1, self._pool.count - 1))
        threads = [
            threading.Thread(target=self._prefetch, args=(jobs[i::count], ready), name=f"ckptguard-read-{i}",
                             daemon=True)
            for i in range(count)
        ]
        for thread in threads:
            thread.start()
        pending: collections.deque[tuple[Any, Any]] = collections.deque()
        ended = 0
        try:
            while ended < count:
                got = self._next(ready)
                if got is None:
                    ended += 1
                    continue
                job, buf = got
                src = job.rec.logical(buf.tensor[: job.nbytes].view(job.dtype).as_strided(job.size, job.stride, 0))
                if job.dest.device.type == "cuda":
                    pending.append((self._copy_to_cuda(job.dest, src), buf))
                    while len(pending) > 1:  # one H2D in flight; the prefetch threads keep the rest
                        self._release(*pending.popleft())
                else:
                    job.dest.copy_(src)
                    self._pool.put(buf)
            while pending:
                self._release(*pending.popleft())
        finally:
            self._cancel.set()
            while pending:
                self._release(*pending.popleft())
            deadline = time.monotonic() + self._pool.timeout_s
            for thread in threads:
                while thread.is_alive() and time.monotonic() < deadline:
                    self._drain(ready)  # a thread waiting for a buffer gets one back, then sees the cancel
                    thread.join(timeout=0.05)
            self._drain(ready)
            if self._stream is not None:
                torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
        if self._error is not None:
            raise self._error

    def _next(self, ready: queue.Queue[tuple[_Job, Any] | None]) -> Any:
        t0 = time.perf_counter()
        try:
            got = ready.get(timeout=self._pool.timeout_s)
        except queue.Empty:
            raise StorageStallError(
                _errno.ETIMEDOUT, f"no data read within {self._pool.timeout_s} s: the storage stalled"
            ) from None
        self._stats.stall_seconds += time.perf_counter() - t0
        if got is None and self._error is not None:
            raise self._error
        return got

    def _copy_to_cuda(self, dest: torch.Tensor, src: torch.Tensor) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=dest.device)
            # The targets may still be in use by kernels queued on the current stream.
            self._stream.wait_stream(torch.cuda.current_stream(dest.device))
        with torch.cuda.stream(self._stream):
            dest.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        return event

    def _release(self, event: Any, buf: Any) -> None:
        event.synchronize()  # the buffer is reused only after its H2D copy has read it
        self._pool.put(buf)

    def _drain(self, ready: queue.Queue[tuple[_Job, Any] | None]) -> None:
        while True:
            try:
                got = ready.get_nowait()
            except queue.Empty:
                return
            if got is not None:
                self._pool.put(got[1])

    def _prefetch(self, jobs: list[_Job], ready: queue.Queue[tuple[_Job, Any] | None]) -> None:
        try:
            for job in jobs:
                if self._cancel.is_set():
                    break
                buf = self._pool.get(f"reading {job.path} at offset {job.file_pos}")
                t0 = time.perf_counter()
                try:
                    read_into(job.fd, buf.view[: job.nbytes], job.path, job.file_pos)
                except BaseException:
                    self._pool.put(buf)
                    raise
                with self._lock:
                    self._stats.io_seconds += time.perf_counter() - t0
                    self._stats.bytes += job.nbytes
                ready.put((job, buf))
        except BaseException as exc:
            with self._lock:
                if self._error is None:
                    self._error = exc
        finally:
            ready.put(None)


def _check_box(size: tuple[int, ...], stride: tuple[int, ...], req: Any, where: str) -> None:
    """The requested box must lie inside the saved tensor, whose strides must be positive."""
    if len(size) != len(req.lengths):
        raise CheckpointCorruptError(
            f"{where}: saved tensor has {len(size)} dims, the plan asks for {len(req.lengths)}"
        )
    for n, st, o, k in zip(size, stride, req.storage_offsets, req.lengths, strict=True):
        if o < 0 or o + k > n:
            raise CheckpointCorruptError(
                f"{where}: requested box {list(req.storage_offsets)}+{list(req.lengths)} "
                f"is outside the saved shape {list(size)}"
            )
        if n > 1 and st <= 0:
            raise CheckpointCorruptError(f"{where}: saved tensor has stride {list(stride)}; expected positive strides")
