"""StreamingStorage on one process: bitwise round trips (our reader and plain DCP), checksums
from the stream equal a re-read, exact bytes of views, I/O failures with errno and offset,
the pool handed back, and the full CheckpointManager path."""

from __future__ import annotations

import errno
import io
import os
import pickle
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptguard as cg
from ckptguard._disk.digest import file_digest
from ckptguard.demo.toyjob import build_job, fingerprint, train_step
from ckptguard.errors import ConfigError, UnsafeCheckpointError
from ckptguard.storage import _pool as _fastio_pool
from ckptguard.storage._format import item_frame, read_record
from ckptguard.storage.base import StorageContext
from ckptguard.storage.streaming import StreamingConfig, StreamingStorage

CTX = StorageContext(rank=0, world_size=1, process_group=None)
# An odd buffer size, so the test can find (or not find) exactly these mappings in /proc/self/maps.
BUF = 61 * 4096
SMALL = StreamingConfig(pool_bytes=3 * BUF, buffer_bytes=BUF, writeback_bytes=64 * 1024)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(300, 1000, generator=g)
    return {
        "plain": torch.randn(10, 20, generator=g),
        "view": big[5:7, 3:9],  # 48 B of a 1.2 MB storage
        "transposed": big.t(),  # non-contiguous, larger than a buffer
        "rows": big[::3, ::2],  # strided both ways
        "wide_t": torch.randn(
            70_000, 2, generator=g
        ).t(),  # one non-contiguous row larger than a buffer
        "big": big,  # contiguous CPU, written in place
        "bf16": torch.randn(33, generator=g).bfloat16(),
        "flag": torch.tensor(True),
        "empty": torch.empty(0, 5),
        "int8": torch.arange(-5, 100, dtype=torch.int8),
        "f8": torch.randn(17, generator=g).to(torch.float8_e4m3fn),
        "conj": torch.randn(4, dtype=torch.complex64, generator=g).conj(),
    }


def _zeros(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = (x.resolve_conj().contiguous().reshape(-1).view(torch.uint8) for x in (a, b))
    return torch.equal(a, b)


def _pool_mappings() -> int:
    count = 0
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            count += hi - lo == BUF
    return count


def _plain_load(state_dir: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = _zeros(like)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, checkpoint_id=str(state_dir), no_dist=True)
    return out


def test_roundtrip_is_bitwise_via_our_reader_and_plain_dcp(tmp_path):
    state = _state()
    storage = StreamingStorage(SMALL)
    storage.write(tmp_path / "warm", {"x": torch.ones(3)}, CTX)  # imports and threads settle first
    before = _pool_mappings()
    files = storage.write(tmp_path, state, CTX)
    assert _pool_mappings() == before, "the pool's buffers must be unmapped after write"
    assert storage.last_stats.pool_bytes == 3 * BUF and storage.last_stats.bytes > 1_200_000

    assert [f.path for f in files] == ["state/.metadata", "state/__0_0.distcp"]
    for f in files:  # checksums taken from the stream equal a re-read of the file
        assert file_digest(str(tmp_path / Path(f.path).name)) == (f.size, f.xxh3)

    ours = _zeros(state)
    storage.read(tmp_path, ours, CTX)
    assert _pool_mappings() == before, "the pool's buffers must be unmapped after read"
    plain = _plain_load(tmp_path, state)
    for key, want in state.items():
        assert _bitwise(ours[key], want), key
        assert _bitwise(plain[key], want), key


def test_a_view_writes_only_its_own_bytes(tmp_path):
    base = torch.randn(1024, 1024)  # 4 MiB storage
    view = base[100, 3:403]  # 1.6 KB
    StreamingStorage(SMALL).write(tmp_path, {"v": view}, CTX)
    md = StreamingStorage().read_metadata(tmp_path)
    (info,) = md.storage_data.values()
    frame = item_frame((400,), torch.float32)
    assert info.length == frame.size == len(frame.head) + 1600 + len(frame.tail)
    assert info.length < 4096 and os.path.getsize(tmp_path / "__0_0.distcp") == info.length
    assert _bitwise(_plain_load(tmp_path, {"v": view})["v"], view)


def test_reads_files_written_by_plain_dcp_in_bounded_blocks(tmp_path):
    state = _state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)  # keeps the transposed strides
    storage = StreamingStorage(SMALL)
    out = _zeros(state)
    storage.read(tmp_path, out, CTX)
    for key, want in state.items():
        assert _bitwise(out[key], want), key
    # 1.2 MB items went through 244 KiB buffers: many reads, never one item whole.
    assert storage.last_stats.pool_bytes == 3 * BUF


