"""How the reader plans its reads: neighbouring pieces of one file merged into spans, each span
read in one ``preadv`` (``_reader.ItemReader``), and the checks of what a piece's head says.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CheckpointCorruptError
from ._format import Frame, Record, item_frame

SMALL_ITEM = 64 << 10  # items up to this size are read whole and parsed from the span's bytes


MERGE_GAP = (
    256 << 10
)  # bytes no item asks for that a span reads through rather than start another request


ALIGN = 64  # where each piece starts in a buffer: any dtype's view of it is aligned


MAX_PIECES = 500  # per span: with a gap before each, preadv gets at most IOV_MAX (1024) buffers


@dataclass(frozen=True)
class Piece:
    """A range of one file and what to do with its bytes once read."""

    pos: int
    nbytes: int
    # "copy" (a block of a tensor), "check" (frame bytes to compare), "small" (a whole small item)
    kind: str
    item: int  # index into the plan's items: a failed check re-reads that item
    dest: Any = None
    dtype: Any = None
    size: tuple[int, ...] = ()
    stride: tuple[int, ...] = ()
    rec: Record | None = None
    expected: bytes = b""
    req: Any = None
    where: str = ""


@dataclass
class Span:
    fd: int
    path: str
    pos: int
    end: int = 0
    pieces: list[tuple[Piece, int]] = field(
        default_factory=list
    )  # (piece, its place in the buffer)
    used: int = 0  # buffer bytes taken so far


def extent(size: tuple[int, ...], stride: tuple[int, ...]) -> int:
    return 1 + sum((n - 1) * st for n, st in zip(size, stride, strict=True))


def file_blocks(
    size: tuple[int, ...], stride: tuple[int, ...], offset: int, dest: torch.Tensor, limit: int
) -> Iterator[tuple[int, int, tuple[int, ...], tuple[int, ...], torch.Tensor]]:
    """(first element, extent in elements, block size, block stride, dest view) covering a strided
    view.

    Blocks run along the dimension of largest stride, so each is one file span of at most
    ``limit`` elements; a slice that alone exceeds the limit is split one level deeper.
    """
    if any(n == 0 for n in size):
        return
    if extent(size, stride) <= limit:
        yield offset, extent(size, stride), size, stride, dest
        return
    d = max((i for i, n in enumerate(size) if n > 1), key=lambda i: stride[i])
    rest = extent(size, stride) - (size[d] - 1) * stride[d]
    per = (limit - rest) // stride[d] + 1 if rest <= limit else 0
    if per >= 1:
        for a in range(0, size[d], per):
            k = min(per, size[d] - a)
            sub = (*size[:d], k, *size[d + 1 :])
            yield offset + a * stride[d], extent(sub, stride), sub, stride, dest.narrow(d, a, k)
        return
    sub_size, sub_stride = size[:d] + size[d + 1 :], stride[:d] + stride[d + 1 :]
    for a in range(size[d]):
        yield from file_blocks(
            sub_size, sub_stride, offset + a * stride[d], dest.select(d, a), limit
        )


def contiguous(size: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(size):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def chunk_of(metadata: Any, index: Any) -> Any:
    """The saved chunk (offsets, sizes) and properties that a ReadItem's storage index names, or
    None."""
    entry = (
        getattr(metadata, "state_dict_metadata", {}).get(index.fqn)
        if metadata is not None
        else None
    )
    chunks = getattr(entry, "chunks", None)
    if not chunks or index.offset is None:
        return None
    hint = index.index
    if (
        hint is not None
        and 0 <= hint < len(chunks)
        and tuple(chunks[hint].offsets) == tuple(index.offset)
    ):
        return entry, chunks[hint]
    for chunk in chunks:
        if tuple(chunk.offsets) == tuple(index.offset):
            return entry, chunk
    return None


def reopen(fd: int) -> int:
    """A second open file of the same inode (its own file position and readahead), else fd
    itself."""
    try:
        # Through /proc/self/fd: the same file the checks accepted, not whatever the path names now.
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return fd


def stretches(spans: list[Span], count: int) -> list[list[Span]]:
    """The spans in ``count`` contiguous runs of about equal bytes, in file order."""
    if count <= 1:
        return [spans]
    total = sum(s.end - s.pos for s in spans)
    parts: list[list[Span]] = [[] for _ in range(count)]
    done = 0
    for span in spans:
        parts[min(count - 1, done * count // max(total, 1))].append(span)
        done += span.end - span.pos
    return [p for p in parts if p]


def views(span: Span, buf: Any) -> list[memoryview]:
    """The buffer ranges one preadv of the span's file range fills: pieces at their places, gaps
    between."""
    views: list[memoryview] = []
    pos, used = span.pos, 0
    for piece, at in span.pieces:
        if piece.pos > pos:  # bytes nobody asked for: into the padding before this piece's place
            gap = piece.pos - pos
            views.append(buf.view[used : used + gap])
            used += gap
        views.append(buf.view[at : at + piece.nbytes])
        pos, used = piece.pos + piece.nbytes, at + piece.nbytes
    return views


def check_record(rec: Record, length: int, where: str) -> None:
    """A parsed layout must stay inside its storage, and the storage inside its item: else the
    view would be filled from the bytes of the next item (plain DCP refuses such a file too)."""
    dims = (*rec.size, *rec.stride, rec.storage_offset)
    if (
        len(rec.size) != len(rec.stride)
        or any(type(x) is not int for x in dims)
        or min(dims, default=0) < 0
    ):
        raise CheckpointCorruptError(
            f"{where}: saved layout size {rec.size}, stride {rec.stride}, offset "
            f"{rec.storage_offset} is not one a tensor has (negative or not integers): the item "
            f"was damaged; restore an earlier step"
        )
    if rec.storage_numel is None or type(rec.storage_numel) is not int or rec.storage_numel < 0:
        raise CheckpointCorruptError(
            f"{where}: the item records no storage size; restore an earlier step"
        )
    last = rec.storage_offset + sum(
        (n - 1) * st for n, st in zip(rec.size, rec.stride, strict=True)
    )
    if 0 not in rec.size and last >= rec.storage_numel:
        raise CheckpointCorruptError(
            f"{where}: the saved view (size {rec.size}, stride {rec.stride}, offset "
            f"{rec.storage_offset}) reaches element {last} of a storage of {rec.storage_numel}: "
            f"the item was damaged; restore an earlier step"
        )
    if rec.data_offset < 0 or rec.data_offset + rec.storage_numel * rec.dtype.itemsize > length:
        raise CheckpointCorruptError(
            f"{where}: the storage ({rec.storage_numel} x {rec.dtype.itemsize} B at "
            f"{rec.data_offset}) runs past the item's {length} B: the item was damaged or "
            f"truncated; restore an earlier step"
        )


def check_box(size: tuple[int, ...], stride: tuple[int, ...], req: Any, where: str) -> None:
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
            raise CheckpointCorruptError(
                f"{where}: saved tensor has stride {list(stride)}; expected positive strides"
            )


def guess_frame(metadata: Any, req: Any, info: Any, limit: int) -> tuple[Record, Frame] | None:
    """The record ckptguard's writer gives this item, if its length is that frame's and its head
    fits ``limit`` bytes; else None (the item's own record is then read and checked)."""
    found = chunk_of(metadata, req.storage_index)
    if found is None:
        return None
    entry, chunk = found
    dtype = getattr(getattr(entry, "properties", None), "dtype", None)
    if not isinstance(dtype, torch.dtype):
        return None
    size = tuple(int(x) for x in chunk.sizes)
    frame = item_frame(size, dtype)
    if frame.size != info.length or len(frame.head) > limit:
        return None
    rec = Record(
        data_offset=len(frame.head),
        dtype=dtype,
        storage_offset=0,
        size=size,
        stride=contiguous(size),
    )
    try:
        check_box(rec.size, rec.stride, req, "")
    except CheckpointCorruptError:
        return None  # the parsed record decides, and names the item
    return rec, frame


def group_spans(pieces: list[tuple[int, str, Piece]], buffer_bytes: int) -> list[Span]:
    """Neighbouring pieces of one file grouped into spans that fit one buffer (``buffer_bytes``)
    each."""
    spans: list[Span] = []
    cur: Span | None = None
    for fd, path, piece in pieces:
        end = piece.pos + piece.nbytes
        near = cur is not None and cur.fd == fd and cur.end <= piece.pos <= cur.end + MERGE_GAP
        if cur is not None and near and len(cur.pieces) < MAX_PIECES:
            gap = piece.pos - cur.end
            place = -(-(cur.used + gap) // ALIGN) * ALIGN
            if place + piece.nbytes <= buffer_bytes:
                cur.pieces.append((piece, place))
                cur.used, cur.end = place + piece.nbytes, end
                continue
        cur = Span(fd, path, piece.pos, end, [(piece, 0)], piece.nbytes)
        spans.append(cur)
    return spans
