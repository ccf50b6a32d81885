"""A ``.metadata`` that declares more bytes than are stored is refused before anything is allocated
from it (issue 33 item 3): the offline verify and the export build buffers from those sizes."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import ckptguard as cg
from ckptguard.storage import read_dcp_metadata


def _step(tmp_path: Path) -> Path:
    mgr = cg.CheckpointManager(tmp_path / "ck")
    return mgr.save(1, {"t": {"x": torch.arange(6, dtype=torch.float32)}})


def _rewrite(state: Path, fn) -> None:
    md = read_dcp_metadata(state)
    fn(md)
    with open(state / ".metadata", "wb") as f:
        pickle.dump(md, f)


def test_a_chunk_declared_larger_than_its_stored_bytes_is_refused(tmp_path):
    state = _step(tmp_path) / "state"
    assert read_dcp_metadata(state)  # the honest file passes the bound

    def huge(md):
        meta = md.state_dict_metadata["t.x"]
        assert isinstance(meta, TensorStorageMetadata)
        big = torch.Size([10**12])
        meta.chunks[0] = dataclasses.replace(meta.chunks[0], sizes=big)
        md.state_dict_metadata["t.x"] = dataclasses.replace(meta, size=big)

    _rewrite(state, huge)
    with pytest.raises(
        cg.CheckpointCorruptError, match=r"'t.x' at offset \[0\] declares 4000000000000 bytes"
    ):
        read_dcp_metadata(state)


def test_a_tensor_declared_larger_than_its_chunks_is_refused(tmp_path):
    state = _step(tmp_path) / "state"

    def global_only(md):
        meta = md.state_dict_metadata["t.x"]
        md.state_dict_metadata["t.x"] = dataclasses.replace(meta, size=torch.Size([10**9]))

    _rewrite(state, global_only)
    with pytest.raises(
        cg.CheckpointCorruptError, match=r"'t.x' declares 4000000000 bytes .* chunks hold 24"
    ):
        read_dcp_metadata(state)