def test_frame_plus_raw_bytes_is_what_torch_load_reads():
    for shape, dtype in [
        ((3, 4), torch.float32),
        ((7,), torch.bfloat16),
        ((), torch.int64),
        ((2, 0), torch.float16),
    ]:
        t = torch.arange(max(1, torch.Size(shape).numel()), dtype=torch.float64)[
            : torch.Size(shape).numel()
        ]
        t = t.reshape(shape).to(dtype)
        frame = item_frame(shape, dtype)
        blob = (
            frame.head + t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() + frame.tail
        )
        back = torch.load(io.BytesIO(blob), weights_only=True)
        assert _bitwise(back, t)
        rec = read_record(io.BytesIO(blob), "test")
        assert (rec.size, rec.dtype) == (tuple(shape), dtype)
        if frame.data_bytes:
            assert rec.data_offset == len(frame.head)


def test_item_pickle_naming_any_other_global_is_refused():
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    buf = io.BytesIO()
    torch.save(Evil(), buf, pickle_module=pickle)
    with pytest.raises(UnsafeCheckpointError, match=r"(posix|os)\.system"):
        read_record(io.BytesIO(buf.getvalue()), "evil item")


def test_short_writes_continue_and_checksums_hold(tmp_path, monkeypatch):
    real = os.write

    def dribble(fd, data):
        return real(fd, data[:1000])

    monkeypatch.setattr(_fastio_pool, "_write", dribble)
    state = {"a": torch.randn(100_000), "b": torch.randn(7, 3)}
    storage = StreamingStorage(SMALL)
    files = storage.write(tmp_path, state, CTX)
    assert storage.last_stats.short_writes > 0
    for f in files:
        assert file_digest(str(tmp_path / Path(f.path).name)) == (f.size, f.xxh3)
    out = _plain_load(tmp_path, state)
    assert all(_bitwise(out[k], state[k]) for k in state)


def test_a_write_returning_zero_raises_with_offset_and_counts(tmp_path, monkeypatch):
    real = os.write
    limit = 300_000
    written = {"n": 0}

    def stuck(fd, data):
        n = min(len(data), limit - written["n"])
        if n <= 0:
            return 0
        written["n"] += real(fd, data[:n])
        return n

    monkeypatch.setattr(_fastio_pool, "_write", stuck)
    before = _pool_mappings()
    with pytest.raises(OSError) as info:
        StreamingStorage(SMALL).write(tmp_path, {"a": torch.randn(200_000)}, CTX)
    exc = info.value
    assert exc.errno == errno.EIO and exc.filename == str(tmp_path / "__0_0.distcp")
    assert exc.offset == limit and exc.returned_bytes == 0 and exc.requested_bytes > 0
    assert _pool_mappings() == before
    assert not (tmp_path / ".metadata").exists()


