"""The layout-free digest: a digest of a tensor that no sharding changes (``box_sum``).

Each element's bytes are weighted by its global position, so the sum of the partial digests of
any partition of a tensor (FSDP shards, TP slices, expert groups) equals the digest of the
whole; a resharded restore is then proven item by item (``_resume/layoutcheck``).

How: A tensor's bytes in global row-major order are read as 64-bit little-endian words W_j
(the last one zero-padded). Its layout-free sum is sum_j W_j * P[j mod B] * S(j div B)
mod 2**64, with P a fixed table of odd weights and S an odd mix of the block index. The sum
is linear in the bytes, so every rank sums the runs of global words its shard covers (a
run may start or end inside a word: its bytes sit at their positions, zeros elsewhere) and
the per-shard sums add up to the whole tensor's under any sharding. Odd weights make any
one changed word change the sum; the position weights make moved data change it. On the CPU
one einsum over uint64 blocks runs at about 0.7x of xxh3's speed on one core (a scalar 64-bit
multiply a word: no faster form of this sum exists in numpy or torch, plain sums of rows and
columns measured slower), so the pass is spread over the cores; on a GPU it is two int64 reductions.
A box split on an inner dimension (TP) is summed run by run, its runs placed by ``boxrows``.
"""

from __future__ import annotations

import collections
import itertools
import os
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import xxhash
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from .boxrows import box_runs, rows_sum
from .digest import Feed, tensor_bytes_view, update_digest

_MASK = (1 << 64) - 1
_LF_BLOCK = 1024  # words per block: one position weight each


_LF_GPU_WORDS = 8 << 20  # words per GPU pass, bounding the temporary product


def _splitmix(x: Any) -> Any:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


_POS = _splitmix(np.arange(_LF_BLOCK, dtype=np.uint64) + np.uint64(0x5EED)) | np.uint64(1)
_POS_DEVICE: dict[str, torch.Tensor] = {}


def _mix_blocks(first: int, count: int) -> np.ndarray:
    mixed = _splitmix(
        np.arange(first, first + count, dtype=np.uint64) ^ np.uint64(0xD1B54A32D192ED03)
    )
    # numpy types uint64 operators as Any
    return mixed | np.uint64(1)  # type: ignore[no-any-return]


_BLOCKS_CACHED = (
    1 << 14
)  # the weights of the first 16384 blocks (tensors up to 128 MiB), computed once
_BW = _mix_blocks(0, _BLOCKS_CACHED)


def _block_weights(first: int, count: int) -> np.ndarray:
    if first + count <= _BLOCKS_CACHED:
        return _BW[first : first + count]
    return _mix_blocks(first, count)


