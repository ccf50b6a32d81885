"""StreamingStorage: standard DCP files, written and read through a bounded pool of host buffers.

Contract (the ``Storage`` seam of ``ckptguard.storage``):

- ``write`` is collective over ``ctx.process_group`` and runs DCP's own save protocol
  (``dcp.save`` with the default planner: same keys, chunk offsets and dedup of replicated
  tensors as plain DCP). Each rank with items writes one file ``__<rank>_0.distcp`` in DCP's
  TORCH_SAVE layout: every item is a ``torch.save`` archive holding exactly the item's
  bytes (a view never drags its storage along), so plain ``torch.distributed.checkpoint.load``
  reads it back bitwise. Rank 0 writes ``.metadata`` as DCP does. The bytes go through at
  most ``pool_bytes`` of exact-size host buffers (pinned when a tensor is on the GPU), D2H
  copies, xxh3 and writes overlapping, and each file is fsynced and optionally dropped from
  the page cache. It returns the files with size and xxh3 taken from the stream. Any
  failure raises this rank's first error, an ``OSError`` with ``errno``, ``filename``,
  ``offset``, ``requested_bytes`` and ``returned_bytes`` for an I/O failure.
- ``read`` is collective too (``dcp.load`` with the default planner) and fills the given
  tensors in place from the same pool: no full host copy of any item, GPU targets filled
  by H2D copies from pinned buffers. It reads files written by plain ``dcp.save`` as well.
- ``read_metadata`` unpickles only through ckptguard's restricted unpickler.
- After either call the pool is gone: nothing stays pinned or mapped. ``last_stats``
  holds this rank's figures of the last call.

Needs torch >= 2.5 (``torch.serialization.skip_data``).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

# _StorageInfo is what DCP's FileSystemReader expects in Metadata.storage_data; it is the
# class DCP itself pickles there, and ckptguard's metadata unpickler allows it.
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .. import _faults
from .._disk.digest import file_digest
from ..errors import ConfigError, StateMismatchError
from ._format import item_frame
from ._pool import BufferPool, IOStats
from ._reader import ItemReader
from ._writer import FileStreamer, exact
from .base import DCP_METADATA, StorageContext, WrittenFile
from .dcp import TensorsOnlyPlanner, quiet_single_process, unwrapped
from .unpickler import read_dcp_metadata

__all__ = ["IOStats", "StreamingConfig", "StreamingStorage"]

_MiB = 1 << 20
_PAGE = 4096


@dataclass(frozen=True, kw_only=True)
class StreamingConfig:
    """How much host memory the streaming storage may hold and what it does with the page cache."""

    pool_bytes: int = 256 * _MiB
    """Host bytes of staging buffers per rank, in total (the pool holds pool_bytes // buffer_bytes
    buffers)."""
    buffer_bytes: int = 32 * _MiB
    """Size of one buffer, the largest piece a tensor is cut into; a multiple of 4096."""
    pin_memory: bool = True
    """Page-lock the buffers when a tensor is on the GPU (async D2H/H2D); never on a CPU-only
    state."""
    drop_page_cache: bool = True
    """posix_fadvise(DONTNEED) the files once synced, so the save/load does not leave page cache
    behind."""
    writeback_bytes: int | None = 1 << 30
    """fdatasync (and drop) every this many bytes while writing; None: only the final fsync."""
    read_threads: int = 4
    """Threads that read a load's spans at once, each one contiguous stretch through its own open
    file and into its own pool buffers (at most buffer_count - 1 run, so one buffer is always free
    for the copy to the target). On the H200 machine's virtual disk
    (benchmarks/results/read_h200.md) a 6.2 GiB restore ran at 1.00x the disk's own 64 MiB
    sequential reads with 4, 0.95x with 2 and 0.86x with 1."""
    stall_timeout_s: float = 600.0
    """Longest wait for a free buffer or an I/O thread before raising StorageStallError (a
    TimeoutError)."""

    def __post_init__(self) -> None:
        if not _is_int(self.buffer_bytes) or self.buffer_bytes < _PAGE or self.buffer_bytes % _PAGE:
            raise ConfigError(
                f"StreamingConfig.buffer_bytes must be a positive multiple of {_PAGE}, "
                f"got {self.buffer_bytes!r}"
            )
        if not _is_int(self.pool_bytes) or self.pool_bytes < 2 * self.buffer_bytes:
            raise ConfigError(
                f"StreamingConfig.pool_bytes must be an int of at least 2 x buffer_bytes "
                f"({2 * self.buffer_bytes}) so copies and writes overlap, got {self.pool_bytes!r}; "
                f"lower buffer_bytes or raise pool_bytes"
            )
        if self.writeback_bytes is not None and (
            not _is_int(self.writeback_bytes) or self.writeback_bytes <= 0
        ):
            raise ConfigError(
                f"StreamingConfig.writeback_bytes must be a positive int or None, got "
                f"{self.writeback_bytes!r}"
            )
        if not _is_int(self.read_threads) or self.read_threads < 1:
            raise ConfigError(
                f"StreamingConfig.read_threads must be an int >= 1, got {self.read_threads!r}"
            )
        for name in ("pin_memory", "drop_page_cache"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    f"StreamingConfig.{name} must be a bool, got {getattr(self, name)!r}"
                )
        if (
            not isinstance(self.stall_timeout_s, (int, float))
            or not math.isfinite(self.stall_timeout_s)
            or (self.stall_timeout_s <= 0)
        ):
            raise ConfigError(
                f"StreamingConfig.stall_timeout_s must be a positive number, got "
                f"{self.stall_timeout_s!r}"
            )

    @property
    def buffer_count(self) -> int:
        return self.pool_bytes // self.buffer_bytes


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class StreamingStorage:
    """Standard DCP files through a bounded, exact-size host buffer pool (see the module
    docstring)."""

    def __init__(self, config: StreamingConfig | None = None) -> None:
        self.config = config or StreamingConfig()
        if not isinstance(self.config, StreamingConfig):
            raise ConfigError(f"config must be a StreamingConfig, got {type(self.config).__name__}")
        if not hasattr(torch.serialization, "skip_data"):
            raise ConfigError(
                f"StreamingStorage needs torch >= 2.5 (skip_data); this is "
                f"torch {torch.__version__}"
            )
        self.last_stats: IOStats | None = None

    # ------------------------------------------------------------ Storage

    def write(
        self, state_dir: Path, tensors: dict[str, torch.Tensor], ctx: StorageContext
    ) -> list[WrittenFile]:
        stats = IOStats()
        writer = _StreamingWriter(state_dir, self, stats, pin=self._pin(tensors))
        self._run(
            ctx,
            stats,
            lambda group, single: dcp.save(
                tensors, storage_writer=writer, process_group=group, no_dist=single
            ),
        )
        return sorted(writer.written, key=lambda f: f.path)

    def read_metadata(self, state_dir: Path) -> Metadata:
        return read_dcp_metadata(state_dir)

    def read(self, state_dir: Path, tensors: dict[str, torch.Tensor], ctx: StorageContext) -> None:
        stats = IOStats()
        reader = StreamingReader(state_dir, self, stats, pin=self._pin(tensors))
        self._run(
            ctx,
            stats,
            lambda group, single: dcp.load(
                tensors,
                storage_reader=reader,
                planner=TensorsOnlyPlanner(state_dir),
                process_group=group,
                no_dist=single,
            ),
        )

    def _run(self, ctx: StorageContext, stats: IOStats, call: Any) -> None:
        """One DCP save or load over ``ctx``'s group, timed into ``stats``; our own error
        unwrapped."""
        t0 = time.perf_counter()
        try:
            with quiet_single_process(ctx):
                unwrapped(ctx, lambda: call(ctx.process_group, ctx.process_group is None))
        finally:
            stats.seconds = time.perf_counter() - t0
            self.last_stats = stats

    # ------------------------------------------------------------ internals

    def _pin(self, tensors: dict[str, torch.Tensor]) -> bool:
        return self.config.pin_memory and any(t.device.type == "cuda" for t in tensors.values())

    def pool(self, *, pin: bool) -> BufferPool:
        cfg = self.config
        return BufferPool(
            count=cfg.buffer_count, size=cfg.buffer_bytes, pin=pin, timeout_s=cfg.stall_timeout_s
        )

    def write_items(
        self, state_dir: Path, plan: Any, planner: Any, stats: IOStats, *, pin: bool
    ) -> tuple[list[WriteResult], WrittenFile | None]:
        """Stream this rank's planned items into its one data file; (results, the file)."""
        if not plan.items:
            return [], None  # a rank whose items were all deduplicated away writes no file
        name = f"{plan.storage_data.prefix}0.distcp"
        results = []
        with self.pool(pin=pin) as pool:
            with FileStreamer(
                str(state_dir / name),
                pool,
                stats,
                writeback_bytes=self.config.writeback_bytes,
                drop_cache=self.config.drop_page_cache,
            ) as out:
                for item in plan.items:
                    results.append(_write_item(out, name, item, planner))
                size, xxh3 = out.finish()
            stats.pool_bytes = (
                pool.allocated_bytes
            )  # the buffers the write made (the pool makes them on demand)
        stats.bytes += size
        stats.files += 1
        _fsync_dir(state_dir)
        return results, WrittenFile(path=f"state/{name}", size=size, xxh3=xxh3)


