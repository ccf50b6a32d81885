"""Nothing committed is deleted by a mistake of ours, from a cold review of retention's background
delete and the overwrite's publish: a publish that fails after the old step was moved aside puts it
back; a reader whose lease lands while rotation runs keeps its step; a step moved aside by a kill is
never swept (gc says how to put it back); a directory that only looks like trash is never swept;
``release`` never deletes through a link."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import ckptguard as cg
from ckptguard._disk import layout as _layout
from ckptguard._records import readers, retention
from ckptguard.errors import UnsafeCheckpointError
from ckptguard.ops.gc import gc

NAMING = _layout.StepNaming("step_{step:08d}")


def _mgr(root: Path, keep: int | None = None) -> cg.CheckpointManager:
    return cg.CheckpointManager(
        root, config=cg.CheckpointConfig(retention=cg.KeepLast(keep) if keep else None)
    )


def _state(step: int) -> dict:
    return {"w": torch.full((4,), float(step))}


def test_an_overwrite_whose_publish_fails_puts_the_tracker_s_step_back(tmp_path, monkeypatch):
    root = tmp_path / "ck"
    mgr = _mgr(root)
    mgr.save(1, _state(1))
    real = os.rename

    def failing(
        src, dst, *args, **kwargs
    ):  # the new step's rename into place fails (EIO, a full disk)
        if Path(src).name.startswith(".tmp-step_") and Path(dst).name == "step_00000001":
            raise OSError(5, "Input/output error")
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(cg.CheckpointError):
        mgr.save(1, _state(7), overwrite=True)
    monkeypatch.setattr(os, "rename", real)
    mgr.close()
    state = {"w": torch.zeros(4)}
    assert _mgr(root).restore(state) == 1 and torch.equal(state["w"], torch.full((4,), 1.0))
    assert [p.name for p in root.glob(".trash-*")] == []


def test_a_step_moved_aside_by_a_kill_is_never_swept_and_gc_says_how_to_put_it_back(tmp_path):
    root = tmp_path / "ck"
    mgr = _mgr(root, keep=1)
    mgr.save(1, _state(1))
    aside = _layout.uncommit_to_trash(
        root / "step_00000001", keep_manifest=True
    )  # the kill's moment
    mgr.save(2, _state(2))  # a rotation sweeps trash: never this one
    assert retention.DELETER.wait(30)
    assert (aside / "manifest.json").is_file()
    report = gc(root, NAMING)
    kept = {p.name: why for p, why in report.kept}
    assert aside.name in kept and "rename it back to step_00000001" in kept[aside.name], kept
    assert aside.exists()


def test_a_reader_whose_lease_lands_while_rotation_runs_keeps_its_step(tmp_path, monkeypatch):
    root = tmp_path / "ck"
    mgr = _mgr(root, keep=1)
    mgr.save(1, _state(1))
    real = retention.holds
    calls = []

    def racing(path, *, sweep=False):  # a reader's lease lands right after rotation's first look
        found = real(path, sweep=sweep)
        if not calls:
            readers.acquire(path, 1, ttl_s=600.0, who="an eval job")
        calls.append(sweep)
        return found

    monkeypatch.setattr(retention, "holds", racing)
    mgr.save(2, _state(2))
    assert retention.DELETER.wait(30)
    assert (root / "step_00000001" / "manifest.json").is_file() and len(calls) >= 2
    assert mgr.committed_steps() == [1, 2]


def test_a_directory_that_only_looks_like_trash_is_never_swept(tmp_path):
    root = tmp_path / "ck"
    mgr = _mgr(root, keep=1)
    mgr.save(1, _state(1))
    notes = root / ".trash-notes-20241201"  # an 8-digit date is valid hex: the name alone matches
    notes.mkdir()
    (notes / "keep.txt").write_text("mine")
    mgr.save(2, _state(2))
    mgr.save(3, _state(3))
    assert retention.DELETER.wait(30)
    assert (notes / "keep.txt").read_text() == "mine"
    assert [p.name for p in root.glob(".trash-step*")] == []  # ckptguard's own trash went


def test_release_never_deletes_through_a_linked_holds_directory(tmp_path):
    root = tmp_path / "ck"
    _mgr(root).save(1, _state(1))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "3.json").write_text("{}")
    (root / "holds").symlink_to(elsewhere)
    with pytest.raises(UnsafeCheckpointError, match="symlink"):
        retention.release(root, 3)
    assert (elsewhere / "3.json").is_file()
