"""The storage seam: how tensor state reaches ``state/`` and comes back.

Contract: ``write`` either writes every planned item of this rank and returns the
files it wrote with their sizes and checksums, or raises the first error it hit.
``read`` fills the given tensors in place and raises if any key is missing. The files
stay standard PyTorch DCP, so plain ``torch.distributed.checkpoint.load`` reads them.
DCP pickles ``.metadata``; we only ever unpickle it with ``SafeMetadataUnpickler``.
The versions a step records (``current_versions``) and the check of torch's before a read
(``check_torch_version``) live here too: they read torch's own version, which the operator
commands that read manifests (``ckptguard list``, ``gc``, ``resolve``) never import.
"""

from __future__ import annotations

import contextlib
import errno
import os
import platform
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
from torch.futures import Future
from torch.torch_version import TorchVersion

from .. import _faults
from .._disk.digest import file_digest
from .._version import __version__
from ..errors import UnsafeCheckpointError, VersionMismatchError
from .base import DCP_METADATA, StorageContext, WrittenFile
from .unpickler import read_dcp_metadata


def current_versions() -> dict[str, str]:
    """The versions a step records: torch (the DCP files' writer), ckptguard, Python."""
    return {
        "torch": torch.__version__,
        "ckptguard": __version__,
        "python": platform.python_version(),
    }


def check_torch_version(written: str, where: Path, *, allow_newer: bool) -> None:
    """Refuse, before any read, a checkpoint (``where``) written by a newer torch (``written``) than
    ours."""
    if allow_newer or TorchVersion(written.split("+")[0]) <= torch.__version__.split("+")[0]:
        return
    raise VersionMismatchError(
        f"{where} was written by torch {written}; this process runs torch "
        f"{torch.__version__}. Newer torch can write formats an older one misreads "
        f"(e.g. DTensor layouts). Restore with the image that wrote it, or pass "
        f"CheckpointConfig(storage=StorageOptions(allow_newer_torch=True)) after "
        f"checking it reads correctly."
    )


# ---------------------------------------------------------------- loading tensors only


class TensorsOnlyPlanner(DefaultLoadPlanner):
    """DCP's default load planner for a state of tensors, which is all ``Storage.read`` is given.

    The type of each item comes from the checkpoint's ``.metadata``, not from the target: a
    ``.metadata`` that calls a key "bytes" would have DCP's ``load_bytes`` run
    ``torch.load(weights_only=False)`` on the file's bytes, that is, any pickled code. Such a key
    is refused before anything is read, and ``load_bytes`` is never reached.
    """

    def __init__(self, state_dir: Path) -> None:
        super().__init__()
        self._dir = state_dir

    def create_local_plan(self) -> Any:
        assert self.metadata is not None
        for fqn in self.state_dict:
            if isinstance(self.metadata.state_dict_metadata.get(fqn), BytesStorageMetadata):
                raise self._refuse(fqn)
        return super().create_local_plan()

    def load_bytes(self, read_item: Any, value: Any) -> None:
        raise self._refuse(read_item.storage_index.fqn)

    def _refuse(self, fqn: str) -> UnsafeCheckpointError:
        return UnsafeCheckpointError(
            f"{self._dir}/.metadata stores {fqn!r} as pickled bytes, where this state holds a "
            f"tensor: loading it would unpickle whatever the file holds (it can run code), so "
            f"ckptguard will not. The checkpoint was not written for this state, or was tampered "
            f"with: restore an earlier step"
        )


# ---------------------------------------------------------------- DCP-backed storage


class _RecordingStream:
    """A file stream that remembers the first OSError of a write, with offset and byte counts.

    torch.save inside DCP turns a failed write (ENOSPC, EIO, EDQUOT) into
    "RuntimeError: unexpected pos N vs M" and drops the errno; docs/practices.md, 3.1 asks for
    the first error, so we keep it here and raise it instead.
    """

    def __init__(self, stream: Any, path: str, sink: _CheckedWriter) -> None:
        self._stream, self._path, self._sink = stream, path, sink

    def write(self, data: Any) -> int | None:
        want = len(memoryview(data).cast("B"))
        offset = self._stream.tell()
        try:
            n: int | None = self._stream.write(data)
        except OSError as exc:
            self._sink.record(exc, self._path, offset, want, 0)
            raise
        if n is not None and n < want:
            self._sink.record(OSError(errno.EIO, "short write"), self._path, offset, want, n)
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _RecordingFS:
    def __init__(self, fs: Any, sink: _CheckedWriter) -> None:
        self._fs, self._sink = fs, sink

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Any:
        with self._fs.create_stream(path, mode) as stream:
            yield _RecordingStream(stream, str(path), self._sink) if "w" in mode else stream

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)


