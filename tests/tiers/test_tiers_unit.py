"""The tier choice and the replica pairing as pure functions (one process, synthetic rank views)."""

from __future__ import annotations

import pytest

import ckptguard as cg
from ckptguard._commit.replica import peers
from ckptguard._core.tierrestore import TierRestore, View


def test_peers_pair_ranks_across_nodes():
    assert peers(["a", "a", "b", "b"]) == [2, 3, 0, 1]
    assert peers(["a", "b", "c"]) == [1, 2, 0]  # a ring over three nodes
    assert peers(["a", "a", "b"]) == [
        2,
        2,
        0,
    ]  # unequal nodes: local index modulo the peer node's size
    assert peers(["a", "a"]) == [None, None]


def views(a: dict, b: dict, persistent: int = 0) -> list[View]:
    """Ranks 0, 1 on node a and 2, 3 on node b, each node's ranks alike."""
    return [
        View(host, persistent=persistent, **kw)
        for host, kw in (("a", a), ("a", a), ("b", b), ("b", b))
    ]


@pytest.fixture
def tiers(tmp_path):
    """The restore side of a TieredCheckpoint (its collective choice, run here on synthetic
    views)."""
    tc = cg.TieredCheckpoint(tmp_path / "fast", persistent=tmp_path / "persistent")
    assert tc.persistent is not None
    fast = tc.fast.context
    return TierRestore(
        fast, tc.persistent.context, replicas=tc.replicas, hosts=[fast.agreement.info.host]
    )


def test_a_newer_step_on_part_of_the_job_is_never_chosen(tiers):
    v = views(
        {"complete": [1, 2, 3]},
        {"complete": [1, 2], "missing": {"3": ["/f/step_00000003/rank_00002.pt"]}},
    )
    choice = tiers.choose(v, {})
    assert (choice.tier, choice.step, choice.senders, choice.fell_back) == ("fast", 2, {}, True)
    assert "newer fast step 3 is not loadable on every rank" in choice.detail
    assert "rank 2 (host b): missing /f/step_00000003/rank_00002.pt" in choice.detail


def test_replicas_on_another_node_make_the_newest_step_loadable(tiers):
    v = views({"complete": [2, 3]}, {"complete": [2]})
    v[0], v[1] = (
        View("a", complete=[2, 3], replicas={"3": [r]}) for r in (2, 3)
    )  # rank 0 holds rank 2's
    choice = tiers.choose(v, {})
    assert (choice.tier, choice.step, choice.senders) == ("fast", 3, {"2": 0, "3": 1})
    # A replica held on the rank's own node is lost with it: it does not count.
    v = views({"complete": [2, 3]}, {"complete": [2], "replicas": {"3": [2, 3]}})
    assert tiers.choose(v, {}).step == 2
    # A fetch that failed its checksum: the step is not chosen again through replicas.
    v = views({"complete": [2, 3], "replicas": {"3": [2, 3]}}, {"complete": [2]})
    assert tiers.choose(v, {3: "xxh3 differs"}).step == 2


def test_persistent_wins_only_when_newer(tiers):
    v = views({"complete": [4]}, {"complete": [4]}, persistent=4)
    assert (tiers.choose(v, {}).tier, tiers.choose(v, {}).step) == ("fast", 4)
    v = views({"complete": [4]}, {"complete": []}, persistent=3)
    choice = tiers.choose(v, {})
    assert (choice.tier, choice.step, choice.fell_back) == ("persistent", 3, True)
    assert "the fast tier's newest step 4 cannot be loaded on every rank" in choice.detail
    assert (
        tiers.choose(views({}, {}), {}).tier == ""
    )  # nothing anywhere: the manager's own fresh start


def test_nothing_loadable_but_something_committed_is_refused(tiers):
    v = views({"complete": [4]}, {"missing": {"4": ["/f/step_00000004/rank_00002.pt"]}})
    with pytest.raises(cg.CheckpointIncompleteError) as info:
        tiers.choose(v, {})
    msg = str(info.value)
    assert (
        "rank 2 (host b): missing /f/step_00000004/rank_00002.pt" in msg
        and "holds no committed step" in msg
    )


def test_config_is_checked():
    with pytest.raises(cg.ConfigError, match="fast_every"):
        cg.TieredCheckpoint("/nonexistent/f", fast_every=0)
    with pytest.raises(cg.ConfigError, match="replicas"):
        cg.TieredCheckpoint("/nonexistent/f", replicas=2)
    with pytest.raises(cg.ConfigError, match="another node"):
        cg.TieredCheckpoint("/nonexistent/f", replicas=1)


