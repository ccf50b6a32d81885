"""A door that composes a CheckpointManager does it through the Parts it passes in: the manager
binds its context and staged-commit calls into them, one manager per Parts, and nothing else can
stage."""

from __future__ import annotations

import pytest
import torch

import ckptguard as cg
from ckptguard._core.parts import Parts


def test_parts_serve_the_one_manager_made_with_them(tmp_path):
    parts = Parts()
    with pytest.raises(cg.ConfigError, match=r"not given to a CheckpointManager"):
        parts.commits.stage(1, {"w": torch.ones(1)}, None, None, None)
    with pytest.raises(cg.ConfigError, match=r"not given to a CheckpointManager"):
        parts.bound()
    mgr = cg.CheckpointManager(tmp_path / "a", parts=parts)
    assert parts.bound().root == mgr.root
    with pytest.raises(cg.ConfigError, match=r"serve one CheckpointManager"):
        cg.CheckpointManager(tmp_path / "b", parts=parts)


def test_a_staged_commit_through_parts_commits_as_save_async_does(tmp_path):
    parts = Parts()
    mgr = cg.CheckpointManager(tmp_path / "ck", parts=parts)
    model = torch.nn.Linear(2, 2)
    staged = parts.commits.stage(1, {"model": model}, None, None, None)
    assert staged is not None
    pending = parts.commits.start(1, staged, resumed=staged[2])
    assert pending.wait() == (tmp_path / "ck" / "step_00000001").absolute()
    assert mgr.committed_steps() == [1]
    assert not hasattr(mgr, "stage_commit") and not hasattr(
        mgr, "start_commit"
    )  # not on the public surface
    assert (
        parts.commits.stage(2, {"model": model}, False, None, None) is None
    )  # unhealthy: nothing staged
    assert mgr.committed_steps() == [1]
