"""TieredCheckpoint with its persistent tier on an object store (``persistent="s3://..."``), on gloo
ranks.

Two fake nodes of two ranks each (``test_tiers.become_node``: each node its own disk at the shared
path, so the fast tier and the persistent tier's staging root are node-local), one moto server on
127.0.0.1 for the module (as tests/storage/s3/test_objectstore.py starts it). A node loss is its
disk gone (fast tier and staging root): the restore falls back to the object store's step exactly,
on every rank; with ``save_async`` the store's publish runs in the background thread, and training
goes on after the fallback (the next persistent step commits on the store). The proof records reach
the store's ``proof/`` and ``prove`` judges the run from there.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from ckptguard import AsyncOptions

boto3 = pytest.importorskip("boto3", reason="the s3 extra (boto3) is not installed")
moto_server = pytest.importorskip("moto.server", reason="moto[server] (dev extra) is not installed")

from test_tiers import WORLD, become_node, expected, make_state, pytestmark, train_to  # noqa: E402

import ckptguard as cg  # noqa: E402
import objstore_helper as h  # noqa: E402
from ckptguard.errors import ConfigError  # noqa: E402
from ckptguard.ops.prove import evaluate  # noqa: E402
from ckptguard.storage.s3 import ObjectStore  # noqa: E402
from ckptguard.testing import run_ranks, values  # noqa: E402

pytestmark = [pytestmark, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def moto():
    with h.moto_endpoint(set_endpoint=False) as endpoint:
        yield endpoint


def _bucket(endpoint: str, name: str) -> str:
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=name)
    return name


def _nodes(base: Path) -> None:
    (base / "disk").mkdir()
    for node in (0, 1):
        (base / f"node{node}").mkdir()
        (base / f"node{node}" / "marker").write_text(str(node))


def _lose(base: Path, node: int) -> None:
    """The node is gone: its fast tier and its staging root (everything on its disk)."""
    for sub in ("fast", "staging"):
        shutil.rmtree(base / f"node{node}" / sub, ignore_errors=True)


def _tiers(base: str, endpoint: str, url: str, **kw) -> cg.TieredCheckpoint:
    config = cg.CheckpointConfig(timeout_s=60, async_save=AsyncOptions(on_busy=cg.OnBusy.WAIT))
    return cg.TieredCheckpoint(
        os.path.join(base, "disk", "fast"),
        persistent=url,
        fast_every=1,
        persistent_every=2,
        config=h.config(endpoint, os.path.join(base, "disk", "staging"), base=config),
        **kw,
    )


def _exact(state: dict, rank: int, step: int) -> bool:
    want = expected(rank, step)
    return all(torch.equal(v, want[k]) for k, v in state["model"].state_dict().items())


def _save(
    rank: int, world: int, base: str, endpoint: str, url: str, steps: int, use_async: bool
) -> list:
    become_node(base, rank, local_disk=True)
    tiers = _tiers(base, endpoint, url)
    state = make_state(rank)
    saved = []
    for step in range(1, steps + 1):
        train_to(state, rank, step)
        if use_async:
            pending = tiers.save_async(step, state)
            assert pending is not None
            saved.append(sorted(t.value for t in pending.tiers))
        else:
            tiers.save(step, state)
            saved.append(sorted(t.value for t in tiers.last_saved))
    # waits for a pending save_async, releases the store's lease, copies the proof records
    tiers.close()
    return saved


def _restore(rank: int, world: int, base: str, endpoint: str, url: str, more: int) -> dict:
    become_node(base, rank, local_disk=True)
    tiers = _tiers(base, endpoint, url)
    state = make_state(rank)
    chosen = (
        tiers.resolve()
    )  # what restore loads, nothing fetched: the store's step names its marker
    step = tiers.restore(state)
    out = {
        "step": step,
        "exact": _exact(state, rank, step),
        "mine": state["mine"].value,
        "resolved": [chosen.step, chosen.url],
    }
    for s in range(step + 1, step + more + 1):  # training goes on after the fallback
        train_to(state, rank, s)
        tiers.save(s, state)
    out["store"] = tiers.persistent.committed_steps()  # an s3:// root's: the store's
    tiers.close()
    return out


def test_a_lost_node_falls_back_to_the_object_store_exactly(moto, tmp_path):
    _nodes(tmp_path)
    url = f"s3://{_bucket(moto, 'tiers-sync')}/run"
    saved = values(run_ranks(_save, WORLD, str(tmp_path), moto, url, 3, False, timeout=300))
    assert saved[0] == [["fast"], ["fast", "persistent"], ["fast"]]
    store = ObjectStore(url, h.options(moto))
    assert store.committed_steps() == [2] and store.tracker()[0] == 2
    _lose(
        tmp_path, 1
    )  # fast step 3 is now on node 0 only (no replicas): not loadable by every rank
    out = values(run_ranks(_restore, WORLD, str(tmp_path), moto, url, 2, timeout=300))
    assert [o["step"] for o in out] == [2] * WORLD, out
    assert [o["resolved"] for o in out] == [[2, f"{url}/step_00000002/manifest.json"]] * WORLD, out
    assert all(o["exact"] for o in out) and [o["mine"] for o in out] == [
        r * 1000 + 2 for r in range(WORLD)
    ]
    assert out[0]["store"] == [2, 4]  # steps 3 and 4 trained again; 4 committed on the store
    assert store.tracker()[0] == 4
    # The proof records of every rank (node 1's staging root was lost) reached the store's proof/:
    # prove reads them.
    judged = tmp_path / "judged"
    assert store.fetch_proof(judged) == [f"rank_{r:05d}.jsonl" for r in range(WORLD)]
    gate = next(g for g in evaluate(judged) if g.name == "restored from tier")
    assert gate.evidence.startswith("step 2 from the persistent tier on 4 rank(s)"), gate.evidence
    for rank in (
        2,
        3,
    ):  # the lost node's records of the killed run came back from the store, then grew
        records = [
            json.loads(line)
            for line in (judged / "proof" / f"rank_{rank:05d}.jsonl").read_text().splitlines()
        ]
        saves = [(r["step"], r.get("tier")) for r in records if r["event"] == "save"]
        assert (
            saves[:3] == [(1, "fast"), (2, "fast"), (2, "persistent")]
            and (4, "persistent") in saves
        ), saves


def test_save_async_publishes_in_the_background_and_every_node_lost_restores_from_the_store(
    moto, tmp_path
):
    _nodes(tmp_path)
    url = f"s3://{_bucket(moto, 'tiers-async')}/run"
    saved = values(run_ranks(_save, WORLD, str(tmp_path), moto, url, 4, True, timeout=300))
    assert saved[0] == [["fast"], ["fast", "persistent"], ["fast"], ["fast", "persistent"]]
    assert ObjectStore(url, h.options(moto)).committed_steps() == [2, 4]
    for node in (0, 1):
        _lose(tmp_path, node)
    out = values(run_ranks(_restore, WORLD, str(tmp_path), moto, url, 2, timeout=300))
    assert [o["step"] for o in out] == [4] * WORLD, out
    assert all(o["exact"] for o in out) and [o["mine"] for o in out] == [
        r * 1000 + 4 for r in range(WORLD)
    ]
    assert out[0]["store"] == [2, 4, 6]


def _budgeted(rank: int, world: int, base: str, endpoint: str, url: str) -> dict:
    """A blocking budget every save exceeds (1 ms): the tiers' and the staging manager's saves stay
    whole."""
    os.environ.update(h.CREDENTIALS)
    config = cg.CheckpointConfig(
        timeout_s=60, blocking=cg.BlockingBudget(fraction=1.0, timeout_s=0.001)
    )
    staged = h.config(endpoint, os.path.join(base, "staging"), base=config)
    tiers = cg.TieredCheckpoint(
        os.path.join(base, "fast"),
        persistent=f"{url}/tiers",
        fast_every=1,
        persistent_every=2,
        config=staged,
    )
    state = make_state(rank)
    kinds = []
    for step in (1, 2):
        train_to(state, rank, step)
        tiers.save(step, state)
        kinds.append(sorted(t.value for t in tiers.last_saved))
    stored = tiers.persistent.committed_steps()
    tiers.close()
    alone = cg.CheckpointManager(
        f"{url}/alone", config=h.config(endpoint, os.path.join(base, "alone"), base=config)
    )
    alone.save(
        1, h.state_at(1)
    )  # over the budget: committed in the background, published there too
    alone.wait()
    marker = alone.resolve().url
    alone.close()
    return {"kinds": kinds, "stored": stored, "marker": marker}


def test_a_blocking_budget_never_drops_a_persistent_or_store_save(moto, tmp_path):
    url = f"s3://{_bucket(moto, 'tiers-budget')}/run"
    out = values(run_ranks(_budgeted, 2, str(tmp_path), moto, url, timeout=300))
    assert [o["kinds"] for o in out] == [[["fast"], ["fast", "persistent"]]] * 2, out
    assert (
        out[0]["stored"] == [2] and out[0]["marker"] == f"{url}/alone/step_00000001/manifest.json"
    )


def test_an_object_store_tiers_staging_root_is_not_the_fast_root(tmp_path):
    staged = cg.CheckpointConfig(storage=cg.StorageOptions(object_staging=tmp_path / "fast"))
    with pytest.raises(ConfigError, match=r"staging root .*same root"):
        cg.TieredCheckpoint(tmp_path / "fast", persistent="s3://bucket/run", config=staged)
    with pytest.raises(ConfigError, match="same root"):
        cg.TieredCheckpoint(tmp_path / "fast", persistent=tmp_path / "fast")
    with pytest.raises(ConfigError, match="an s3:// root is a persistent tier"):
        cg.TieredCheckpoint("s3://bucket/run", persistent=tmp_path / "p")
    with pytest.raises(
        ConfigError, match="an s3:// root takes a CheckpointManager"
    ):  # never a local "s3:" directory
        cg.RunCheckpoint("s3://bucket/run", [cg.Role("actor")])
    assert not (Path.cwd() / "s3:").exists()