def test_recovery_benchmark_runs_at_tiny_size(tmp_path):
    """benchmarks/bench_recovery.py --tiny on the CPU: both restores exact, each from its own
    tier."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "recovery.json"
    (tmp_path / "shm").mkdir()  # stand-ins for /dev/shm and the local disk
    (tmp_path / "disk").mkdir()
    env = {**os.environ, "PYTHONPATH": str(root / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            str(root / "benchmarks" / "bench_recovery.py"),
            "--tiny",
            "--out",
            str(out),
            "--fast-dir",
            str(tmp_path / "shm" / "fast"),
            "--persistent-dir",
            str(tmp_path / "disk" / "persistent"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert {t: (r["tier_recorded"], r["bitwise_exact"]) for t, r in result["restore"].items()} == {
        "fast": ("fast", True),
        "persistent": ("persistent", True),
    }


def test_fast_steps_without_a_tracker_are_refused_not_ignored(tmp_path):
    """A fast root holding steps but no tracker was changed outside ckptguard: refused like a
    manager's restore does, never read as an empty tier (which would fall back or start fresh)."""
    import torch

    state = {"w": torch.nn.Linear(2, 2)}
    tiers = cg.TieredCheckpoint(
        tmp_path / "fast", persistent=tmp_path / "persistent", persistent_every=2
    )
    tiers.save(1, state)
    tiers.save(2, state)
    (tmp_path / "fast" / "latest_checkpointed_iteration.txt").unlink()
    with pytest.raises(cg.ResumeError, match="no tracker"):
        cg.TieredCheckpoint(tmp_path / "fast", persistent=tmp_path / "persistent").restore(state)


def test_fast_saves_before_the_first_persistent_one_leave_durable_proof_records(tmp_path):
    import json

    import torch

    tiers = cg.TieredCheckpoint(
        tmp_path / "fast", persistent=tmp_path / "persistent", persistent_every=100
    )
    tiers.save(1, {"w": torch.nn.Linear(2, 2)})
    tiers.record_step(1, loss=0.5)
    records = [
        json.loads(x)
        for x in (tmp_path / "persistent" / "proof" / "rank_00000.jsonl").read_text().split("\n")
        if x
    ]
    assert [(r["event"], r["step"], r.get("tier")) for r in records] == [
        ("save", 1, "fast"),
        ("step", 1, None),
    ]
    assert (
        tmp_path / "persistent" / "latest_checkpointed_iteration.txt"
    ).read_text().strip() == "0"


def test_a_nan_recorded_at_a_step_keeps_it_out_of_both_tiers_and_prefer_verified_is_refused(
    tmp_path,
):
    import math

    import torch

    tiers = cg.TieredCheckpoint(
        tmp_path / "fast", persistent=tmp_path / "pers", fast_every=1, persistent_every=2
    )
    state = {"m": torch.nn.Linear(2, 2)}
    assert tiers.save(1, state) == tmp_path / "fast" / "step_00000001" and set(
        tiers.last_saved
    ) == {cg.Tier.FAST}
    tiers.record_step(
        2, loss=math.nan
    )  # the proof log is the persistent tier's; the fast tier's check sees it too
    assert tiers.save(2, state) is None and tiers.last_saved == {}
    assert tiers.fast.committed_steps() == [1] and tiers.persistent.committed_steps() == []
    assert tiers.save(4, state, loss=1.0) == tmp_path / "pers" / "step_00000004"
    assert set(tiers.last_saved) == {cg.Tier.FAST, cg.Tier.PERSISTENT}
    verified = cg.CheckpointConfig(health=cg.HealthPolicy(prefer="verified"))
    with pytest.raises(cg.ConfigError, match="prefer='verified'"):
        cg.TieredCheckpoint(tmp_path / "f2", config=verified).restore(dict(state))


def test_the_three_front_doors_take_the_root_first_and_the_config_by_keyword(tmp_path):
    import inspect

    for door in (cg.CheckpointManager, cg.RunCheckpoint, cg.TieredCheckpoint):
        params = list(inspect.signature(door.__init__).parameters.values())[1:]
        assert (
            params[0].name == "root" and params[0].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
        ), door
        assert (
            inspect.signature(door.__init__).parameters["config"].kind
            is inspect.Parameter.KEYWORD_ONLY
        ), door
    tiers = cg.TieredCheckpoint(tmp_path / "fast", persistent=tmp_path / "pers")
    assert tiers.fast.root == (tmp_path / "fast").absolute()


def test_the_fast_root_is_the_first_argument_and_none_is_refused(tmp_path):
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'fast'"):
        cg.TieredCheckpoint(tmp_path / "a", fast=tmp_path / "b")
    with pytest.raises(cg.ConfigError, match="give the fast tier's root"):
        cg.TieredCheckpoint(None, persistent=tmp_path / "p")