def _write_item(out: FileStreamer, name: str, item: Any, planner: Any) -> WriteResult:
    offset = out.position
    data = planner.resolve_data(item)
    if item.type == WriteItemType.BYTE_IO:
        out.add_bytes(data.getbuffer())
    else:
        t = exact(data)
        planned = tuple(item.tensor_data.chunk.sizes)
        if tuple(t.shape) != planned:
            raise StateMismatchError(
                f"item {item.index.fqn!r}: tensor shape {tuple(t.shape)} "
                f"differs from the plan {planned}"
            )
        frame = item_frame(planned, t.dtype)
        out.add_bytes(frame.head)
        out.add_tensor(t)
        out.add_bytes(frame.tail)
    length = out.position - offset
    return WriteResult(
        index=item.index, size_in_bytes=length, storage_data=_StorageInfo(name, offset, length)
    )


def _fsync_dir(path: Path | str | os.PathLike[str]) -> None:
    # New names in state/ are durable only once the directory itself is synced.
    fd = os.open(str(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _StreamingWriter(FileSystemWriter):
    """DCP's file writer with write_data replaced by the streaming pipeline."""

    def __init__(self, path: Path, storage: StreamingStorage, stats: IOStats, *, pin: bool) -> None:
        super().__init__(
            path, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=False
        )
        self._storage, self._stats, self._pin = storage, stats, pin
        self.written: list[WrittenFile] = []

    def write_data(self, plan: Any, planner: Any) -> Future[list[WriteResult]]:
        results, written = self._storage.write_items(
            Path(self.path), plan, planner, self._stats, pin=self._pin
        )
        if written is not None:
            self.written.append(written)
        _faults.reached("storage.data_written")  # the crash-injection point DCPStorage has too
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)  # DCP's own: pickle, fsync, rename .metadata
        _fsync_dir(self.path)
        size, xxh3 = file_digest(os.path.join(self.path, DCP_METADATA))  # small; read back once
        self.written.append(WrittenFile(path=f"state/{DCP_METADATA}", size=size, xxh3=xxh3))


class StreamingReader(FileSystemReader):
    """DCP's file reader with metadata through the restricted unpickler and streamed reads."""

    def __init__(self, path: Path, storage: StreamingStorage, stats: IOStats, *, pin: bool) -> None:
        super().__init__(path)
        self._storage, self._stats, self._pin = storage, stats, pin
        self._metadata: Metadata | None = None

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._metadata = (
            metadata  # chunk shapes and dtypes: the reader knows each item's frame from them
        )

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return read_dcp_metadata(Path(self.path))

    def read_data(self, plan: Any, planner: Any) -> Future[None]:
        with self._storage.pool(pin=self._pin) as pool:
            cfg = self._storage.config
            reader = ItemReader(
                pool, self._stats, drop_cache=cfg.drop_page_cache, threads=cfg.read_threads
            )
            try:
                reader.read(Path(self.path), plan.items, self.storage_data, planner, self._metadata)
            finally:
                self._stats.pool_bytes = (
                    pool.allocated_bytes
                )  # the buffers the read made (on demand)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut
