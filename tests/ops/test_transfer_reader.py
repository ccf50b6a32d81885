"""A transfer holds its source step with a reader lease: the source root's rotation while the copy
runs keeps the step (before, a rotation mid-copy deleted it and the transfer failed on a missing
file), and frees it after. A source the transfer cannot hold (its root not writable here) is copied
all the same, said once."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

import ckptguard as cg
from ckptguard._disk import layout as _layout
from ckptguard._records import retention
from ckptguard.ops.transfer import transfer


def _root(tmp_path: Path) -> Path:
    root = tmp_path / "src"
    mgr = cg.CheckpointManager(root, config=cg.CheckpointConfig(retention=None))
    for step in (1, 2, 3):
        mgr.save(step, {"w": {"t": torch.full((4096,), float(step))}})
    mgr.close()
    return root


def test_a_rotation_of_the_source_during_the_copy_keeps_the_step_and_frees_it_after(tmp_path):
    root = _root(tmp_path)
    naming = _layout.StepNaming("step_{step:08d}")
    rotated: list[list[int]] = []

    def progress(done: int, total: int) -> None:
        if not rotated:  # mid-copy: the training job's retention runs (keep the newest step only)
            report = retention.apply(root, naming, cg.KeepLast(1))
            rotated.append(sorted(report.deleted))

    info = transfer(root / "step_00000001", tmp_path / "dest", progress=progress)
    assert info["step"] == 1 and rotated == [[2]], (
        rotated
    )  # step 1 held by the transfer, step 2 rotated
    state = {"w": {"t": torch.zeros(4096)}}
    reader = cg.CheckpointManager(tmp_path / "dest")
    assert reader.restore(state) == 1 and torch.equal(state["w"]["t"], torch.full((4096,), 1.0))
    reader.close()
    assert not list((root / "readers").glob("*.json"))  # the lease is gone with the transfer
    assert sorted(retention.apply(root, naming, cg.KeepLast(1)).deleted) == [
        1
    ]  # and the step is free


def test_a_source_that_cannot_be_held_is_copied_and_said(tmp_path, caplog, monkeypatch):
    root = _root(tmp_path)
    from ckptguard._records import readers

    def refused(*_a, **_k):
        raise PermissionError(13, "Permission denied", str(root / "readers"))

    monkeypatch.setattr(readers, "acquire", refused)
    with caplog.at_level(logging.WARNING, logger="ckptguard"):
        info = transfer(root / "step_00000002", tmp_path / "dest")
    assert info["step"] == 2
    assert "without a reader lease" in caplog.text and "Permission denied" in caplog.text
