"""A restore reads the start of its data file while it checks and plans, and leaves no page cache
behind.

``storage._pool.ReadAhead``: one regular file, at most ``limit`` bytes, halted before the restore's
own read, its pages dropped at close; a link or a FIFO planted in the file's place is never read
(and never hangs it). Page-cache residency is read with ``mincore`` (not meaningful on tmpfs, where
every page is resident: skipped).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time

import numpy as np
import pytest
import torch

import ckptguard as cg
from ckptguard.storage import _pool
from ckptguard.storage._pool import ReadAhead
from ckptguard.storage._reader import ItemReader

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _pages(path, offset: int = 0, length: int | None = None) -> list[bool]:
    """Which pages of ``path`` in [offset, offset + length) are in the page cache now (``mincore``
    over a read-only mapping: nothing is read)."""
    length = os.path.getsize(path) - offset if length is None else length
    fd = os.open(path, os.O_RDONLY)
    try:
        mapped = mmap.mmap(fd, length, prot=mmap.PROT_READ, offset=offset)
    finally:
        os.close(fd)
    try:
        pages = (ctypes.c_ubyte * ((length + _PAGE - 1) // _PAGE))()
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        address = np.frombuffer(mapped, dtype=np.uint8).ctypes.data
        assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(length), pages) == 0, (
            ctypes.get_errno()
        )
        return [bool(p & 1) for p in pages]
    finally:
        mapped.close()


def _resident(path) -> int:
    """Bytes of ``path`` in the page cache now."""
    return sum(_pages(path)) * _PAGE


def _resident_at(path, offset: int, length: int) -> bool:
    """Every page of ``path`` in [offset, offset + length) is in the page cache."""
    return all(_pages(path, offset, length))


def _cold_file(path, size: int) -> None:
    path.write_bytes(os.urandom(size))
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    if _resident(path):
        pytest.skip(
            f"{path.parent} keeps every page resident (tmpfs?): residency says nothing here"
        )


def test_it_reads_the_start_of_each_part_into_the_cache_and_close_drops_it(tmp_path):
    path = tmp_path / "__0_0.distcp"
    _cold_file(path, 24 << 20)
    ahead = ReadAhead(
        path, limit=8 << 20, streams=4
    ).start()  # 4 parts of 6 MiB: the first 2 MiB of each
    deadline = time.monotonic() + 30
    while ahead.done < (8 << 20) and time.monotonic() < deadline:
        time.sleep(0.01)
    ahead.halt()
    assert ahead.done == 8 << 20, "the limit, no more and no less"
    assert _resident(path) >= 8 << 20, (
        "the parts' starts are in the page cache for the restore's read threads"
    )
    assert all(_resident_at(path, i * (6 << 20), 2 << 20) for i in range(4)), (
        "each part's first 2 MiB"
    )
    ahead.close()
    assert _resident(path) == 0, (
        "close drops what the read-ahead read: a restore leaves no page cache behind"
    )


def test_halt_stops_it_between_two_reads(tmp_path):
    path = tmp_path / "sparse.distcp"
    with open(path, "wb") as f:
        f.truncate(8 << 30)  # sparse: 8 GiB of zeros, read at memory speed
    ahead = ReadAhead(path, limit=8 << 30).start()
    ahead.halt()
    assert not any(t.is_alive() for t in ahead._threads) and ahead.done < 8 << 30
    ahead.close()


@pytest.mark.parametrize("kind", ["symlink", "fifo", "absent"])
def test_a_link_a_fifo_or_no_file_is_never_read(tmp_path, kind):
    target = tmp_path / "elsewhere.bin"
    _cold_file(target, 4 << 20)
    path = tmp_path / "__0_0.distcp"
    if kind == "symlink":
        path.symlink_to(target)
    elif kind == "fifo":
        os.mkfifo(path)
    ahead = ReadAhead(path, limit=4 << 20).start()
    started = time.monotonic()
    ahead.close()
    assert time.monotonic() - started < 5, "a FIFO must not hold the thread in open()"
    assert ahead.done == 0 and _resident(target) == 0


def test_a_restore_reads_its_own_data_file_ahead_and_leaves_no_page_cache(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 509)  # 509: not a multiple of 64
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    root = tmp_path / "ck"
    mgr = cg.CheckpointManager(root)
    mgr.save(1, {"model": model, "optim": opt})
    mgr.close()
    data = root / "step_00000001" / "state" / "__0_0.distcp"
    assert data.is_file()
    fd = os.open(data, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    if _resident(data):
        pytest.skip("every page resident (tmpfs?)")
    started: list[ReadAhead] = []
    real_start = ReadAhead.start

    def record(self: ReadAhead) -> ReadAhead:
        started.append(self)
        return real_start(self)

    monkeypatch.setattr(ReadAhead, "start", record)
    halted_before_read: list[bool] = []
    fresh = torch.nn.Linear(512, 509)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    fresh(torch.randn(4, 512)).sum().backward()
    fresh_opt.step()
    real_run = ItemReader._run

    def run(self, spans):
        halted_before_read.append(all(a._halt.is_set() for a in started))
        return real_run(self, spans)

    monkeypatch.setattr(ItemReader, "_run", run)
    mgr = cg.CheckpointManager(root)
    assert mgr.restore({"model": fresh, "optim": fresh_opt}) == 1
    mgr.close()
    assert [a.path for a in started] == [data], "the rank's own data file, once"
    assert halted_before_read == [True], (
        "halted before the read's threads start: it would trail them"
    )
    assert _resident(data) == 0, "neither the read-ahead nor the read left the file's pages cached"
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert _pool.default_limit() > 0


def test_with_drop_page_cache_off_the_read_ahead_keeps_the_pages(tmp_path):
    path = tmp_path / "__0_0.distcp"
    _cold_file(path, 8 << 20)
    with open(path, "rb") as f:
        f.read()  # the user's warm cache, which StreamingConfig(drop_page_cache=False) asks to keep
    warm = _resident(path)
    ahead = ReadAhead(path, limit=8 << 20, drop=False).start()
    ahead.close()
    assert warm > 0 and _resident(path) == warm, "close dropped pages the user asked to keep"
