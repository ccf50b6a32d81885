"""A 2-rank training job on an object store, SIGKILLed inside the upload window again and again.

The upload window: the step is committed in the staging root (its tracker moved there), its files
are going up to the store, the store's marker is not written. A relaunch restores the store's older
step and must then save the killed step again, replacing the staging root's copy the store never
committed (before the fix every relaunch raised "step N is already committed at STAGING/...", a
crash loop).

Both gloo ranks run through the public API (``CheckpointManager("s3://...")``) against a moto server
on 127.0.0.1; the kill takes the whole job down (every rank SIGKILLed) at a random moment: after a
random part of a random rank's upload plus a random delay, other parts still in flight, or at the
latest when every upload is in and the marker is not written. After each kill: the staging root
holds the killed step, the store does not, the store's latest step is complete (every object as its
marker recorded) and restores exactly the state trained to that step. At the end the run has saved
past every killed step and its final state is bitwise the state of an uninterrupted run.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest

boto3 = pytest.importorskip("boto3", reason="the s3 extra (boto3) is not installed")
moto_server = pytest.importorskip("moto.server", reason="moto[server] (dev extra) is not installed")

import objstore_helper as h  # noqa: E402
from ckptguard._disk.layout import read_tracker  # noqa: E402
from ckptguard.ops.remote import verify_remote  # noqa: E402
from ckptguard.storage.s3 import ObjectStore  # noqa: E402
from ckptguard.testing import run_ranks, values  # noqa: E402

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

LAST = 8
KILLS = 5


@pytest.fixture(scope="module")
def moto():
    with h.moto_endpoint() as endpoint:
        yield endpoint


def _bucket(endpoint: str, name: str) -> str:
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=name)
    return name


def _state(fingerprint: dict) -> dict:
    return {k: v for k, v in fingerprint.items() if k != "restored"}


def _launch(
    moto: str, url: str, staging: Path, pids: Path, kill: tuple[int, int, int, float] | None
):
    for old in pids.iterdir():
        old.unlink()
    return run_ranks(h.train_job, 2, moto, url, str(staging), str(pids), LAST, kill, timeout=300)


def test_a_job_killed_inside_the_upload_window_saves_on_and_ends_bitwise_as_an_uninterrupted_one(
    moto, tmp_path
):
    seed = int(time.time())
    rng = random.Random(seed)
    why = f"(random seed {seed})"
    name = _bucket(moto, f"kills-{os.getpid()}")
    pids = tmp_path / "pids"
    pids.mkdir()

    plain = values(_launch(moto, f"s3://{name}/plain", tmp_path / "plain", pids, None))
    assert [_state(v) for v in plain] == [h.trained_to(LAST, r) for r in (0, 1)]

    url, staging = f"s3://{name}/killed", tmp_path / "staging"
    store = ObjectStore(url, h.options(moto))
    killed_at: list[int] = []
    began = time.monotonic()
    for step in sorted(rng.sample(range(2, LAST), KILLS)):
        kill = (step, rng.randrange(2), rng.randint(1, 3), rng.uniform(0.0, 0.2))
        print(f"kill {why}: step {step}, rank {kill[1]} after its part {kill[2]} + {kill[3]:.3f} s")
        results = _launch(moto, url, staging, pids, kill)
        assert [r.exitcode for r in results] == [-signal.SIGKILL] * 2, (
            kill,
            why,
            [r.error for r in results],
        )
        killed_at.append(step)
        # Inside the upload window: committed in the staging root, never on the store.
        assert read_tracker(staging) == step, (kill, why)
        assert store.marker(step) is None and store.tracker()[0] == step - 1, (kill, why)
        # The store's latest step is whole, and it is exactly the state trained to it.
        checked, findings = verify_remote(url, "step_{step:08d}")
        assert findings == [] and len(checked) == step - 1, (kill, why, findings)
        back = values(
            run_ranks(h.restore_job, 2, moto, url, str(tmp_path / f"check{step}"), timeout=300)
        )
        assert [_state(b) for b in back] == [h.trained_to(step - 1, r) for r in (0, 1)], (kill, why)
        assert [b["restored"] for b in back] == [step - 1] * 2

    final = values(_launch(moto, url, staging, pids, None))
    assert [v["restored"] for v in final] == [killed_at[-1] - 1] * 2, (
        why
    )  # it saved on past every killed step
    assert [_state(f) for f in final] == [_state(p) for p in plain], why
    print(
        f"{len(killed_at)} kills at steps {killed_at} {why}, 2 ranks: every relaunch saved on, "
        f"final state bitwise equal to the uninterrupted run's ({time.monotonic() - began:.0f} s "
        f"for the kills and relaunches)"
    )
    assert store.committed_steps() == list(range(1, LAST + 1)) and store.tracker()[0] == LAST
    again = values(run_ranks(h.restore_job, 2, moto, url, str(tmp_path / "last"), timeout=300))
    assert [_state(a) for a in again] == [_state(p) for p in plain], why
    report = h.gc(store)  # each killed attempt is unmarked and removable; nothing foreign
    assert sorted({a.split("/")[0] for a in h.attempts(store, report.removed)}) == [
        f"step_{s:08d}" for s in killed_at
    ]
    assert h.foreign(report) == []


def test_a_save_whose_upload_failed_is_saved_again_by_the_same_job(moto, tmp_path):
    from ckptguard.testing import set_fault_hook

    url = f"s3://{_bucket(moto, f'again-{os.getpid()}')}/run"
    ckpt = h.root(url, tmp_path / "s", moto)
    ckpt.save(1, h.state_at(1))

    def lost() -> None:
        raise ConnectionError("the store went away before the marker")

    set_fault_hook("store.before_marker", lost)
    try:
        with pytest.raises(ConnectionError):
            ckpt.save(2, h.state_at(2))
    finally:
        set_fault_hook("store.before_marker", None)
    store = h.store(url, moto)
    assert read_tracker(tmp_path / "s") == 2 and store.tracker()[0] == 1
    ckpt.save(2, h.state_at(2))  # the staging copy the store never committed is replaced
    ckpt.close()
    assert store.tracker()[0] == 2 and ckpt.committed_steps() == [1, 2]
    state = h.blank()
    again = h.root(url, tmp_path / "r", moto)
    assert again.restore(state) == 2
    again.close()
    import torch

    assert torch.equal(state["model"].w.detach(), h.values_at(2))


def test_tiers_save_a_persistent_step_again_after_its_upload_failed_and_the_fast_tier_was_lost(
    moto, tmp_path
):
    import ckptguard as cg
    from ckptguard.testing import set_fault_hook

    url = f"s3://{_bucket(moto, f'tiers-{os.getpid()}')}/run"

    def tiers(fast: str) -> cg.TieredCheckpoint:
        return cg.TieredCheckpoint(
            tmp_path / fast,
            persistent=url,
            fast_every=1,
            persistent_every=1,
            config=h.config(moto, tmp_path / "staging"),
        )

    first = tiers("fast")
    first.save(1, h.state_at(1))

    def lost() -> None:
        raise ConnectionError("the store went away before the marker")

    set_fault_hook("store.before_marker", lost)
    try:
        with pytest.raises(ConnectionError):
            first.save(2, h.state_at(2))
    finally:
        set_fault_hook("store.before_marker", None)
    first.close()
    again = tiers(
        "fast-of-a-new-node"
    )  # the node is lost: its fast tier with it; the staging root is shared
    state = h.blank()
    assert again.restore(state) == 1
    again.save(2, h.state_at(2))  # the staging copy the store never committed is replaced
    again.close()
    assert again.persistent is not None and again.persistent.committed_steps() == [1, 2]
