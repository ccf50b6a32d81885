"""Errors that say what really happened: a flipped shard byte names the file, an item of
different kinds across ranks or a plain value that became a tensor is refused, node-local
roots do not commit."""

from __future__ import annotations

import pytest
import torch

import ckptguard as cg
from ckptguard.demo.toyjob import build_job, train_step
from ckptguard.testing import fake_node, run_ranks


def test_flipped_byte_in_a_shard_names_the_file(tmp_path):
    job = build_job()
    train_step(job)
    cg.CheckpointManager(tmp_path).save(1, job.state())
    state_dir = tmp_path / "step_00000001" / "state"
    info = max(cg.read_dcp_metadata(state_dir).storage_data.values(), key=lambda i: i.length)
    shard = state_dir / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset + info.length // 2] ^= 0x01  # inside a tensor's bytes
    shard.write_bytes(bytes(data))
    with pytest.raises(cg.CheckpointError) as info:
        cg.CheckpointManager(tmp_path).restore(build_job().state())
    message = str(info.value)
    assert shard.name in message, message
    assert "verify --deep" in message and "older" in message, message


def _mixed_kinds(rank: int, world: int, root: str) -> str:
    torch.manual_seed(0)
    state = {"w": torch.nn.Linear(2, 2), "tokens": torch.tensor(3.0) if rank == 0 else 3.0}
    try:
        cg.CheckpointManager(root).save(1, state)
    except cg.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "committed"


def test_item_of_different_kinds_across_ranks_is_refused_at_save(tmp_path):
    results = run_ranks(_mixed_kinds, 2, str(tmp_path), timeout=120)
    for r in results:
        assert r.ok, r.error
        assert r.value.startswith("StateMismatchError"), r.value
        assert "'tokens'" in r.value and "rank 0" in r.value and "rank 1" in r.value, r.value
    assert not (tmp_path / "step_00000001").exists()


def test_plain_value_that_became_a_tensor_is_refused(tmp_path):
    state = {"w": torch.nn.Linear(2, 2), "loss_scale": 1.5}
    cg.CheckpointManager(tmp_path).save(1, state)
    later = {"w": torch.nn.Linear(2, 2), "loss_scale": torch.tensor(1.5)}
    with pytest.raises(cg.StateMismatchError) as info:
        cg.CheckpointManager(tmp_path).restore(later)
    assert "loss_scale" in str(info.value)


def _private_disk(base: str, rank: int) -> str:
    """Give this process its own "disk" at the shared path ``base/disk``: ``base/node<rank>`` seen
    there (``fake_node``; what two nodes with local NVMe look like), the node identity unchanged."""
    import os

    shared = os.path.join(base, "disk")
    fake_node(disks={shared: os.path.join(base, f"node{rank}")})
    return shared


def _node_local(rank: int, world: int, base: str) -> str:
    import os

    torch.manual_seed(0)
    disk = _private_disk(base, rank)
    other = os.path.join(base, f"node{1 - rank}", "marker")
    assert os.path.exists(os.path.join(disk, "marker")) and not os.path.samefile(
        os.path.join(disk, "marker"), other
    )
    state = {"w": torch.nn.Linear(2, 2), "n": cg.PerRank(rank)}
    try:
        cg.CheckpointManager(os.path.join(disk, "ckpt")).save(1, state)
    except cg.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "committed"


def test_node_local_roots_do_not_commit(tmp_path):
    import os

    if os.geteuid() != 0:
        pytest.skip("needs root for private mount namespaces (two nodes' disks at one path)")
    for rank in (0, 1):
        (tmp_path / f"node{rank}").mkdir()
        (tmp_path / f"node{rank}" / "marker").write_text(str(rank))
    (tmp_path / "disk").mkdir()
    results = run_ranks(_node_local, 2, str(tmp_path), timeout=120)
    for r in results:
        assert r.ok, r.error
        assert r.value.startswith("CheckpointWriteError"), r.value
        assert "node-local" in r.value and "rank 1" in r.value, r.value
    from ckptguard._disk import layout

    assert (
        layout.read_tracker(tmp_path / "node0" / "ckpt") == 0
    )  # fresh start declared, nothing committed
    assert not (tmp_path / "node0" / "ckpt" / "step_00000001").exists()