@pytest.fixture
def tiny_tmpfs(tmp_path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True
    )
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_disk_full_mid_stream_raises_enospc_with_offset(tiny_tmpfs):
    tensor = torch.randn(1 << 20)  # 4 MiB onto a 1 MiB filesystem
    with pytest.raises(OSError) as info:
        StreamingStorage(SMALL).write(tiny_tmpfs, {"t": tensor}, CTX)
    exc = info.value
    assert exc.errno == errno.ENOSPC
    assert exc.filename == str(tiny_tmpfs / "__0_0.distcp")
    assert 0 < exc.offset <= 1 << 20 and exc.requested_bytes > 0 and exc.returned_bytes == -1
    # The commit protocol reads these through failure_from.
    from ckptguard._commit.messages import failure_from

    failure = failure_from(exc, rank=0, phase="write")
    assert (failure.errno, failure.offset, failure.returned_bytes) == (errno.ENOSPC, exc.offset, -1)


def test_truncated_file_raises_on_read(tmp_path):
    state = {"a": torch.randn(100_000)}
    storage = StreamingStorage(SMALL)
    storage.write(tmp_path, state, CTX)
    data = tmp_path / "__0_0.distcp"
    os.truncate(data, os.path.getsize(data) // 2)
    with pytest.raises((OSError, cg.CheckpointCorruptError)):
        storage.read(tmp_path, _zeros(state), CTX)


def test_manager_save_and_restore_through_streaming_storage(tmp_path):
    job = build_job()
    for _ in range(3):
        train_step(job)
    mgr = cg.CheckpointManager(tmp_path / "ck", storage=StreamingStorage(SMALL))
    step_dir = mgr.save(3, {**job.state(), "buf": torch.arange(10.0)[2:6]})
    fresh = build_job(seed=5)
    state = {**fresh.state(), "buf": torch.zeros(4)}
    assert mgr.restore(state) == 3  # verify_restored compares every item's digest
    assert fingerprint(fresh) == fingerprint(job)
    assert torch.equal(state["buf"], torch.arange(2.0, 6.0))
    # A manager with the default storage reads what the streaming one wrote.
    again = build_job(seed=6)
    assert (
        cg.CheckpointManager(tmp_path / "ck").restore({**again.state(), "buf": torch.zeros(4)}) == 3
    )
    assert fingerprint(again) == fingerprint(job)
    assert (step_dir / "state" / ".metadata").exists()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("buffer_bytes", 1000),
        ("buffer_bytes", True),
        ("pool_bytes", 4096),
        ("writeback_bytes", 0),
        ("pin_memory", 1),
        ("stall_timeout_s", float("nan")),
    ],
)
def test_config_rejects_bad_fields_by_name(field, value):
    kwargs = {"pool_bytes": 8 * 4096, "buffer_bytes": 4096, field: value}
    with pytest.raises(ConfigError, match=f"StreamingConfig.{field}"):
        StreamingConfig(**kwargs)
    with pytest.raises(TypeError):
        StreamingConfig(1 << 20)  # keyword-only


def _counting_preadv(monkeypatch, *, most: int | None = None) -> dict[str, int]:
    real, calls = os.preadv, {"n": 0}

    def counted(fd, views, offset):
        calls["n"] += 1
        if (
            most is not None
        ):  # a short read every time: at most this many bytes, across any of the views
            views, left = list(views), most
            out = []
            for v in views:
                if left <= 0:
                    break
                out.append(v[:left])
                left -= len(out[-1])
            views = out
        return real(fd, views, offset)

    monkeypatch.setattr(_fastio_pool, "_preadv", counted)
    return calls


def test_many_small_tensors_are_read_in_buffer_sized_requests(tmp_path, monkeypatch):
    # A model's norms, biases and optimizer step counters: hundreds of items of a few KiB.
    # One request per item left a cold disk waiting on each; they arrive in a few spans now.
    g = torch.Generator().manual_seed(1)
    state = {f"norm{i}": torch.randn(1024, generator=g) for i in range(300)}
    state["big"] = torch.randn(600_000, generator=g)  # 2.4 MB: several buffers of 1 MiB
    cfg = StreamingConfig(pool_bytes=4 << 20, buffer_bytes=1 << 20, read_threads=2)
    StreamingStorage(cfg).write(tmp_path, state, CTX)
    size = os.path.getsize(tmp_path / "__0_0.distcp")
    calls = _counting_preadv(monkeypatch)
    out = _zeros(state)
    StreamingStorage(cfg).read(tmp_path, out, CTX)
    assert all(_bitwise(out[k], state[k]) for k in state)
    assert calls["n"] <= size // (1 << 20) + 4, f"{calls['n']} reads of a {size} B file"


