"""Issue 22 item 1: the publish check, and per-node publish for node-local roots.

The publish check: every file a rank reported is read back by the publishing rank, with its
size and checksum, before anything is committed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptguard as cg
from ckptguard._commit import layout as _layout
from ckptguard.testing import set_fault_hook


def _damage_after_write(root: Path, how: str) -> None:
    """A fault hook: change this rank's data file between its write and the publish."""

    def hook() -> None:
        (data,) = root.glob(".tmp-*/state/__0_0.distcp")
        raw = bytearray(data.read_bytes())
        if how == "flip":
            raw[len(raw) // 2] ^= 0xFF  # same size: only a checksum sees it
        else:
            raw = raw[:-1]
        data.write_bytes(bytes(raw))

    set_fault_hook("commit.rank_written", hook)


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_publish_reads_every_reported_file_back_with_size_and_checksum(tmp_path, how):
    root = tmp_path / "ck"
    mgr = cg.CheckpointManager(root)
    state = {"w": torch.nn.Linear(8, 8)}
    mgr.save(1, state)
    _damage_after_write(root, how)
    try:
        with pytest.raises(cg.CheckpointWriteError) as info:
            mgr.save(2, state)
    finally:
        set_fault_hook("commit.rank_written", None)
    msg = str(info.value)
    assert "publish check" in msg and "__0_0.distcp" in msg, msg
    assert ("xxh3" in msg) if how == "flip" else ("bytes, reported" in msg), msg
    assert _layout.read_tracker(root) == 1, "a save whose files changed after their write was committed"
    assert not (root / "step_00000002").exists() and not list(root.glob(".tmp-*"))
    assert mgr.restore(state) == 1
