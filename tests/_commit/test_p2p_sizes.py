"""A peer whose record of a file has another size than the receiver's: refused on both sides, never
a crash.

gloo aborts the receiving process (SIGABRT) on a message longer than the buffer it lands in, and the
abort left the receiver's ``.part`` file behind. The block header now travels alone at a fixed
length and the bytes follow at the length it announced, so a block of an unexpected length is
drained and refused (issue 33 item 3), on real gloo ranks.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import xxhash

from ckptguard.testing import run_ranks, values

pytestmark = pytest.mark.timeout(180)


def _pair(rank: int, world: int, base: str, sent_size: int, expected_size: int) -> dict:
    from ckptguard._commit import p2p

    link = p2p.Link(None, step=7, what="test copy", retry="again", timeout_s=20.0)
    root = Path(base)
    if rank == 0:
        data = os.urandom(sent_size)
        src = root / "src.bin"
        src.write_bytes(data)
        problem = p2p.send_file(
            link, src, p2p.FileSpec("f.bin", sent_size, xxhash.xxh3_64(data).hexdigest()), 1
        )
        after = p2p.send_file(
            link, src, p2p.FileSpec("g.bin", sent_size, xxhash.xxh3_64(data).hexdigest()), 1
        )
        return {
            "problem": problem.message if problem else None,
            "after": after.message if after else None,
        }
    dest = root / "dst"
    dest.mkdir()
    problem = p2p.recv_file(link, dest / "f.bin", p2p.FileSpec("f.bin", expected_size, "0" * 16), 0)
    data = (root / "src.bin").read_bytes()
    after = p2p.recv_file(
        link, dest / "g.bin", p2p.FileSpec("g.bin", sent_size, xxhash.xxh3_64(data).hexdigest()), 0
    )
    return {
        "problem": problem.message if problem else None,
        "after": after.message if after else None,
        "files": sorted(p.name for p in dest.iterdir()),
    }


CHUNK = 64 << 20


# The last case: the sender's size a multiple of the block size, smaller than the receiver's: every
# block of the sender's has the length the receiver expects; only the sizes that travel in the
# header tell them apart.
@pytest.mark.parametrize(("sent", "expected"), [(4096, 1000), (1000, 4096), (CHUNK, CHUNK + 10)])
def test_a_block_of_another_size_is_refused_on_both_sides_and_the_pair_goes_on(
    tmp_path: Path, sent: int, expected: int
) -> None:
    sender, receiver = values(run_ranks(_pair, 2, str(tmp_path), sent, expected, timeout=120))
    assert receiver["problem"] == sender["problem"], (
        sender,
        receiver,
    )  # the same problem on both sides
    assert f"rank 0 sends {sent} bytes of it, rank 1 expects {expected}" in receiver["problem"]
    assert (
        receiver["after"] is None and sender["after"] is None
    )  # the next file of the pair still arrives
    assert receiver["files"] == ["g.bin"]  # nothing of the refused file, no .part left


# ---------------------------------------------------------------- a lying peer (issue 42 item 4)


def _liar(rank: int, world: int, base: str, lie: str) -> dict:
    """Rank 0 sends crafted messages instead of the protocol's; rank 1 receives a 1000-byte file,
    then an honest one. The receiver must refuse (never die inside gloo), remove its .part file, and
    name rank 0."""
    import struct

    import torch
    import torch.distributed as dist

    from ckptguard._commit import p2p

    link = p2p.Link(None, step=7, what="test copy", retry="again", timeout_s=20.0)
    root = Path(base)
    data = bytes(range(256)) * 4
    spec = p2p.FileSpec("f.bin", 1000, xxhash.xxh3_64(data[:1000]).hexdigest())
    if rank == 0:
        head = struct.pack("<qqq", 0, 1000, 1000)
        if lie == "header over 24 bytes":  # a header of 32 bytes, announcing the whole block
            dist.send(torch.frombuffer(bytearray(head + b"\0" * 8), dtype=torch.uint8), 1)
        elif lie == "block longer than announced":
            dist.send(
                torch.frombuffer(bytearray(head + data), dtype=torch.uint8), 1
            )  # 1024 bytes after it
        elif lie == "a length beyond the protocol's":
            dist.send(
                torch.frombuffer(
                    bytearray(struct.pack("<qqq", 0, 1 << 40, 1000)), dtype=torch.uint8
                ),
                1,
            )
        notice = torch.empty(p2p.HEADER + p2p.CHUNK + 8, dtype=torch.uint8)
        dist.recv(notice, 1)  # the receiver's refusal, best effort
        src = root / "g.src"
        src.write_bytes(data)
        after = p2p.send_file(
            link, src, p2p.FileSpec("g.bin", len(data), xxhash.xxh3_64(data).hexdigest()), 1
        )
        return {"after": after.message if after else None}
    dest = root / "dst"
    dest.mkdir()
    problem = p2p.recv_file(link, dest / "f.bin", spec, 0)
    after = p2p.recv_file(
        link, dest / "g.bin", p2p.FileSpec("g.bin", len(data), xxhash.xxh3_64(data).hexdigest()), 0
    )
    return {
        "problem": problem.message if problem else None,
        "after": after.message if after else None,
        "files": sorted(p.name for p in dest.iterdir()),
    }


@pytest.mark.parametrize(
    "lie", ["header over 24 bytes", "block longer than announced", "a length beyond the protocol's"]
)
def test_a_lying_sender_is_refused_by_name_and_the_receiver_lives_on(
    tmp_path: Path, lie: str
) -> None:
    sender, receiver = values(run_ranks(_liar, 2, str(tmp_path), lie, timeout=120))
    assert receiver["problem"] is not None and "rank 0" in receiver["problem"], receiver
    assert receiver["files"] == ["g.bin"], receiver  # no .part-* left; the next file still arrives
    assert receiver["after"] is None and sender["after"] is None
