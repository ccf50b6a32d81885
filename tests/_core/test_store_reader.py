"""An evaluation job beside a training job on one ``s3://`` root: its restore is refused by the
writer's lease (a duplicate launch must stop before it trains), and the refusal says how to read a
step without taking the lease. The advice is followed here as written: the step copied out with
``storetransfer.from_store``, then restored from a manager of the copy, bitwise, while the trainer
keeps its lease and saves on."""

from __future__ import annotations

import secrets

import pytest
import torch

pytest.importorskip("boto3", reason="the s3 extra (boto3) is not installed")
pytest.importorskip("moto.server", reason="moto[server] (dev extra) is not installed")

import ckptguard as cg
import objstore_helper as h
from ckptguard.errors import LeaseHeldError
from ckptguard.ops.storetransfer import from_store


@pytest.fixture(scope="module")
def moto():
    with h.moto_endpoint() as endpoint:
        yield endpoint


def test_a_reader_is_refused_with_the_way_to_read_and_that_way_works(moto, tmp_path):
    import boto3

    name = f"reader-{secrets.token_hex(4)}"
    boto3.client("s3", endpoint_url=moto).create_bucket(Bucket=name)
    url = f"s3://{name}/run"
    trainer = h.root(url, tmp_path / "trainer", moto)
    trainer.restore(h.blank())
    trainer.save(1, h.state_at(1))

    evaluator = h.root(url, tmp_path / "evaluator", moto)
    with pytest.raises(LeaseHeldError) as refused:
        evaluator.restore(h.blank())
    message = str(refused.value)
    assert f"ckptguard transfer {url} DEST_ROOT" in message and "break_lease" in message
    evaluator.close()

    done = from_store(url, tmp_path / "copy")
    assert done["step"] == 1
    state = h.blank()
    reader = cg.CheckpointManager(tmp_path / "copy")
    assert reader.restore(state) == 1
    reader.close()
    assert torch.equal(state["model"].w.detach(), h.values_at(1))
    trainer.save(2, h.state_at(2))  # the trainer kept its lease
    trainer.close()
