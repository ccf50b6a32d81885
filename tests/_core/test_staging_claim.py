"""An s3:// root's staging root is claimed, never taken: an existing checkpoint root, another
store's staging or a planted link is refused when the manager is made, before anything there is
written or deleted (the staging keeps only its newest step: before this, a save through it deleted
the other root's committed steps)."""

from __future__ import annotations

import json
import os

import pytest
import torch

import ckptguard as cg
from ckptguard._core.storestage import STAGING_RECORD, claim_staging


def _config(staging, endpoint="http://127.0.0.1:1"):
    return cg.CheckpointConfig(
        storage=cg.StorageOptions(
            object_staging=staging, object_store=cg.ObjectStoreOptions(endpoint_url=endpoint)
        )
    )


def _root_with_steps(path):
    mgr = cg.CheckpointManager(path)
    for step in (1, 2, 3):
        mgr.save(step, {"w": torch.full((4,), float(step))})
    mgr.close()


def test_an_existing_checkpoint_root_is_refused_as_a_staging_root_and_keeps_its_steps(tmp_path):
    victim = tmp_path / "old-run"
    _root_with_steps(victim)
    before = sorted(os.listdir(victim))
    with pytest.raises(cg.ConfigError, match="is not a staging root"):
        claim_staging(victim, "s3://bkt/run", _config(victim))
    assert sorted(os.listdir(victim)) == before and not (victim / STAGING_RECORD).exists()


def test_a_link_at_the_staging_path_is_refused(tmp_path):
    victim = tmp_path / "old-run"
    _root_with_steps(victim)
    link = tmp_path / "stage"
    link.symlink_to(victim)
    with pytest.raises(cg.ConfigError, match="is a symbolic link"):
        claim_staging(link, "s3://bkt/run", _config(link))


def test_two_stores_never_share_a_staging_root(tmp_path):
    stage = tmp_path / "stage"
    claim_staging(stage, "s3://bkt/actor", _config(stage))
    assert json.loads((stage / STAGING_RECORD).read_text()) == {
        "store": "s3://bkt/actor",
        "endpoint": "http://127.0.0.1:1",
    }
    claim_staging(
        stage, "s3://bkt/actor", _config(stage)
    )  # the same store again: its own staging root
    with pytest.raises(cg.ConfigError, match=r"stages s3://bkt/actor .*not s3://bkt/critic"):
        claim_staging(stage, "s3://bkt/critic", _config(stage))
    with pytest.raises(cg.ConfigError, match="two stores must not share a staging root"):
        claim_staging(stage, "s3://bkt/actor", _config(stage, endpoint="http://elsewhere:9000"))
