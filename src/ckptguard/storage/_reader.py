"""DCP items into their target tensors through the pool, with no full host copy.

Contract: for each ``ReadItem`` of this rank, exactly the requested box of the saved tensor
is copied into the target, CPU or GPU, and nothing is unpickled but a descriptor. Where
an item's tensor record lies comes from one of two places:

- an item as long as ``item_frame(chunk shape, dtype)`` (ckptguard's writer, and plain
  ``dcp.save`` of a compact tensor) is read as that frame says, and the frame's head (zip
  header, ``data.pkl`` with dtype, shape and strides, the data record's header: all that
  places the bytes), which arrives with the data, must equal the frame's byte for byte;
  an item whose head differs (a strided view saved by plain DCP, another torch's writer)
  is parsed and read again, over what the guess wrote. The tail (CRCs, central directory)
  places nothing; the file digests of ``verify`` cover it;
- any other item: its archive is parsed (``_format.read_record``) before the read.

The bytes move in spans: neighbouring pieces of one file (frames, tensor blocks, small items, gaps
of at most ``MERGE_GAP``) read by one ``preadv`` into one pool buffer, each piece at a 64-byte
aligned place in it, so a load issues requests of about a buffer's size whatever the tensors' sizes.
``threads`` threads each read one contiguous stretch of the spans through an open file of their own
(the disk sees that many sequential streams) while the caller's thread copies finished spans to the
targets (on a side stream, asynchronously, for a GPU target). Host memory: the pool. Targets come
from the planner's ``resolve_tensor`` up front, as DCP's default planner returns views of the state;
``commit_tensor`` follows the copies.
"""

from __future__ import annotations

import collections
import contextlib
import errno as _errno
import io
import logging
import os
import queue
import stat
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadItemType

from ..errors import (
    CheckpointCorruptError,
    StateMismatchError,
    StorageStallError,
    UnsafeCheckpointError,
)
from ._format import FileSlice, read_record
from ._pool import BufferPool, IOStats, drop_cached, halt_reads_ahead, read_scattered
from ._spans import (
    ALIGN,
    SMALL_ITEM,
    Piece,
    Span,
    check_box,
    check_record,
    file_blocks,
    group_spans,
    guess_frame,
    reopen,
    stretches,
    views,
)

log = logging.getLogger("ckptguard")


