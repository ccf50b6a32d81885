"""A state item that ckptguard cannot save is refused at ``restore()``, before any training, naming
the fix; never first at the first save (issue 39: a plain DataLoader was accepted at the fresh start
and the run died at its first save, after training up to it)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ckptguard as cg


def _loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2, shuffle=True)


def _refused(root, state) -> str:
    mgr = cg.CheckpointManager(root)
    with pytest.raises(cg.ConfigError) as info:
        mgr.restore(state)
    return str(info.value)


@pytest.fixture
def root(tmp_path):
    (tmp_path / "ck").mkdir()
    return tmp_path / "ck"


def test_a_plain_dataloader_is_refused_at_a_fresh_restore_naming_the_fix(root):
    msg = _refused(root, {"model": torch.nn.Linear(2, 2), "loader": _loader()})
    assert msg.startswith(
        "restore: state item 'loader' (value) is a torch.utils.data.dataloader.DataLoader"
    ), msg
    assert (
        "ckptguard.DataCursor" in msg
        and "sampler=cursor.sampler(b)" in msg
        and "StatefulDataLoader" in msg
    )
    assert (
        list(root.iterdir()) == []
    )  # refused before anything was written (no tracker, no proof record)


def test_a_plain_dataloader_is_refused_before_a_checkpoint_is_loaded(root):
    model = torch.nn.Linear(2, 2)
    cg.CheckpointManager(root).save(1, {"model": model})
    with torch.no_grad():
        model.weight.zero_()
    msg = _refused(root, {"model": model, "loader": _loader()})
    assert "state item 'loader'" in msg and "DataCursor" in msg
    assert float(model.weight.detach().abs().sum()) == 0.0  # nothing was loaded


@pytest.mark.parametrize(
    ("value", "fix"),
    [
        (torch.Generator().manual_seed(0), "ckptguard.GeneratorState(generator)"),
        (iter(_loader()), "rebuild the iterator after restore()"),
        ((i for i in range(3)), "rebuild the iterator after restore()"),
        ({"pos": 3, "obj": object()}, "convert it to tensors and plain Python types"),
    ],
    ids=["generator", "dataloader-iterator", "python-generator", "object-in-a-dict"],
)
def test_other_items_no_save_could_write_are_refused_at_restore(root, value, fix):
    msg = _refused(root, {"model": torch.nn.Linear(2, 2), "x": value})
    assert "restore: state item 'x'" in msg and fix in msg, msg


class _Counted:
    """A stateful object that counts its state_dict() calls."""

    calls = 0

    def state_dict(self):
        _Counted.calls += 1
        return {"position": 3}

    def load_state_dict(self, sd):
        pass


def test_the_restore_check_does_not_call_a_stateful_item_s_state_dict():
    """Its content is checked at the save: a StatefulDataLoader's state_dict() without an iterator
    starts the workers and draws its seeds (torchdata 0.11), which the check before the load must
    not do."""
    from ckptguard._state.state import check_items

    _Counted.calls = 0
    check_items({"model": torch.nn.Linear(2, 2), "sampler": _Counted()}, "restore")
    assert _Counted.calls == 0


def test_a_bad_item_name_is_refused_at_restore(root):
    msg = _refused(root, {"model.x": torch.nn.Linear(2, 2)})
    assert "state item name 'model.x' must be a non-empty str without '.'" in msg


def test_what_a_save_can_write_is_accepted_at_restore(root):
    model = torch.nn.Linear(2, 2)
    cursor = cg.DataCursor(8, seed=1, rank=0, world_size=1)
    state = {
        "model": model,
        "optim": torch.optim.AdamW(model.parameters()),
        "data": cursor,
        "gen": cg.GeneratorState(torch.Generator().manual_seed(0)),
        "tokens": 0,
        "ahead": cg.PerRank(None),
    }
    assert cg.CheckpointManager(root).restore(state) == 0
    cg.CheckpointManager(root).save(1, state)


def test_a_plain_dataloader_in_a_role_is_refused_at_the_run_checkpoints_restore(root):
    run = cg.RunCheckpoint(root, [cg.Role("actor")])
    with pytest.raises(cg.ConfigError) as info:
        run.restore({"actor": {"model": torch.nn.Linear(2, 2), "loader": _loader()}})
    msg = str(info.value)
    assert msg.startswith("restore of role 'actor': state item 'loader'"), msg
    assert "ckptguard.DataCursor" in msg
    assert list(root.iterdir()) == []  # refused before anything was written
