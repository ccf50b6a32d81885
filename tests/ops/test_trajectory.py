"""The proof sees the training: step fingerprints, the replay gates and the proof plan.

Each scenario runs a loop of ``ckptguard.demo.loops`` in two segments on real gloo ranks: the
first stops right after recording a step past its last save (its records are what a SIGKILL
there leaves), the second is a new process that resumes and replays those steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckptguard as cg
from ckptguard.cli import main
from ckptguard.demo import loops
from ckptguard.ops.prove import Status, evaluate, passed, verdict
from ckptguard.testing import run_ranks, values

SAVE_EVERY, STOP_AFTER, END = 5, 8, 10

ONE_RANK = {
    "prefetch_lost": {"prefetch": "lost"},
    "prefetch_saved": {"prefetch": "saved"},
    "shuffle_lost": {"sampler": "shuffle"},
    "shuffle_saved": {"sampler": "shuffle+generator"},
    "rl_sampling": {"rollout": True, "deterministic": False},
}
TWO_RANKS = {"prefetch_lost": {"prefetch": "lost"}, "prefetch_saved": {"prefetch": "saved"}}


def _segment(rank: int, world: int, base: str, scenarios: dict, second: bool) -> dict:
    out = {}
    for name, kwargs in scenarios.items():
        end = {"steps": END} if second else {"steps": END, "stop_after": STOP_AFTER}
        out[name] = loops.run(
            f"{base}/{name}", rank=rank, world=world, save_every=SAVE_EVERY, **end, **kwargs
        )
    return out


def _run_both(tmp_path: Path, world: int, scenarios: dict) -> dict[str, list[cg.ops.prove.Gate]]:
    first = values(run_ranks(_segment, world, str(tmp_path), scenarios, False))
    second = values(run_ranks(_segment, world, str(tmp_path), scenarios, True))
    assert {r["start"] for r in first[0].values()} == {0}
    assert {r["start"] for r in second[0].values()} == {SAVE_EVERY}
    return {name: evaluate(tmp_path / name) for name in scenarios}


def _by_name(gates) -> dict:
    return {g.name: g for g in gates}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    base = tmp_path_factory.mktemp("one")
    return base, _run_both(base, 1, ONE_RANK)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    base = tmp_path_factory.mktemp("two")
    return base, _run_both(base, 2, TWO_RANKS)


@pytest.mark.parametrize("world", [1, 2])
def test_a_lost_prefetched_batch_fails_data_order_and_names_the_step(world, one_rank, two_ranks):
    base, gates = one_rank if world == 1 else two_ranks
    lost = _by_name(gates["prefetch_lost"])
    data = lost["data order identical"]
    assert data.status is Status.FAIL
    assert "step 6 (first replayed step 6)" in data.evidence
    assert "what the killed run consumed at step 7" in data.evidence and "PerRank" in data.evidence
    assert verdict(gates["prefetch_lost"]) == "resume NOT proven: data order identical (FAIL)"
    # every other required gate passes: the files are fine, the trajectory is not
    assert [
        g.name for g in gates["prefetch_lost"] if g.required and g.status is not Status.PASS
    ] == ["data order identical", "replayed steps identical"]
    saved = gates["prefetch_saved"]
    assert passed(saved), [(g.name, g.status, g.evidence) for g in saved]
    assert _by_name(saved)["data order identical"].evidence.startswith(
        "steps 6-8 replayed after the restore of step 5"
    )
    assert f"on {world} rank(s)" in _by_name(saved)["data order identical"].evidence
    assert _by_name(saved)["first export byte-identical"].status is Status.NA
    assert _by_name(saved)["first export byte-identical"].evidence.startswith("(not an RL job)")
    # the command line reads the same: a one-line verdict, and --json
    shown = CliRunner().invoke(main, ["prove", str(base / "prefetch_lost")])
    assert shown.exit_code == 1 and "resume NOT proven: data order identical (FAIL)" in shown.output
    assert "step 6" in shown.output
    as_json = json.loads(
        CliRunner().invoke(main, ["prove", str(base / "prefetch_saved"), "--json"]).output
    )
    assert as_json["proven"] is True and as_json["verdict"] == "resume PROVEN"
    assert {g["status"] for g in as_json["gates"]} == {"PASS", "INFO", "N/A"}


def test_an_unsaved_sampler_generator_replays_the_first_epoch(one_rank):
    _, gates = one_rank
    data = _by_name(gates["shuffle_lost"])["data order identical"]
    assert data.status is Status.FAIL
    # epoch 3 starts at step 7: with a fresh generator it draws epoch 1's permutation
    assert "step 7 (first replayed step 6)" in data.evidence
    assert "the data of step 1 again" in data.evidence and "GeneratorState" in data.evidence
    assert passed(gates["shuffle_saved"]), [
        (g.name, g.status, g.evidence) for g in gates["shuffle_saved"]
    ]
    # 3 steps per epoch: the replayed steps 6-8 cross into epoch 3 at step 7, and the coverage line
    # says so
    cover = _by_name(gates["shuffle_saved"])["replay coverage"].evidence
    assert cover.startswith(
        "3 replayed step(s) compared on each of 1 rank(s); they crossed into the data's next "
        "pass: step 7 consumed sample "
    ), cover
    assert (
        "epoch boundary: not seen" in _by_name(gates["prefetch_saved"])["replay coverage"].evidence
    )


def test_non_deterministic_rl_step_data_exact_numbers_informational(one_rank):
    base, gates = one_rank
    rows = _by_name(gates["rl_sampling"])
    assert rows["data order identical"].status is Status.PASS
    info = rows["replayed steps identical"]
    assert info.status is Status.INFO and not info.required
    assert "largest difference" in info.evidence and "deterministic=False" in info.evidence
    assert verdict(gates["rl_sampling"]) == (
        "resume PROVEN (replayed numerics not compared: the plan declares non-deterministic steps)"
    )
    # the same records under a deterministic plan: not proven, the first differing step named with
    # both values
    strict = evaluate(base / "rl_sampling", plan=cg.ProofPlan(deterministic=True))
    gate = _by_name(strict)["replayed steps identical"]
    assert gate.status is Status.FAIL and gate.evidence.startswith("rank 0, step 6: loss ")
    assert "in the killed run" in gate.evidence and "after the resume" in gate.evidence
    assert verdict(strict) == "resume NOT proven: replayed steps identical (FAIL)"


def test_record_step_fields_and_records_made_before_the_root_exists(tmp_path):
    root = tmp_path / "ck"
    mgr = cg.CheckpointManager(root)
    a = mgr.record_step(
        1, sample_ids=[3, 1, 2], batch={"x": torch.arange(6)}, loss=torch.tensor(0.1), reward=2
    )
    b = mgr.record_step(
        1, sample_ids=torch.tensor([3, 1, 2]), batch={"x": torch.arange(6)}, loss=0.1
    )
    assert a["sample_ids"] == b["sample_ids"] and a["ids_head"] == [
        3,
        1,
        2,
    ]  # list and tensor of the same ids
    assert a["loss"] == float(torch.tensor(0.1)) and a["extra"] == {"reward": 2}
    with pytest.raises(cg.ConfigError, match=r"record_step\(tokens=...\).*not a scalar"):
        mgr.record_step(2, tokens=torch.ones(3))
    with pytest.raises(cg.ConfigError, match="step must be an int"):
        mgr.record_step(0)
    mgr.record_export(0, torch.zeros(2))
    assert not root.exists()  # a record never creates the root
    mgr.save(1, {"w": torch.zeros(2)})
    events = [
        json.loads(x)["event"] for x in (root / "proof/rank_00000.jsonl").read_text().splitlines()
    ]
    assert events == [
        "step",
        "step",
        "export",
        "save",
    ]  # made before the root existed, kept in order
