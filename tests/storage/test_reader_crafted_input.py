"""The span reader's load path against crafted and failing checkpoints: pickled keys, crafted
``data.pkl`` and ``.metadata`` globals, layouts that overrun their storage, re-read items,
stalls, I/O errors while parsing, and a reader reused."""

from __future__ import annotations

import errno
import io
import os
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner

from ckptguard.errors import CheckpointCorruptError, StorageStallError, UnsafeCheckpointError
from ckptguard.storage import _format
from ckptguard.storage import _pool as _fastio_pool
from ckptguard.storage._pool import IOStats
from ckptguard.storage._reader import ItemReader
from ckptguard.storage.base import StorageContext
from ckptguard.storage.dcp import DCPStorage
from ckptguard.storage.streaming import StreamingConfig, StreamingReader, StreamingStorage
from ckptguard.storage.unpickler import read_dcp_metadata

CTX = StorageContext(rank=0, world_size=1, process_group=None)
BUF = 1 << 16
SMALL = StreamingConfig(pool_bytes=4 * BUF, buffer_bytes=BUF, read_threads=1)


def _plain_save(state, d) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(d), no_dist=True)


class _Marker:
    """Pickled as a call that creates a file: the proof that pickled code ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize(
    "storage", [StreamingStorage(SMALL), DCPStorage()], ids=["streaming", "dcp"]
)
def test_a_key_stored_as_pickled_bytes_is_refused_not_unpickled(tmp_path, storage):
    marker = tmp_path / "code_ran"
    _plain_save({"w": _Marker(str(marker))}, tmp_path / "ck")
    with pytest.raises(UnsafeCheckpointError, match=r"'w' as pickled bytes"):
        storage.read(tmp_path / "ck", {"w": torch.zeros(4)}, CTX)
    assert not marker.exists()


def _rewrite_data_pkl(archive: bytes, change) -> bytes:
    reader = torch._C.PyTorchFileReader(io.BytesIO(archive))
    out = io.BytesIO()
    writer = torch._C.PyTorchFileWriter(out)
    for name in reader.get_all_records():
        data = reader.get_record(name)
        if name.endswith("data.pkl"):
            data = change(data)
        writer.write_record(name, data, len(data))
    writer.write_end_of_file()
    return out.getvalue()


def test_a_data_pkl_that_builds_on_the_rebuild_function_is_refused_and_changes_nothing():
    buf = io.BytesIO()
    torch.save(torch.arange(6.0), buf)
    # BUILD on the allowed rebuild function: sets its __defaults__ so every later item reads as
    # negated.
    evil = (
        b"ctorch._utils\n_rebuild_tensor_v2\nN}X\x0c\x00\x00\x00__defaults__"
        b"NN}X\x03\x00\x00\x00neg\x88s\x87s\x86b0"
    )
    bad = _rewrite_data_pkl(buf.getvalue(), lambda d: d[:2] + evil + d[2:])
    with pytest.raises(UnsafeCheckpointError, match="BUILD"):
        _format.read_record(io.BytesIO(bad), "evil item")
    assert _format._rebuild_v2.__defaults__ == (None, None, None)
    assert _format.read_record(io.BytesIO(buf.getvalue()), "clean").neg is False


def test_a_metadata_that_builds_on_a_dcp_class_is_refused_and_the_class_restored(tmp_path):
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    _plain_save({"w": torch.ones(3)}, tmp_path)
    data = (tmp_path / ".metadata").read_bytes()
    evil = (
        b"ctorch.distributed.checkpoint.filesystem\n_StorageInfo\n"
        b"N}X\x0d\x00\x00\x00relative_pathX\x03\x00\x00\x00../s\x86b0"
    )
    (tmp_path / ".metadata").write_bytes(data[:2] + evil + data[2:])
    with pytest.raises(UnsafeCheckpointError, match="_StorageInfo"):
        read_dcp_metadata(tmp_path)
    assert "relative_path" not in vars(_StorageInfo)


def test_a_layout_that_overruns_its_storage_is_refused_not_read_from_the_next_item(tmp_path):
    # One byte of item a's data.pkl: stride 256 -> 512 (its view now reaches past its storage into
    # item b).
    a, b = torch.randn(128, 256), torch.randn(64, 256)
    _plain_save({"a": a, "b": b}, tmp_path)
    md = read_dcp_metadata(tmp_path)
    info = next(v for k, v in md.storage_data.items() if k.fqn == "a")
    path = tmp_path / info.relative_path
    blob = bytearray(path.read_bytes())
    item = bytes(blob[info.offset : info.offset + info.length])
    changed = _rewrite_data_pkl(
        item, lambda d: d.replace(b"M\x00\x01K\x01\x86", b"M\x00\x02K\x01\x86", 1)
    )
    assert len(changed) == len(item) and changed != item
    blob[info.offset : info.offset + info.length] = changed
    path.write_bytes(bytes(blob))
    with pytest.raises(CheckpointCorruptError, match="reaches element"):
        StreamingStorage(SMALL).read(
            tmp_path, {"a": torch.zeros_like(a), "b": torch.zeros_like(b)}, CTX
        )


class _StagingPlanner(DefaultLoadPlanner):
    """Targets are staging tensors, copied in at commit (DCP's LoadPlanner contract allows it)."""

    def __init__(self) -> None:
        super().__init__()
        self.resolved = 0

    def resolve_tensor(self, req):
        self.resolved += 1
        return torch.empty_like(super().resolve_tensor(req))

    def commit_tensor(self, req, tensor):
        super().resolve_tensor(req).copy_(tensor)


def test_an_item_read_again_lands_in_the_target_that_is_committed(tmp_path):
    # A transposed tensor saved by plain DCP has a compact frame's length: its guess fails its head
    # check and it is read again. The second read must fill the target resolved the first time.
    base = torch.randn(64, 2048, generator=torch.Generator().manual_seed(3))
    state = {"t": base.t(), "c": base.clone()}
    _plain_save(state, tmp_path)
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    planner = _StagingPlanner()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reader = StreamingReader(Path(tmp_path), StreamingStorage(SMALL), IOStats(), pin=False)
        dcp.load(out, storage_reader=reader, planner=planner, no_dist=True)
    assert planner.resolved == 2
    assert torch.equal(out["t"], state["t"]) and torch.equal(out["c"], state["c"])


def test_a_stall_names_the_reads_in_flight_and_does_not_wait_a_second_timeout(
    tmp_path, monkeypatch
):
    state = {f"w{i}": torch.randn(40_000) for i in range(6)}
    StreamingStorage(SMALL).write(tmp_path, state, CTX)
    real = _fastio_pool._preadv
    unblock = threading.Event()

    def slow(fd, views, off):
        if off > 200_000:
            unblock.wait(20)  # stalled until the test has its figures
        return real(fd, views, off)

    monkeypatch.setattr(_fastio_pool, "_preadv", slow)
    raised: list[float] = []  # when the reader's wait for data gave up
    real_next = ItemReader._next

    def timed_next(self, ready):
        try:
            return real_next(self, ready)
        except StorageStallError:
            raised.append(time.monotonic())
            raise

    monkeypatch.setattr(ItemReader, "_next", timed_next)
    cfg = StreamingConfig(pool_bytes=4 * BUF, buffer_bytes=BUF, read_threads=2, stall_timeout_s=6.0)
    threads = threading.active_count()
    with pytest.raises(StorageStallError, match=r"reads in flight: .*__0_0\.distcp at offset \d+"):
        StreamingStorage(cfg).read(
            tmp_path, {k: torch.zeros_like(v) for k, v in state.items()}, CTX
        )
    ended = time.monotonic()
    unblock.set()
    assert len(raised) == 1, raised
    # After the stall only the 1 s grace for the stalled threads, not a second 6 s timeout.
    assert ended - raised[0] < 4.0, ended - raised[0]
    deadline = time.monotonic() + 20  # the blocked threads finish and close their own files
    while threading.active_count() > threads and time.monotonic() < deadline:
        time.sleep(0.05)


def test_an_io_error_while_parsing_an_item_is_the_io_error_with_path_and_offset(
    tmp_path, monkeypatch
):
    z = torch.randn(200, 200, dtype=torch.complex64)
    _plain_save({"z": z.conj()}, tmp_path)  # the conj bit: parsed, not guessed

    def eio(fd, n, off):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "pread", eio)
    with pytest.raises(OSError) as info:
        StreamingStorage(SMALL).read(tmp_path, {"z": torch.zeros_like(z)}, CTX)
    assert not isinstance(info.value, CheckpointCorruptError)
    assert info.value.errno == errno.EIO and info.value.filename == str(tmp_path / "__0_0.distcp")
    assert info.value.offset is not None


def test_a_reader_reads_again_when_reused(tmp_path):
    from ckptguard.storage._pool import BufferPool

    state = {"a": torch.randn(50_000), "b": torch.randn(10)}
    StreamingStorage(SMALL).write(tmp_path, state, CTX)
    with BufferPool(count=4, size=BUF, pin=False, timeout_s=30) as pool:
        reader = ItemReader(pool, IOStats(), drop_cache=False, threads=2)

        class _Reuse(StreamingReader):
            def read_data(self, plan, planner):
                from torch.futures import Future

                reader.read(Path(self.path), plan.items, self.storage_data, planner, self._metadata)
                fut = Future()
                fut.set_result(None)
                return fut

        for _ in range(2):
            out = {k: torch.zeros_like(v) for k, v in state.items()}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.load(
                    out,
                    storage_reader=_Reuse(
                        Path(tmp_path), StreamingStorage(SMALL), IOStats(), pin=False
                    ),
                    no_dist=True,
                )
            assert all(torch.equal(out[k], state[k]) for k in state)
