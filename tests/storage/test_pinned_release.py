"""Pinned host buffers have one owner and one release: unregistered before they are unmapped on
every path (close, a pool dropped without close, an exception midway, the interpreter's exit), and a
refused registration is reported as what it is (CUDA's error), the I/O going on with pageable
buffers.

CUDA is faked here with a runtime that behaves like the driver: a range stays registered until
unregistered, and registering an overlapping range fails with 712. The real driver:
test_staging_gpu.py and the GPU figures in benchmarks/results."""

from __future__ import annotations

import gc
import logging
import subprocess
import sys
import textwrap

import pytest

from ckptguard.errors import StorageStallError
from ckptguard.storage import _pool
from ckptguard.storage._pool import Buffer, BufferPool, PinError
from ckptguard.storage._staging import StagingPool


class FakeCudart:
    """Registered ranges as the driver keeps them."""

    def __init__(self, refuse_after: int | None = None, raise_after: int | None = None) -> None:
        self.ranges: dict[int, int] = {}
        self.calls = 0
        self.refuse_after, self.raise_after = refuse_after, raise_after

    def cudaHostRegister(self, addr: int, size: int, flags: int) -> int:
        self.calls += 1
        if self.raise_after is not None and self.calls > self.raise_after:
            raise RuntimeError("interrupted midway")
        if self.refuse_after is not None and self.calls > self.refuse_after:
            return 2
        if any(a < addr + size and addr < a + n for a, n in self.ranges.items()):
            return 712
        self.ranges[addr] = size
        return 0

    def cudaHostUnregister(self, addr: int) -> int:
        return 0 if self.ranges.pop(addr, None) is not None else 713


