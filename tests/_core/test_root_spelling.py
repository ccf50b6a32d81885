"""A root that only reads like an object-store URL is refused by name, never made a local directory
named s3:.

``s3:/bkt/x`` (one slash), ``S3://bkt/x`` and ``Path("s3://bkt/x")`` (which drops a slash) would
otherwise commit to ``./s3:/bkt/x`` on the node's disk while the job believes it checkpoints to the
store."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import ckptguard as cg
from damage_helper import cli


@pytest.mark.parametrize(
    "root",
    ["s3:/bkt/run", "S3://bkt/run", Path("s3://bkt/run")],
    ids=["one-slash", "upper", "path"],
)
def test_a_lookalike_root_is_refused_and_nothing_is_made(tmp_path, monkeypatch, root):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(cg.ConfigError, match="reads like an object-store URL but is not one"):
        cg.CheckpointManager(root)
    with (
        pytest.raises(cg.ConfigError, match="open_step holds a step of a local root"),
        cg.open_step(root, 1),
    ):
        pass
    assert os.listdir(tmp_path) == []


def test_the_cli_refuses_a_lookalike_destination(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    got = cli("list", "s3:/bkt/run")
    assert got.exit_code == 2 and "reads like an object-store URL but is not one" in got.output, (
        got.output
    )
    assert os.listdir(tmp_path) == []