def _word_weight(j: int) -> int:
    return int(_POS[j % _LF_BLOCK]) * int(_block_weights(j // _LF_BLOCK, 1)[0]) & _MASK


# The layout-free pass is split into pieces of about _PIECE_WORDS words that the pool's threads take
# from the oldest end of a queue while the caller takes the newest (still in its cache): on 2 cores
# both cores sum, and in the save's pass the caller hashes with xxh3 and takes only what the pool
# has not reached. numpy's einsum and xxh3 release the GIL. The sum is linear, so pieces add up.
_PIECE_WORDS = (
    1 << 19
)  # 4 MiB per piece: smaller pieces streamed from DRAM ran up to a third slower
_THREADS = max(1, min(4, (os.cpu_count() or 2) - 1))
_POOL: tuple[int, ThreadPoolExecutor] | None = None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if (
        _POOL is None or _POOL[0] != os.getpid()
    ):  # a forked child gets a pool of its own (no threads came along)
        _POOL = (
            os.getpid(),
            ThreadPoolExecutor(_THREADS, thread_name_prefix="ckptguard-layout-free"),
        )
    return _POOL[1]


class _Shared:
    """A queue of layout-free pieces summed by the pool and the caller, added up per key.

    Use as a context manager: leaving it (also on an error) stops the pool's workers, which
    otherwise wait for pieces forever."""

    def __init__(self) -> None:
        self._items: collections.deque[tuple[str, np.ndarray, int, int]] = collections.deque()
        self.batch = 0  # what ``put`` tags its pieces with (the save's pass: the chunk's number)
        self._cv = threading.Condition()
        self._closed = False
        self._error: BaseException | None = None
        self.sums: dict[str, int] = {}
        self._workers = [_pool().submit(self._work) for _ in range(_THREADS)]

    def __enter__(self) -> _Shared:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add(self, key: str, value: int) -> None:
        with self._cv:
            self.sums[key] = (self.sums.get(key, 0) + value) & _MASK

    def put(self, key: str, words: np.ndarray, j0: int) -> None:
        """Queue the sum of a run of whole words (uint64) at global word index ``j0``, in pieces."""
        m = words.size
        if m <= _PIECE_WORDS:
            cuts = [0, m]
        else:
            cuts, at = (
                [0],
                _PIECE_WORDS - j0 % _LF_BLOCK,
            )  # pieces start on a block boundary of the global order
            while at < m:
                cuts.append(at)
                at += _PIECE_WORDS
            cuts.append(m)
        with self._cv:
            self._items.extend(
                (key, words[a:b], j0 + a, self.batch) for a, b in itertools.pairwise(cuts)
            )
            self._cv.notify(len(cuts) - 1)

    def _run(self, entry: tuple[str, np.ndarray, int, int]) -> None:
        key, words, j0, _ = entry
        self.add(key, _words_sum_serial(words, j0))

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._items and not self._closed:
                    self._cv.wait()
                if not self._items or self._error is not None:
                    return
                entry = self._items.popleft()
            try:
                self._run(entry)
            except (
                BaseException
            ) as exc:  # handed to the caller in result(), never lost in the thread
                with self._cv:
                    self._error = exc
                    self._items.clear()
                return

    def help(self, keep: int = 0) -> None:
        """Sum the newest pieces in this thread until at most ``keep`` are left for the pool."""
        while True:
            with self._cv:
                if len(self._items) <= keep or self._error is not None:
                    return
                entry = self._items.pop()
            self._run(entry)

    def help_through(self, batch: int) -> None:
        """Sum in this thread the oldest pieces tagged ``batch`` or earlier that the pool has not
        taken."""
        while True:
            with self._cv:
                if not self._items or self._items[0][3] > batch or self._error is not None:
                    return
                entry = self._items.popleft()
            self._run(entry)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for f in self._workers:  # a worker that never started (the pool busy elsewhere) is dropped
            if not f.cancel():
                f.result()

    def result(self) -> dict[str, int]:
        self.help(0)
        self.close()
        if self._error is not None:
            raise self._error
        return self.sums


def _words_sum_cpu(words: np.ndarray, j0: int, parallel: bool = True) -> int:
    if not parallel or words.size <= 2 * _PIECE_WORDS:
        return _words_sum_serial(words, j0)
    with _Shared() as shared:
        shared.put("", words, j0)
        return shared.result().get("", 0)


def _words_sum_serial(words: np.ndarray, j0: int) -> int:
    """sum of words[i] * weight(j0 + i) over a run of whole words (uint64, aligned)."""
    m, i, total = words.size, 0, 0
    k0 = j0 % _LF_BLOCK
    if k0:  # the run starts inside a block
        c = min(m, _LF_BLOCK - k0)
        total += int(np.einsum("i,i->", words[:c], _POS[k0 : k0 + c])) * int(
            _block_weights(j0 // _LF_BLOCK, 1)[0]
        )
        i = c
    nb = (m - i) // _LF_BLOCK
    if nb:
        per_block = np.einsum("ij,j->i", words[i : i + nb * _LF_BLOCK].reshape(nb, _LF_BLOCK), _POS)
        total += int(np.einsum("i,i->", per_block, _block_weights((j0 + i) // _LF_BLOCK, nb)))
        i += nb * _LF_BLOCK
    if i < m:
        c = m - i
        total += int(np.einsum("i,i->", words[i:], _POS[:c])) * int(
            _block_weights((j0 + i) // _LF_BLOCK, 1)[0]
        )
    return total & _MASK


def _words_sum_cuda(words: torch.Tensor, j0: int) -> int:
    """The same sum on the GPU: int64 arithmetic wraps like uint64 modulo 2**64."""
    dev = str(words.device)
    pos = _POS_DEVICE.get(dev)
    if pos is None:
        pos = _POS_DEVICE[dev] = torch.from_numpy(_POS.view(np.int64).copy()).to(words.device)
    m, i, total = words.numel(), 0, 0
    k0 = j0 % _LF_BLOCK
    if k0:
        c = min(m, _LF_BLOCK - k0)
        head = int((words[:c] * pos[k0 : k0 + c]).sum().item())
        total += head * int(_block_weights(j0 // _LF_BLOCK, 1)[0])
        i = c
    while (m - i) // _LF_BLOCK:
        nb = min((m - i) // _LF_BLOCK, _LF_GPU_WORDS // _LF_BLOCK)
        per_block = (words[i : i + nb * _LF_BLOCK].view(nb, _LF_BLOCK) * pos).sum(dim=1)
        weights = torch.from_numpy(_block_weights((j0 + i) // _LF_BLOCK, nb).view(np.int64)).to(
            words.device
        )
        total += int((per_block * weights).sum().item())
        i += nb * _LF_BLOCK
    if i < m:
        c = m - i
        tail = int((words[i:] * pos[:c]).sum().item())
        total += tail * int(_block_weights((j0 + i) // _LF_BLOCK, 1)[0])
    return total & _MASK


def _bytes_sum(
    flat: torch.Tensor, start: int, parallel: bool = True, into: _Into | None = None
) -> int:
    """The layout-free sum of ``flat`` (uint8, contiguous) placed at global byte offset ``start``.

    With ``into`` (a CPU tensor), the whole words are queued there and only the partial words
    at either end are summed here."""
    n = flat.numel()
    total = 0
    head = min((-start) % 8, n)
    if head:  # a partial first word: its bytes at their positions inside the word
        word = int.from_bytes(bytes(start % 8) + flat[:head].cpu().numpy().tobytes(), "little")
        total += word * _word_weight(start // 8)
    m = (n - head) // 8
    j0 = (start + head) // 8
    if m:
        body = flat[head : head + 8 * m]
        if flat.device.type == "cuda":
            if body.storage_offset() % 8 or body.data_ptr() % 8:
                body = body.clone()
            total += _words_sum_cuda(body.view(torch.int64), j0)
        else:
            arr = body.cpu().numpy()
            if arr.ctypes.data % 8:
                arr = arr.copy()
            if into is not None:
                into[0].put(into[1], arr.view(np.uint64), j0)
            else:
                total += _words_sum_cpu(arr.view(np.uint64), j0, parallel)
    tail = n - head - 8 * m
    if tail:
        word = int.from_bytes(flat[head + 8 * m :].cpu().numpy().tobytes(), "little")
        total += word * _word_weight(j0 + m)
    return total & _MASK


_Into = tuple[_Shared, str]


def _weights_at(j: np.ndarray) -> np.ndarray:
    """The weight of every global word index in ``j`` (uint64, any shape)."""
    blocks = j // np.uint64(_LF_BLOCK)
    if blocks.size and int(blocks.max()) >= _BLOCKS_CACHED:
        bw = _splitmix(blocks ^ np.uint64(0xD1B54A32D192ED03)) | np.uint64(1)
    else:
        bw = _BW[blocks]
    # wraps modulo 2**64, as the sum does
    return _POS[j % np.uint64(_LF_BLOCK)] * bw  # type: ignore[no-any-return]


def _global_offset(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """This rank's piece of ``t`` and where it starts in the global tensor."""
    if hasattr(t, "device_mesh") and hasattr(t, "placements"):
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        local = t.to_local()  # type: ignore[attr-defined]  # a DTensor; torch types it as Tensor
        if tuple(local.shape) != tuple(shape):  # a padded local shard: only the real part counts
            local = local[tuple(slice(0, int(s)) for s in shape)]
        return local, tuple(int(o) for o in offset)
    return t, (0,) * t.dim()


def layout_free_partial(t: torch.Tensor) -> tuple[str, tuple[int, ...], int]:
    """(header, global offset, partial sum) of this rank's piece of ``t``.

    The piece is a box of the global tensor; every run of it that is contiguous in the global
    row-major order (all of it, when only the first dimension is split) is summed at its place.
    """
    local, offset = _global_offset(t)
    gshape = tuple(int(s) for s in t.shape)
    return f"{local.dtype}|{gshape}", offset, box_sum(local, offset, gshape)


def box_sum(
    local: torch.Tensor, offset: tuple[int, ...], gshape: tuple[int, ...], into: _Into | None = None
) -> int:
    """The layout-free sum of ``local``, the box of a tensor of shape ``gshape`` at ``offset``.

    With ``into`` (a CPU tensor), the sum is added to ``into``'s key there (returns 0)."""
    if local.numel() == 0:
        return 0
    if into is not None and local.device.type != "cpu":
        into = None
    esize = local.element_size()
    flat = tensor_bytes_view(local.detach())
    lshape = tuple(int(s) for s in local.shape)
    split = [d for d in range(len(gshape)) if lshape[d] != gshape[d]]
    total = 0
    if not split or all(x == 1 for x in lshape[: split[-1]]):  # one run of the global order
        total = _bytes_sum(flat, _run_start(offset, gshape) * esize, into=into)
    else:  # a box split on an inner dimension: one run per row of the dims before the last split
        run, starts = box_runs(lshape, offset, gshape, split[-1])
        run_bytes, byte_starts = run * esize, starts * esize
        if run_bytes % 8 == 0 and not (byte_starts % 8).any():
            # TP Shard(1) and the like: every run is whole words, summed for many rows at once
            total = rows_sum(flat, run_bytes, byte_starts // 8, _weights_at)
        else:
            for r, at in enumerate(byte_starts.tolist()):
                total += _bytes_sum(flat[r * run_bytes : (r + 1) * run_bytes], at, into=into)
    if into is not None:
        into[0].add(into[1], total & _MASK)
        return 0
    return total & _MASK


def layout_free_partials(items: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, list[str]]:
    """This rank's part of every tensor item: ``{chunk id: [item, key, header, partial hex]}``.

    The chunk id is the DCP key and the piece's global offset: ranks holding the same chunk
    (replicas) report it alike and it is counted once (``combine_layout_free``). The CPU
    tensors' pieces go through one queue that the pool and this thread sum together."""
    out: dict[str, list[str]] = {}
    with _Shared() as shared:
        for item, tensors in items.items():
            for key, t in tensors.items():
                local, offset = _global_offset(t)
                gshape = tuple(int(s) for s in t.shape)
                cid = f"{key}@{offset}"
                out[cid] = [item, key, f"{local.dtype}|{gshape}", ""]
                shared.add(cid, box_sum(local, offset, gshape, (shared, cid)))
                shared.help(
                    _THREADS
                )  # this thread sums too, the newest pieces first (the hottest in cache)
        sums = shared.result()
    for cid, entry in out.items():
        entry[3] = f"{sums.get(cid, 0):016x}"
    return out


REPLICAS_DIFFER = "replicas differ"


def combine_layout_free(views: list[Mapping[str, list[str]]]) -> dict[str, dict[str, str]]:
    """Every rank's partials into ``{item: {key: digest}}``, which no sharding changes.

    A chunk reported by several ranks with different bytes gives the key the value
    ``REPLICAS_DIFFER`` (it never equals a recorded digest)."""
    chunks: dict[str, list[str]] = {}
    differ: set[tuple[str, str]] = set()
    for view in views:
        for cid, entry in view.items():
            item, key = entry[0], entry[1]
            prev = chunks.setdefault(cid, list(entry))
            if prev[2:] != list(entry[2:]):
                differ.add((item, key))
    sums: dict[tuple[str, str], list[Any]] = {}
    for item, key, header, part in chunks.values():
        acc = sums.setdefault((item, key), [header, 0])
        acc[1] = (acc[1] + int(part, 16)) & _MASK
    out: dict[str, dict[str, str]] = {}
    for (item, key), (header, total) in sorted(sums.items()):
        value = xxhash.xxh3_64(f"{header}|{total:016x}".encode()).hexdigest()
        out.setdefault(item, {})[key] = REPLICAS_DIFFER if (item, key) in differ else value
    return out


def _single_run(local: torch.Tensor, gshape: tuple[int, ...]) -> bool:
    """The piece is one run of the global row-major order (e.g. whole, or split on dim 0 only)."""
    lshape = tuple(int(x) for x in local.shape)
    split = [d for d in range(len(gshape)) if lshape[d] != gshape[d]]
    return not split or all(x == 1 for x in lshape[: split[-1]])


def _run_start(offset: tuple[int, ...], gshape: tuple[int, ...]) -> int:
    start, stride = 0, 1
    for d in range(len(gshape) - 1, -1, -1):
        start += offset[d] * stride
        stride *= gshape[d]
    return start


def digest_with_layout_free(
    obj: Any, keys: Mapping[str, torch.Tensor], item: str
) -> tuple[str, dict[str, list[str]]]:
    """``digest(obj)`` and, in the same pass over memory, the layout-free partials of its tensors.

    ``keys`` are the DCP keys of the tensors inside ``obj`` (by identity). The bytes of a CPU
    tensor are queued chunk by chunk one chunk ahead of xxh3 in this thread; the pool sums them,
    and this thread sums what the pool has not reached of the chunks it has hashed (one core's
    layout-free sum is slower than xxh3). Any other tensor is summed on its own (on a GPU, on
    the device)."""
    pending: dict[int, list[str]] = {}
    for key, t in keys.items():
        pending.setdefault(id(t), []).append(key)
    partials: dict[str, list[str]] = {}

    with _Shared() as shared:

        def on_tensor(t: torch.Tensor) -> Feed | None:
            names = pending.get(id(t))
            if not names:
                return None
            key = names.pop(0)
            local, offset = _global_offset(t)
            gshape = tuple(int(x) for x in t.shape)
            cid = f"{key}@{offset}"
            partials[cid] = [item, key, f"{local.dtype}|{gshape}", ""]
            whole = local.device.type == "cpu" and (
                not hasattr(t, "to_local") or t.to_local().shape == local.shape
            )
            if not (whole and _single_run(local, gshape)) or local.numel() == 0:
                shared.add(cid, box_sum(local, offset, gshape, (shared, cid)))
                return None
            base = _run_start(offset, gshape) * local.element_size()

            def feed(chunk: torch.Tensor, at: int) -> None:
                # xxh3 has read every chunk fed two calls ago (the feed runs a chunk ahead): what
                # the pool has not summed of those, this thread sums while it is still in its cache
                shared.help_through(shared.batch - 1)
                shared.batch += 1
                shared.add(cid, _bytes_sum(chunk, base + at, into=(shared, cid)))

            return feed

        h = xxhash.xxh3_64()
        update_digest(h, obj, on_tensor)
        for key, t in keys.items():  # a tensor the walk did not reach (none in a captured item)
            if key in pending.get(id(t), []):
                local, offset = _global_offset(t)
                gshape = tuple(int(x) for x in t.shape)
                cid = f"{key}@{offset}"
                partials[cid] = [item, key, f"{local.dtype}|{gshape}", ""]
                shared.add(cid, box_sum(local, offset, gshape, (shared, cid)))
        sums = shared.result()
    for cid, entry in partials.items():
        entry[3] = f"{sums.get(cid, 0):016x}"
    return h.hexdigest(), partials