@pytest.fixture
def cudart(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(_pool, "_cudart", lambda: fake)
    return fake


def _made(pool: BufferPool, n: int) -> None:
    """``n`` buffers made (the pool makes them as ``get`` needs them), all back in the pool."""
    bufs = [pool.get("a test") for _ in range(n)]
    for buf in bufs:
        pool.put(buf)


def test_the_pool_makes_its_buffers_on_demand_up_to_its_count(cudart):
    pool = BufferPool(count=3, size=1 << 16, pin=True, timeout_s=0.2)
    assert len(cudart.ranges) == 1, (
        "one buffer at construction: the first byte must not wait for the others' pinning"
    )
    bufs = [pool.get("a test") for _ in range(3)]
    assert len(cudart.ranges) == 3 and pool.allocated_bytes == 3 << 16
    with pytest.raises(
        StorageStallError, match=r"no host buffer came free within 0\.2 s while a test"
    ):
        pool.get("a test")
    pool.put(bufs.pop())
    assert (
        pool.get("a test") is not None and len(cudart.ranges) == 3
    )  # a free one reused, none made past count
    pool.close()
    assert cudart.ranges == {} and pool.allocated_bytes == 0


def test_close_unregisters_every_buffer(cudart):
    pool = BufferPool(count=3, size=1 << 20, pin=True, timeout_s=5)
    _made(pool, 3)
    assert len(cudart.ranges) == 3 and all(b.pinned for b in pool._all)
    maps = [b._map for b in pool._all]
    pool.close()
    assert cudart.ranges == {}
    assert all(m is not None and m.closed for m in maps), (
        "close() unmaps at once: the pool holds no host memory"
    )


def test_a_pool_dropped_without_close_is_unregistered_when_collected(cudart):
    pool = StagingPool(pin=True)
    slots = pool.place([4096, 8192], budget=1 << 20)
    assert all(s is not None for s in slots) and len(cudart.ranges) == 1
    del pool, slots
    gc.collect()
    assert cudart.ranges == {}, (
        "a dropped pool left its range registered: the next buffer there fails with 712"
    )
    again = Buffer(1 << 20, True)  # the range the kernel hands out next registers
    assert again.pinned
    again.release()


def test_a_buffer_kept_alive_by_a_slot_is_unregistered_at_release_and_unmapped_with_the_slot(
    cudart,
):
    buf = Buffer(1 << 16, True)
    slot = buf.tensor[:64]
    buf.release()
    assert cudart.ranges == {}
    slot.fill_(1)  # still mapped: the last view holds the pages
    assert int(slot.sum()) == 64


def test_an_exception_midway_releases_what_was_registered(monkeypatch):
    fake = FakeCudart(raise_after=0)
    monkeypatch.setattr(_pool, "_cudart", lambda: fake)
    with pytest.raises(RuntimeError, match="midway"):
        BufferPool(
            count=4, size=1 << 16, pin=True, timeout_s=5
        )  # the first buffer, at construction
    gc.collect()
    assert fake.ranges == {}
    fake = FakeCudart(raise_after=2)
    monkeypatch.setattr(_pool, "_cudart", lambda: fake)
    pool = BufferPool(count=4, size=1 << 16, pin=True, timeout_s=5)
    held = [pool.get("a test")]
    held.append(pool.get("a test"))
    with pytest.raises(RuntimeError, match="midway"):
        pool.get("a test")  # a later buffer, made by a get
    pool.close()
    assert fake.ranges == {}


def test_a_refused_registration_names_cuda_s_error_and_the_pool_goes_on_pageable(
    monkeypatch, caplog
):
    fake = FakeCudart()
    fake.ranges[0] = 1 << 62  # what the driver holds for ranges unmapped without cudaHostUnregister
    monkeypatch.setattr(_pool, "_cudart", lambda: fake)
    with pytest.raises(PinError, match="HostMemoryAlreadyRegistered"):
        Buffer(1 << 20, True)
    refusing = FakeCudart(refuse_after=1)
    monkeypatch.setattr(_pool, "_cudart", lambda: refusing)
    with caplog.at_level(logging.WARNING, logger="ckptguard"):
        pool = BufferPool(count=3, size=1 << 16, pin=True, timeout_s=5)
        _made(pool, 3)
    assert [b.pinned for b in pool._all] == [True, False, False]
    assert "cudaErrorMemoryAllocation" in caplog.text and "pageable" in caplog.text
    buf = pool.get("a test")
    buf.view[:3] = b"abc"  # the pageable buffer works
    pool.put(buf)
    pool.close()
    assert refusing.ranges == {}


def test_the_interpreter_exit_unregisters_a_pool_never_closed(tmp_path):
    log = tmp_path / "unregistered.txt"
    code = textwrap.dedent(f"""
        from ckptguard.storage import _pool
        from ckptguard.storage._staging import StagingPool

        class Fake:
            def cudaHostRegister(self, addr, size, flags):
                return 0
            def cudaHostUnregister(self, addr):
                with open({str(log)!r}, "a") as f:
                    f.write(f"{{addr}}\\n")
                return 0

        fake = Fake()
        _pool._cudart = lambda: fake
        pool = StagingPool(pin=True)
        pool.place([1 << 16], budget=1 << 20)
        KEEP = pool  # alive until the interpreter exits
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert len(log.read_text().split()) == 1


def test_a_dropped_manager_s_prepared_pool_is_unregistered(tmp_path, cudart, monkeypatch):
    """Neither the idle timer's thread nor an optimizer's prepare-ahead hook keeps a dropped
    manager's pool."""
    import torch

    import ckptguard as cg
    from ckptguard._commit import pending

    monkeypatch.setattr(pending.StagingPool, "__init__", _pinned_init(pending.StagingPool.__init__))
    model = torch.nn.Linear(64, 64)
    optim = torch.optim.AdamW(model.parameters())
    state = {"model": model, "optim": optim}
    mgr = cg.CheckpointManager(tmp_path / "ck")
    mgr.restore(state)  # arms a post-step hook on the fresh optimizer
    model(torch.randn(2, 64)).sum().backward()
    optim.step()  # the hook prepares the pool
    mgr._staging.preparing.result(timeout=60)
    mgr.save_async(1, state).wait()  # the idle timer starts
    assert cudart.ranges
    other = cg.CheckpointManager(tmp_path / "other")
    other.restore(
        state
    )  # a hook that stays armed: this optimizer has state, so it prepares at once
    other._staging.preparing.result(timeout=60)
    del mgr, other
    import threading

    for t in threading.enumerate():  # the pinning threads end just after their futures are set
        if t.name.startswith("ckptguard-p"):
            t.join(10)
    gc.collect()
    assert cudart.ranges == {}


def _pinned_init(init):
    def pinned(self, *, pin, idle_s=None):
        init(
            self, pin=True, idle_s=idle_s
        )  # as on a GPU: the CPU state's pool is pinned through the fake

    return pinned


def test_no_memory_for_one_more_buffer_goes_on_with_those_made(monkeypatch, caplog):
    pool = BufferPool(count=4, size=1 << 16, pin=False, timeout_s=0.5)
    held = pool.get("a test")  # the one made at construction

    def no_memory(size: int, pin: bool) -> Buffer:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(BufferPool, "_buffer", staticmethod(no_memory))
    with caplog.at_level(logging.WARNING, logger="ckptguard"):
        pool.put(held)
        again = pool.get("reading a test")  # the free one, no new buffer needed
        pool.put(again)
        assert pool.get("reading a test") is again
        with pytest.raises(
            StorageStallError
        ):  # one buffer, held: a wait, then the stall (not ENOMEM)
            pool.get("reading a test")
    assert (
        pool.count == 1
        and "could not be made" in caplog.text
        and "going on with the 1 made" in caplog.text
    )
    pool.close()


def test_a_closed_pool_hands_out_no_buffer():
    pool = BufferPool(count=2, size=1 << 16, pin=False, timeout_s=5)
    pool.close()
    with pytest.raises(RuntimeError, match="pool is closed"):
        pool.get("a test")
