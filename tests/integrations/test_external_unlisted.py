"""A file planted in an external folder of a step (HF's ``checkpoint-N/hf/``, any ``ExternalFiles``
writer's folder) that the manifest does not list is refused by restore, naming the file: the
framework reads that folder whole and would load it unchecked (``verify`` flags it too).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptguard as cg
from ckptguard import ProofPlan
from ckptguard.integrations.external import ExternalFiles
from ckptguard.storage import StreamingStorage


def _writer(directory: Path) -> None:
    (directory / "config.json").write_text('{"a": 1}')
    (directory / "sub").mkdir()
    (directory / "sub" / "weights.bin").write_bytes(b"w" * 64)


def _manager(root: Path) -> cg.CheckpointManager:
    return cg.CheckpointManager(
        root,
        config=cg.CheckpointConfig(proof=ProofPlan(record=False)),
        storage=ExternalFiles(StreamingStorage(), {"hf": _writer}),
    )


@pytest.mark.parametrize("planted", ["hf/adapter_model.safetensors", "hf/sub/extra.bin"])
def test_an_unlisted_file_in_an_external_folder_is_refused_naming_it(tmp_path, planted):
    root = tmp_path / "out"
    _manager(root).save(1, {"w": torch.ones(3)})
    step = root / "step_00000001"
    (step / planted).write_bytes(b"planted")
    with pytest.raises(cg.CheckpointCorruptError, match=planted) as info:
        _manager(root).restore({"w": torch.zeros(3)})
    assert "not in its manifest" in str(info.value)


def test_a_step_with_only_listed_external_files_restores(tmp_path):
    root = tmp_path / "out"
    _manager(root).save(1, {"w": torch.ones(3)})
    state = {"w": torch.zeros(3)}
    assert _manager(root).restore(state) == 1 and torch.equal(state["w"], torch.ones(3))