def test_several_read_threads_each_read_a_stretch_and_close_their_files(tmp_path):
    g = torch.Generator().manual_seed(2)
    state = {f"w{i}": torch.randn(50_000 + i, generator=g) for i in range(12)}
    StreamingStorage(SMALL).write(tmp_path, state, CTX)
    before = len(os.listdir("/proc/self/fd"))
    for threads in (1, 2, 3):
        out = _zeros(state)
        StreamingStorage(
            StreamingConfig(pool_bytes=4 * BUF, buffer_bytes=BUF, read_threads=threads)
        ).read(tmp_path, out, CTX)
        assert all(_bitwise(out[k], state[k]) for k in state), threads
    assert len(os.listdir("/proc/self/fd")) == before, "a reader thread left a file open"


def test_a_short_read_continues_inside_a_span(tmp_path, monkeypatch):
    state = _state()
    StreamingStorage(SMALL).write(tmp_path, state, CTX)
    calls = _counting_preadv(monkeypatch, most=777)
    out = _zeros(state)
    StreamingStorage(SMALL).read(tmp_path, out, CTX)
    assert calls["n"] > 100
    for key, want in state.items():
        assert _bitwise(out[key], want), key


@pytest.mark.parametrize("part", ["head", "tail"])
def test_an_item_whose_frame_head_differs_is_parsed_and_read_again(tmp_path, monkeypatch, part):
    # The reader guesses an item's layout from ckptguard's own frame and checks the frame's head
    # (what places the bytes) as it arrives; where it differs (another writer, another torch), the
    # guess must not stand. The tail (CRCs, central directory) places nothing and costs no re-read.
    from ckptguard.storage import _reader, _spans

    state = {
        "a": torch.randn(300, 1000),
        "b": torch.randn(70_000).bfloat16(),
        "small": torch.randn(5),
    }
    StreamingStorage(SMALL).write(tmp_path, state, CTX)
    real = _spans.item_frame

    def other(shape, dtype):
        frame = real(shape, dtype)
        if part == "head":
            return type(frame)(
                frame.head[:-1] + bytes([frame.head[-1] ^ 1]), frame.data_bytes, frame.tail
            )
        return type(frame)(
            frame.head, frame.data_bytes, bytes([frame.tail[0] ^ 1]) + frame.tail[1:]
        )

    parsed = {"n": 0}
    real_record = _reader.read_record

    def counted(f, where):
        parsed["n"] += 1
        return real_record(f, where)

    monkeypatch.setattr(_spans, "item_frame", other)
    monkeypatch.setattr(_reader, "read_record", counted)
    out = {k: torch.full_like(v, 7) for k, v in state.items()}
    StreamingStorage(SMALL).read(tmp_path, out, CTX)
    for key, want in state.items():
        assert _bitwise(out[key], want), key
    # head: the two large items parsed after their check failed, the small one as always; tail: the
    # small one
    assert parsed["n"] == (3 if part == "head" else 1)


def test_a_plain_dcp_item_with_another_layout_is_not_read_by_the_guess(tmp_path):
    # A transposed tensor saved by plain dcp.save keeps its strides: same length as a compact
    # frame of its shape when the pickle happens to be as long, but its bytes are in another order.
    g = torch.Generator().manual_seed(3)
    base = torch.randn(64, 2048, generator=g)
    state = {"t": base.t(), "c": base.clone()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    out = _zeros(state)
    StreamingStorage(SMALL).read(tmp_path, out, CTX)
    for key, want in state.items():
        assert _bitwise(out[key], want), key
