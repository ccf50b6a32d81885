"""The staging prepared ahead of the first save (``_commit/ahead``) never changes the training: its
post-step hook reads only the items whose tensors size the pool (a stateful item's ``state_dict()``
may draw from the global RNG: torchdata's StatefulDataLoader builds an iterator there, which shifted
every dropout mask of a run that never saved), and nothing it does raises into the user's
``optimizer.step()``."""

from __future__ import annotations

import logging

import pytest
import torch

import ckptguard as cg

stateful = pytest.importorskip(
    "torchdata.stateful_dataloader", reason="torchdata (dev extra) is not installed"
)


def _train(root, with_ckptguard: bool, shuffle_eval: bool) -> torch.Tensor:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), torch.nn.Linear(4, 1))
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    train = stateful.StatefulDataLoader(
        torch.randn(64, 4), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1)
    )
    # An evaluation loader in the state, not iterated yet: its state_dict() builds an iterator and
    # draws a seed.
    evaluation = stateful.StatefulDataLoader(torch.randn(16, 4), batch_size=8, shuffle=shuffle_eval)
    state = {"model": model, "optim": optim, "train": train, "eval": evaluation}
    mgr = cg.CheckpointManager(root) if with_ckptguard else None
    if mgr is not None:
        mgr.restore(state)
    for x in train:
        optim.zero_grad()
        model(x).pow(2).mean().backward()
        optim.step()
    if mgr is not None:
        mgr.close()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("shuffle_eval", [False, True], ids=["eval-in-order", "eval-shuffled"])
def test_a_restored_run_that_never_saves_trains_bitwise_as_without_ckptguard(
    tmp_path, shuffle_eval
):
    (tmp_path / "ck").mkdir()
    without = _train(tmp_path / "ck", False, shuffle_eval)
    assert torch.equal(_train(tmp_path / "ck", True, shuffle_eval), without)


def test_nothing_the_prepared_staging_does_raises_into_the_users_step(
    tmp_path, monkeypatch, caplog
):
    model = torch.nn.Linear(4, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    class Broken(Exception):
        pass

    def prepare(self, items, config):
        raise Broken("the pool could not be grown")

    from ckptguard._commit.pending import AsyncStaging

    monkeypatch.setattr(AsyncStaging, "_prepared_ahead", prepare)
    (tmp_path / "ck").mkdir()
    mgr = cg.CheckpointManager(tmp_path / "ck")
    mgr.restore({"model": model, "optim": optim})
    model(torch.ones(2, 4)).sum().backward()
    with caplog.at_level(logging.DEBUG, logger="ckptguard"):
        optim.step()  # the hook fires here, after the first step gave the optimizer its state
    assert "no staging prepared ahead" in caplog.text and "Broken" in caplog.text
    mgr.close()