class _CheckedWriter(FileSystemWriter):
    """DCP's writer, holding us to the plan: every planned item must come back written.

    DCP's writer threads can lose an OSError (measured with thread_count > 1), which
    would leave a shard short while DCP still writes ``.metadata``. We compare results
    with the plan and raise instead.
    """

    def __init__(self, path: Path, *, thread_count: int, on_written: Callable[[], None]) -> None:
        super().__init__(path, thread_count=thread_count, sync_files=True, overwrite=False)
        self.files: set[str] = set()
        self._on_written = on_written
        self.first_error: OSError | None = None
        self.fs = _RecordingFS(self.fs, self)  # type: ignore[assignment]  # duck-typed wrapper

    def record(self, exc: OSError, path: str, offset: int, requested: int, returned: int) -> None:
        if self.first_error is None:  # the first error, not the last message
            err = OSError(exc.errno, exc.strerror or str(exc), path)
            err.__dict__.update(offset=offset, requested_bytes=requested, returned_bytes=returned)
            self.first_error = err

    def write_data(self, plan: Any, planner: Any) -> Any:
        try:
            results = self._write(plan, planner)
        except BaseException as exc:
            if self.first_error is not None:
                raise self.first_error from exc
            raise
        if self.first_error is not None:
            raise self.first_error
        planned = {item.index for item in plan.items}
        written = {r.index for r in results}
        if planned != written:
            missing = sorted(str(i.fqn) for i in planned - written)[:5]
            raise OSError(
                errno.EIO,
                f"DCP wrote {len(written)} of {len(plan.items)} planned items under {self.path}; "
                f"missing e.g. {missing} (a writer thread failed)",
                str(self.path),
            )
        self._check_lengths(results)
        self.files.update(r.storage_data.relative_path for r in results)
        self._on_written()
        fut: Future[list[Any]] = Future()
        fut.set_result(results)
        return fut

    def _write(self, plan: Any, planner: Any) -> list[Any]:
        future = super().write_data(plan, planner)
        # A future without wait() is a concurrent.futures one: torch's stub does not know that type.
        if hasattr(future, "wait"):
            return future.wait()
        return future.result()  # type: ignore[attr-defined,no-any-return]

    def _check_lengths(self, results: list[Any]) -> None:
        """A short write that went unnoticed leaves a file shorter than its items' extent."""
        extent: dict[str, int] = {}
        for r in results:
            info = r.storage_data
            extent[info.relative_path] = max(
                extent.get(info.relative_path, 0), info.offset + info.length
            )
        for rel, need in extent.items():
            path = os.path.join(self.path, rel)
            have = os.path.getsize(path)
            if have < need:
                exc = OSError(
                    errno.EIO, f"short write: {have} of {need} bytes on disk after fsync", path
                )
                exc.__dict__.update(offset=have, requested_bytes=need, returned_bytes=have)
                raise exc


class _SafeReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return read_dcp_metadata(Path(self.path))


class DCPStorage:
    """DCP's own writer and reader, checked against the plan (the default is StreamingStorage)."""

    def __init__(self, *, thread_count: int = 1) -> None:
        self.thread_count = thread_count

    def write(
        self, state_dir: Path, tensors: dict[str, torch.Tensor], ctx: StorageContext
    ) -> list[WrittenFile]:
        writer = self._writer(state_dir)
        with quiet_single_process(ctx):
            dcp.save(
                tensors,
                storage_writer=writer,
                process_group=ctx.process_group,
                no_dist=ctx.process_group is None,
            )
        names = sorted(writer.files)
        if ctx.rank == 0:
            names.append(DCP_METADATA)
        out = []
        for name in names:
            size, xxh = file_digest(os.path.join(state_dir, name))
            out.append(WrittenFile(path=f"state/{name}", size=size, xxh3=xxh))
        return out

    def read_metadata(self, state_dir: Path) -> Metadata:
        return read_dcp_metadata(state_dir)

    def _writer(self, state_dir: Path) -> _CheckedWriter:
        return _CheckedWriter(
            state_dir,
            thread_count=self.thread_count,
            on_written=lambda: _faults.reached("storage.data_written"),
        )

    def read(self, state_dir: Path, tensors: dict[str, torch.Tensor], ctx: StorageContext) -> None:
        with quiet_single_process(ctx):
            unwrapped(
                ctx,
                lambda: dcp.load(
                    tensors,
                    storage_reader=_SafeReader(state_dir),
                    planner=TensorsOnlyPlanner(state_dir),
                    process_group=ctx.process_group,
                    no_dist=ctx.process_group is None,
                ),
            )


def unwrapped(ctx: StorageContext, call: Any) -> Any:
    """Run a DCP collective; this rank's own error is raised as itself, not wrapped.

    DCP gathers every rank's exception into a CheckpointException; the commit protocol
    wants this rank's errno/offset first, and a rank that did not fail keeps DCP's wrapper.
    """
    try:
        return call()
    except CheckpointException as exc:
        mine = exc.failures.get(ctx.rank)
        if mine is None:
            raise
        own = mine[0] if isinstance(mine, tuple) else mine
        if isinstance(own, BaseException):
            raise own from exc
        raise


class quiet_single_process(warnings.catch_warnings):
    """DCP warns that it assumes one process whenever dist is not initialized; we know."""

    def __init__(self, ctx: StorageContext) -> None:
        super().__init__(record=False)
        self._single = ctx.process_group is None

    def __enter__(self) -> Any:
        out = super().__enter__()
        if self._single:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return out