class ItemReader:
    """Reads one rank's share of a DCP checkpoint into the planner's tensors."""

    def __init__(
        self, pool: BufferPool, stats: IOStats, *, drop_cache: bool, threads: int = 1
    ) -> None:
        self._pool, self._stats, self._drop = pool, stats, drop_cache
        self._threads = max(1, threads)
        self._lock = threading.Lock()
        self._streams: dict[Any, Any] = {}  # a side stream per target GPU
        self._error: BaseException | None = None
        self._cancel = threading.Event()
        self._failed_checks: set[int] = set()
        self._threads_run: list[threading.Thread] = []
        self._stalled = False
        self._reading: dict[
            str, tuple[str, int]
        ] = {}  # thread name -> (file, offset) of the read it is in

    def read(
        self,
        state_dir: Path,
        items: list[Any],
        storage_data: dict[Any, Any],
        planner: Any,
        metadata: Any = None,
    ) -> None:
        fds: dict[str, int] = {}
        self._error, self._threads_run, self._stalled = None, [], False
        self._cancel.clear()
        self._failed_checks.clear()
        try:
            ordered = sorted(
                items,
                key=lambda r: (
                    storage_data[r.storage_index].relative_path,
                    storage_data[r.storage_index].offset,
                ),
            )
            dests: dict[
                int, torch.Tensor
            ] = {}  # each item's target, resolved once (a planner may stage it)
            pieces = self._plan(state_dir, ordered, storage_data, planner, fds, metadata, dests)
            halt_reads_ahead(
                state_dir
            )  # from here the threads below read; they drop what they read
            self._run(group_spans(pieces, self._pool.size))
            if self._failed_checks:
                # Items whose head is not ckptguard's frame (a strided view by plain dcp.save,
                # another torch's writer): parse their archives and read them again over what the
                # guess wrote.
                again = set(self._failed_checks)
                self._failed_checks.clear()
                self._cancel.clear()
                redo = self._plan(
                    state_dir, ordered, storage_data, planner, fds, None, dests, only=again
                )
                self._run(group_spans(redo, self._pool.size))
            for n, req in enumerate(ordered):
                planner.commit_tensor(req, dests[n])
        finally:
            stuck = [t.name for t in self._threads_run if t.is_alive()]
            if stuck:
                # A thread still blocked in a read of a hung filesystem: closing its descriptor now
                # would let the number be reused under it. The descriptors stay open (a few per
                # load, named here).
                log.warning(
                    "ckptguard: read threads %s still blocked in the storage; %d data file "
                    "descriptor(s) left open for them: %s",
                    stuck,
                    len(fds),
                    sorted(fds),
                )
            else:
                for fd in fds.values():
                    # Each span dropped its own pages; this catches the readahead past the last span
                    # and the pages of parsed archives (a no-op where nothing is cached).
                    if self._drop:
                        with contextlib.suppress(OSError):
                            drop_cached(fd)
                    os.close(fd)

    # ------------------------------------------------------------ planning

    def _open(self, state_dir: Path, rel: str, fds: dict[str, int]) -> tuple[int, str]:
        # The name comes from the checkpoint's metadata: it must name a plain file in state_dir.
        if "/" in rel or "\\" in rel or rel in ("", ".", ".."):
            raise UnsafeCheckpointError(
                f"{state_dir}/.metadata names the data file {rel!r}, which is not a file inside "
                f"{state_dir}; the checkpoint was not written by DCP or was changed: do not read it"
            )
        path = str(state_dir / rel)
        if rel not in fds:
            # Never through a link, never a FIFO (the open would block) or a device.
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise UnsafeCheckpointError(
                    f"{path} is not a regular file; the checkpoint's data files "
                    f"are: restore an earlier step"
                )
            fds[rel] = fd
            self._stats.files += 1
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fds[rel], 0, 0, os.POSIX_FADV_SEQUENTIAL)
        return fds[rel], path

    def _plan(
        self,
        state_dir: Path,
        ordered: list[Any],
        storage_data: dict[Any, Any],
        planner: Any,
        fds: dict[str, int],
        metadata: Any,
        dests: dict[int, torch.Tensor],
        only: set[int] | None = None,
    ) -> list[tuple[int, str, Piece]]:
        """The pieces to read for ``ordered`` (those in ``only``), each naming its item by index in
        ``ordered``; every tensor item's target in ``dests``. ``metadata`` None: every item's
        archive is parsed."""
        pieces: list[tuple[int, str, Piece]] = []
        limit_bytes = self._pool.size - ALIGN
        for n, req in enumerate(ordered):
            if only is not None and n not in only:
                continue
            info = storage_data[req.storage_index]
            fd, path = self._open(state_dir, info.relative_path, fds)
            where = f"{path} item {req.storage_index.fqn!r} at offset {info.offset}"
            if getattr(info, "transform_descriptors", None):
                raise CheckpointCorruptError(
                    f"{where} was written through DCP stream extensions "
                    f"{list(info.transform_descriptors)}; StreamingStorage reads plain items only: "
                    f"read this checkpoint with DCPStorage"
                )
            if req.type == LoadItemType.BYTE_IO:
                # DCP's load_bytes unpickles with weights_only=False; this reader only ever fills
                # tensors.
                raise UnsafeCheckpointError(
                    f"{where} is stored as pickled bytes, where a tensor is asked for: unpickling "
                    f"it could run code, so ckptguard will not read it; the checkpoint was "
                    f"tampered with or written for another state: restore an earlier step"
                )
            if n not in dests:
                dests[n] = planner.resolve_tensor(req).detach()
            dest = dests[n]
            if tuple(dest.shape) != tuple(req.lengths):
                raise StateMismatchError(
                    f"{where}: target shape {tuple(dest.shape)} != requested {tuple(req.lengths)}"
                )
            if info.length <= min(
                SMALL_ITEM, limit_bytes
            ):  # read whole, in one buffer with its neighbours
                pieces.append(
                    (
                        fd,
                        path,
                        Piece(
                            info.offset, info.length, "small", n, dest=dest, req=req, where=where
                        ),
                    )
                )
                continue
            guess = guess_frame(metadata, req, info, limit_bytes)
            if guess is not None:
                rec, frame = guess
                pieces.append(
                    (fd, path, Piece(info.offset, len(frame.head), "check", n, expected=frame.head))
                )
            else:
                rec = read_record(FileSlice(fd, info.offset, info.length, path), where)
                check_record(rec, info.length, where)
                check_box(rec.size, rec.stride, req, where)
            offset = rec.storage_offset + sum(
                o * s for o, s in zip(req.storage_offsets, rec.stride, strict=True)
            )
            item_pos = info.offset + rec.data_offset
            isz = rec.dtype.itemsize
            for first, extent, size, stride, view in file_blocks(
                tuple(req.lengths), rec.stride, offset, dest, limit_bytes // isz
            ):
                piece = Piece(
                    item_pos + first * isz,
                    extent * isz,
                    "copy",
                    n,
                    dest=view,
                    dtype=rec.dtype,
                    size=size,
                    stride=stride,
                    rec=rec,
                )
                pieces.append((fd, path, piece))
        return pieces

    def _copy_small(self, data: bytearray, piece: Piece) -> None:
        rec = read_record(io.BytesIO(data), piece.where)
        req, dest = piece.req, piece.dest
        check_record(rec, len(data), piece.where)
        check_box(rec.size, rec.stride, req, piece.where)
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

    def _run(self, spans: list[Span]) -> None:
        if not spans:
            return
        ready: queue.Queue[tuple[Span, Any] | None] = queue.Queue()
        # Several reads in flight, each thread one contiguous stretch of the spans through its own
        # open file (its own readahead): threads interleaving spans of one descriptor read no faster
        # than one thread (benchmarks/results/read_h200.md).
        count = min(self._threads, len(spans), max(1, self._pool.count - 1))
        threads = [
            threading.Thread(
                target=self._prefetch,
                args=(part, ready, count > 1),
                name=f"ckptguard-read-{i}",
                daemon=True,
            )
            for i, part in enumerate(stretches(spans, count))
        ]
        count = len(threads)
        self._threads_run += threads
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
                span, buf = got
                events: list[Any] = []
                try:
                    self._deliver(span, buf, events)
                finally:
                    if (
                        events
                    ):  # also when a later piece raised: the copies queued still read this buffer
                        pending.append((events, buf))
                    else:
                        self._pool.put(buf)
                while (
                    len(pending) > 1
                ):  # one span's H2D in flight; the prefetch threads keep the rest
                    self._release(*pending.popleft())
            while pending:
                self._release(*pending.popleft())
        finally:
            self._cancel.set()
            while pending:
                self._release(*pending.popleft())
            # After a stall the caller's thread has already waited a whole timeout: a short grace,
            # not another.
            grace = min(1.0, self._pool.timeout_s) if self._stalled else self._pool.timeout_s
            deadline = time.monotonic() + grace
            for thread in threads:
                while thread.is_alive() and time.monotonic() < deadline:
                    self._drain(
                        ready
                    )  # a thread waiting for a buffer gets one back, then sees the cancel
                    thread.join(timeout=0.05)
            self._drain(ready)
            for device, stream in self._streams.items():
                torch.cuda.current_stream(device).wait_stream(stream)
        if self._error is not None:
            raise self._error

    def _deliver(self, span: Span, buf: Any, events: list[Any]) -> None:
        """Each piece of a read span to its place; ``events`` gets one event per GPU its H2D copies
        went to."""
        last: dict[Any, Any] = {}
        try:
            self._pieces_to_targets(span, buf, last)
        finally:
            events.extend(last.values())

    def _pieces_to_targets(self, span: Span, buf: Any, last: dict[Any, Any]) -> None:
        for piece, at in span.pieces:
            if piece.item in self._failed_checks:
                continue  # read again after this pass
            if piece.kind == "check":
                if buf.view[at : at + piece.nbytes] != piece.expected:
                    self._failed_checks.add(piece.item)
                continue
            if piece.kind == "small":
                self._copy_small(bytearray(buf.view[at : at + piece.nbytes]), piece)
                continue
            raw = buf.tensor[at : at + piece.nbytes].view(piece.dtype)
            assert piece.rec is not None
            src = piece.rec.logical(raw.as_strided(piece.size, piece.stride, raw.storage_offset()))
            if piece.dest.device.type == "cuda":
                last[piece.dest.device] = self._copy_to_cuda(piece.dest, src)
            else:
                piece.dest.copy_(src)

    def _next(self, ready: queue.Queue[tuple[Span, Any] | None]) -> Any:
        t0 = time.perf_counter()
        try:
            got = ready.get(timeout=self._pool.timeout_s)
        except queue.Empty:
            self._stalled = True
            with self._lock:
                waiting = sorted(f"{path} at offset {pos}" for path, pos in self._reading.values())
            raise StorageStallError(
                _errno.ETIMEDOUT,
                f"no data read within {self._pool.timeout_s} s: the storage stalled (reads in "
                f"flight: {', '.join(waiting) or 'none'}); check the filesystem, or raise "
                f"StreamingConfig.stall_timeout_s only if it is just slow",
            ) from None
        self._stats.stall_seconds += time.perf_counter() - t0
        if got is None and self._error is not None:
            raise self._error
        return got

    def _copy_to_cuda(self, dest: torch.Tensor, src: torch.Tensor) -> Any:
        stream = self._streams.get(dest.device)
        if stream is None:
            # One side stream per GPU: a copy queued inside another GPU's stream context would run
            # on this GPU's current stream, which that stream's events do not cover.
            stream = self._streams[dest.device] = torch.cuda.Stream(device=dest.device)
            # The targets may still be in use by kernels queued on the current stream.
            stream.wait_stream(torch.cuda.current_stream(dest.device))
        with torch.cuda.device(dest.device), torch.cuda.stream(stream):
            dest.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def _release(self, events: list[Any], buf: Any) -> None:
        for event in events:
            event.synchronize()  # the buffer is reused only after its H2D copies have read it
        self._pool.put(buf)

    def _drain(self, ready: queue.Queue[tuple[Span, Any] | None]) -> None:
        while True:
            try:
                got = ready.get_nowait()
            except queue.Empty:
                return
            if got is not None:
                self._pool.put(got[1])

    def _prefetch(
        self, spans: list[Span], ready: queue.Queue[tuple[Span, Any] | None], own: bool
    ) -> None:
        mine: dict[int, int] = {}
        try:
            for span in spans:
                if self._cancel.is_set():
                    break
                fd = span.fd
                if own:
                    if span.fd not in mine:
                        mine[span.fd] = reopen(span.fd)
                    fd = mine[span.fd]
                buf = self._pool.get(f"reading {span.path} at offset {span.pos}")
                t0 = time.perf_counter()
                with self._lock:
                    self._reading[threading.current_thread().name] = (span.path, span.pos)
                try:
                    read_scattered(fd, views(span, buf), span.path, span.pos)
                except BaseException:
                    self._pool.put(buf)
                    raise
                finally:
                    with self._lock:
                        self._reading.pop(threading.current_thread().name, None)
                if self._drop:
                    drop_cached(
                        fd, span.pos, span.end - span.pos
                    )  # in our buffer now: no page cache kept
                with self._lock:
                    self._stats.io_seconds += time.perf_counter() - t0
                    self._stats.bytes += span.end - span.pos
                ready.put((span, buf))
        except BaseException as exc:
            with self._lock:
                if self._error is None:
                    self._error = exc
        finally:
            for shared, fd in mine.items():
                if fd != shared:
                    os.close(fd)
            ready.put(None)
