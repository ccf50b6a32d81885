"""``storage.dcpindex`` (the checks' torch-free read of DCP ``.metadata``) says what
``read_dcp_metadata`` says: the same data files for the same keys on a real checkpoint, the same
refusal of a foreign global, of a BUILD on an allowed class and of a data file outside ``state/``,
and its dtype allow-list is this torch's."""

from __future__ import annotations

import io
import pickle

import pytest
import torch

import ckptguard as cg
from ckptguard.errors import CheckpointCorruptError, UnsafeCheckpointError
from ckptguard.storage.dcpindex import TORCH_DTYPE_NAMES, TORCH_LAYOUTS, read_dcp_index
from ckptguard.storage.unpickler import read_dcp_metadata


@pytest.fixture
def state_dir(tmp_path):
    mgr = cg.CheckpointManager(tmp_path / "ck", config=cg.CheckpointConfig(retention=None))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    mgr.save(1, {"model": model, "optim": torch.optim.Adam(model.parameters())})
    return tmp_path / "ck" / "step_00000001" / "state"


def test_the_allow_lists_are_this_torch_s():
    names = {
        n
        for n in dir(torch)
        if "." not in n and isinstance(getattr(torch, n, None), (torch.dtype, torch.memory_format))
    }
    assert set(TORCH_DTYPE_NAMES) == names
    assert set(TORCH_LAYOUTS) == {
        str(v) for v in vars(torch).values() if isinstance(v, torch.layout)
    }


def test_the_same_files_for_the_same_keys(state_dir):
    real, view = read_dcp_metadata(state_dir), read_dcp_index(state_dir)

    def files(md):
        return sorted(
            (i.fqn, tuple(i.offset), info.relative_path) for i, info in md.storage_data.items()
        )

    assert files(view) == files(real) and files(real)
    assert set(view.state_dict_metadata) == set(real.state_dict_metadata)


def _refused_by_both(state_dir, payload: bytes, error: type[Exception]) -> None:
    (state_dir / ".metadata").write_bytes(payload)
    with pytest.raises(error) as a:
        read_dcp_metadata(state_dir)
    with pytest.raises(error) as b:
        read_dcp_index(state_dir)
    assert str(a.value).split(":")[0] == str(b.value).split(":")[0]


def test_a_foreign_global_is_refused_by_both(state_dir):
    class Boom:
        def __reduce__(self):
            import os

            return (os.system, ("true",))

    _refused_by_both(state_dir, pickle.dumps(Boom(), protocol=4), UnsafeCheckpointError)


def test_a_build_on_an_allowed_class_is_refused_by_both(state_dir):
    # GLOBAL Metadata, then BUILD with (None, {"x": 1}): setattr on the class itself.
    payload = (
        b"\x80\x04ctorch.distributed.checkpoint.metadata\nMetadata\nN}\x8c\x01x\x94K\x01s\x86b."
    )
    (state_dir / ".metadata").write_bytes(payload)
    with pytest.raises((UnsafeCheckpointError, CheckpointCorruptError)):
        read_dcp_metadata(state_dir)
    with pytest.raises((UnsafeCheckpointError, CheckpointCorruptError)):
        read_dcp_index(state_dir)
    from torch.distributed.checkpoint.metadata import Metadata

    assert not hasattr(Metadata, "x")


def test_a_data_file_outside_the_state_directory_is_refused_by_both(state_dir):
    md = read_dcp_metadata(state_dir)
    key = next(iter(md.storage_data))
    md.storage_data[key].relative_path = "../../escape.distcp"
    buf = io.BytesIO()
    pickle.dump(md, buf)
    _refused_by_both(state_dir, buf.getvalue(), UnsafeCheckpointError)


def test_garbage_is_corrupt_for_both(state_dir):
    _refused_by_both(state_dir, b"not a pickle at all", CheckpointCorruptError)
