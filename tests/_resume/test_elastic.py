"""Resume on a different number of ranks, exactly (FSDP2 on gloo): 4 -> 2, 2 -> 4, 2 -> 1, 1 -> 2.

A job with dropout reads a shuffled dataset through a ``DataCursor``: it trains K steps on the old
world, saves, trains two more steps (recorded) and SIGKILLs itself. The resume on the new world
first tries a state with an item that has no reshard rule (refused on every rank, nothing loaded),
then restores under ``ReshardRule.BY_ITEM`` and trains to the end of the epoch. Then: the gathered
parameters and Adam moments equal the saving run's bitwise; the sample ids of the whole run are one
uninterrupted epoch order (none repeated, none skipped); each rank's RNG streams are the rule's
derivation and differ across ranks; ``ckptguard prove`` passes and shows the reshard. A checkpoint
written before reshard rules existed (the v1 fixture) is resharded under the rules declared now.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

import ckptguard as cg
from ckptguard.demo.toyjob import FEATURES, build_job
from ckptguard.ops.prove import Status, evaluate, passed
from ckptguard.testing import run_ranks, values

N, B, K, SEED = 32, 2, 2, 11  # samples in the epoch, per-rank batch, saved step, the job's seed
FIXTURE = Path(__file__).parents[1] / "fixtures" / "v1"


def _split_tokens(old: list[int], new_world: int) -> list[int]:
    """The user rule of a per-rank token counter: the total is kept, spread over the new ranks."""
    total = sum(old)
    return [total // new_world + (1 if r < total % new_world else 0) for r in range(new_world)]


def _config(**kw) -> cg.CheckpointConfig:
    """The elastic job's config; ``kw`` changes fields of its ``ReshardOptions``."""
    reshard = cg.ReshardOptions(rule=cg.ReshardRule.BY_ITEM, rng_seed=SEED, replicated=("sched",))
    return cg.CheckpointConfig(
        reshard=dataclasses.replace(reshard, **kw),
        proof=cg.ProofPlan(deterministic=False, replay_steps=1),
    )


def _job(rank: int, world: int, seed: int):
    job = build_job(rank=rank, world=world, seed=seed)
    cursor = cg.DataCursor(N, seed=SEED, rank=rank, world_size=world)
    tokens = cg.PerRank(0, reshard=_split_tokens)
    gen = cg.GeneratorState(
        torch.Generator().manual_seed(seed + rank)
    )  # a per-rank augmentation stream
    state = {
        "model": job.model,
        "optim": job.optim,
        "sched": job.sched,
        "data": cursor,
        "tokens": tokens,
        "gen": gen,
    }
    return job, cursor, tokens, state


def _step(mgr, job, cursor, tokens, step: int, gen: cg.GeneratorState) -> list[int]:
    ids = cursor.take(B)
    x = torch.randn(N, FEATURES, generator=torch.Generator().manual_seed(5))[ids]
    x = x + 0.01 * torch.randn(x.shape, generator=gen.generator)
    loss = torch.nn.functional.mse_loss(
        job.model(x), x[:, :2].sum(1, keepdim=True).sin()
    )  # dropout draws RNG
    job.optim.zero_grad(set_to_none=True)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(job.model.parameters(), 1e9)
    job.optim.step()
    job.sched.step()
    tokens.value += len(ids)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    mgr.record_step(step, sample_ids=ids, loss=loss, grad_norm=norm)
    return ids


def _full(job) -> dict[str, torch.Tensor]:
    """Every parameter and Adam moment, gathered whole (collective under FSDP2)."""

    def whole(t):
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()

    out = {}
    for name, p in job.model.named_parameters():
        out[name] = whole(p)
        for key in ("exp_avg", "exp_avg_sq"):
            if key in job.optim.state.get(p, {}):
                out[f"{name}:{key}"] = whole(job.optim.state[p][key])
    return out


def _train_and_kill(rank: int, world: int, root: str, out: str) -> None:
    job, cursor, tokens, state = _job(rank, world, seed=0)
    mgr = cg.CheckpointManager(root, config=_config())
    assert mgr.restore(state) == 0
    ids = [_step(mgr, job, cursor, tokens, s, state["gen"]) for s in range(1, K + 1)]
    mgr.save(K, state)
    torch.save({"full": _full(job), "ids": ids, "tokens": tokens.value}, f"{out}/rank{rank}.pt")
    for s in (K + 1, K + 2):  # the segment the kill loses, recorded for the proof
        _step(mgr, job, cursor, tokens, s, state["gen"])
    if world > 1:
        torch.distributed.barrier()  # every rank's records are written before any rank dies
    os.kill(os.getpid(), signal.SIGKILL)


def _streams() -> list[bytes]:
    return [
        torch.get_rng_state().numpy().tobytes(),
        np.random.get_state()[1].tobytes(),
        repr(random.getstate()).encode(),
    ]


def _resume(rank: int, world: int, root: str) -> dict:
    job, cursor, tokens, state = _job(
        rank, world, seed=99
    )  # other weights: the restore must overwrite them
    mgr = cg.CheckpointManager(root, config=_config())
    out: dict = {}
    before = _full(job)
    try:  # an item without a rule: refused on every rank, before anything is loaded
        mgr.restore({**state, "tokens": cg.PerRank(-1)})
    except cg.TopologyMismatchError as exc:
        out["refused"] = str(exc)
    after = _full(job)
    out["untouched"] = (
        all(torch.equal(before[k], after[k]) for k in before) and cursor.consumed == 0
    )
    assert mgr.restore(state) == K
    out["streams"] = _streams()
    out["gen"] = state["gen"].generator.get_state()
    out["full"] = _full(job)
    out["tokens"] = tokens.value
    out["ids"], step = [], K
    while not cursor.exhausted(B):
        step += 1
        out["ids"].append(_step(mgr, job, cursor, tokens, step, state["gen"]))
    return out


def _derived(rank: int) -> list[bytes]:
    """The rule's derivation as the README states it: xxh3_64("ckptguard-rng:{seed}:{step}:{rank}")
    & (2**63 - 1)."""
    s = xxhash.xxh3_64_intdigest(f"ckptguard-rng:{SEED}:{K}:{rank}".encode()) & ((1 << 63) - 1)
    torch.manual_seed(s)
    np.random.seed(s % (1 << 32))
    random.seed(s)
    return _streams()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[int, tuple[Path, list]]:
    """One killed run per old world size: its root and, per rank, what it had at the save."""
    out = {}
    for world in (4, 2, 1):
        base = tmp_path_factory.mktemp(f"saved_on_{world}")
        results = run_ranks(_train_and_kill, world, str(base / "root"), str(base))
        assert [r.exitcode for r in results] == [-signal.SIGKILL] * world, [
            (r.error_type, r.error) for r in results
        ]
        out[world] = (base / "root", [torch.load(base / f"rank{r}.pt") for r in range(world)])
    return out


@pytest.mark.parametrize(("old", "new"), [(4, 2), (2, 4), (2, 1), (1, 2)])
def test_resume_on_another_world_size_is_exact_and_proven(saved, tmp_path, old, new):
    src, at_save = saved[old]
    root = tmp_path / "root"
    shutil.copytree(src, root)
    rules = json.loads((root / "step_00000002" / "manifest.json").read_text())["reshard"]
    assert {n: r["rule"] for n, r in rules.items()} == {
        "model": "dcp",
        "optim": "dcp",
        "sched": "replicated",
        "data": "data_cursor",
        "tokens": "user",
        "gen": "rng_rederive",
        "_rng": "rng_rederive",
    }
    assert rules["_rng"]["seed"] == SEED and rules["tokens"]["fn"].endswith("_split_tokens")
    out = values(run_ranks(_resume, new, str(root)))

    for r in (
        out
    ):  # refused on every rank, naming the item and the rule that would apply; nothing loaded
        assert "'tokens'" in r["refused"] and "reshard=f" in r["refused"]
        assert "before anything is loaded" in r["refused"]
        assert r["untouched"]
    # Gathered parameters and Adam moments right after the restore: the saving run's, bitwise.
    for r in out:
        assert r["full"].keys() == at_save[0]["full"].keys()
        assert all(torch.equal(r["full"][k], at_save[0]["full"][k]) for k in r["full"])
    # One uninterrupted epoch order over the whole run: steps 1-K on the old ranks, then the rest on
    # the new.
    order = cg.DataCursor(N, seed=SEED).order(0)
    before = [i for s in range(K) for rank in at_save for i in rank["ids"][s]]
    after = [i for s in range(len(out[0]["ids"])) for r in out for i in r["ids"][s]]
    assert before + after == order and sorted(before + after) == list(range(N))
    # The user rule kept the total of the per-rank counter at the save.
    assert sum(r["tokens"] for r in out) == sum(rank["tokens"] for rank in at_save) == K * B * old
    # Each rank's streams are the rule's derivation from (seed, step, rank), and no two ranks share
    # them.
    assert [r["streams"] for r in out] == [_derived(rank) for rank in range(new)]
    assert len({tuple(r["streams"]) for r in out}) == new
    for rank, r in enumerate(
        out
    ):  # a GeneratorState item: the same rule, its name mixed into the seed
        text = f"ckptguard-rng:{SEED}:{K}:{rank}:gen".encode()
        seed = xxhash.xxh3_64_intdigest(text) & ((1 << 63) - 1)
        assert torch.equal(r["gen"], torch.Generator().manual_seed(seed).get_state())

    gates = evaluate(root)
    assert passed(gates), [
        (g.name, g.status.value, g.evidence) for g in gates if g.status is not Status.PASS
    ]
    shown = {g.name: g for g in gates}
    assert shown["resharded resume"].evidence.startswith(f"{old} -> {new} ranks under by_item: ")
    assert f"_rng=rng_rederive(seed {SEED})" in shown["resharded resume"].evidence
    assert "data=data_cursor" in shown["resharded resume"].evidence
    assert shown["RNG streams distinct across ranks"].status is Status.PASS
    data = shown["data order identical"].evidence
    assert f"resharded {old} -> {new} ranks" in data and "multiset over the union of ranks" in data
    if (old, new) == (1, 2):  # the CLI shows it: the reshard, the rules, and the verdict
        from click.testing import CliRunner

        from ckptguard.cli import main

        shown_cli = CliRunner().invoke(main, ["prove", str(root)])
        assert shown_cli.exit_code == 0 and "resume PROVEN" in shown_cli.output, shown_cli.output
        assert (
            "resharded resume" in shown_cli.output
            and "1 -> 2 ranks under by_item" in shown_cli.output
        )
    if (old, new) == (
        2,
        1,
    ):  # the resumed run's first step read step 1's samples again: caught over the union
        _replay_step_one(root / "proof" / "rank_00000.jsonl", before[:B])
        data = next(g for g in evaluate(root) if g.name == "data order identical")
        assert data.status is Status.FAIL and "a sample was repeated or skipped" in data.evidence


def _replay_step_one(path: Path, ids: list[int]) -> None:
    from ckptguard._state.trajectory import ids_fields

    lines = [json.loads(line) for line in path.read_text().splitlines()]
    last = max(i for i, r in enumerate(lines) if r["event"] == "step" and r["step"] == K + 1)
    lines[last].update(ids_fields(ids))
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))


def _format1(rank: int, world: int, v1_root: str) -> dict:
    # A checkpoint written before reshard rules (format 1 fixture, one rank) reshards under the
    # rules declared now.
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 2)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    v1 = {"model": model, "optim": optim, "sched": sched, "tokens_seen": 0}
    cfg = _config(replicated=("sched", "tokens_seen"))
    step = cg.CheckpointManager(v1_root, config=cfg).restore(v1)
    return {
        "v1_step": step,
        "v1": (model.weight.tolist(), model.bias.tolist(), sched.get_last_lr(), v1["tokens_seen"]),
    }


def test_a_checkpoint_written_before_reshard_rules_reshards_under_the_rules_declared_now(tmp_path):
    v1_root = tmp_path / "v1"
    shutil.copytree(FIXTURE / "root", v1_root)
    out = values(run_ranks(_format1, 2, str(v1_root)))
    expected = json.loads((FIXTURE / "expected.json").read_text())
    for r in out:
        assert r["v1_step"] == expected["step"]
        assert r["v1"] == (expected["weight"], expected["bias"], expected["lr"], 1536)


def test_data_cursor_partitions_the_rest_of_an_epoch_exactly_once():
    order = cg.DataCursor(23, seed=3).order(0)
    assert sorted(order) == list(range(23)) and order != list(range(23))
    three = [cg.DataCursor(23, seed=3, rank=r, world_size=3) for r in range(3)]
    assert [i for c in three for i in c.take(2)] == order[
        :6
    ]  # one global batch, rank r the r-th block
    state = three[0].state_dict()
    assert (
        all(c.state_dict() == state for c in three) and state["consumed"] == 6
    )  # no rank in the state

    def on_two():
        two = [cg.DataCursor(23, seed=3, rank=r, world_size=2) for r in range(2)]
        for c in two:
            c.load_state_dict(state)
        return two

    two = on_two()
    assert [c.remaining(2) for c in two] == [
        9,
        8,
    ]  # 17 left: 4 global batches, then 1 id for rank 0
    per_rank: list[list[int]] = [[], []]
    rest = []
    while not two[0].exhausted(2):
        for r, c in enumerate(two):
            ids = c.take(2)
            per_rank[r] += ids
            rest += ids
    assert rest == order[6:]  # the rest of the epoch, re-partitioned, each id once
    # As a Sampler: the same ids per rank; iterating an exhausted cursor starts the next epoch.
    again = on_two()
    assert [list(c.sampler(2)) for c in again] == per_rank
    assert [len(c.sampler(2)) for c in again] == [12, 11] and all(c.epoch == 0 for c in again)
    # Through a DataLoader (no workers) the position is what the loop has received.
    third = on_two()[1]
    loader = torch.utils.data.DataLoader(torch.arange(23), batch_size=2, sampler=third.sampler(2))
    first = next(iter(loader))
    assert first.tolist() == order[8:10] and third.consumed == 10
    # Padding fills the last batch from the head of the order; drop_last skips the short tail.
    pad = [cg.DataCursor(5, shuffle=False, pad=True, rank=r, world_size=2) for r in range(2)]
    assert [c.take(2) for c in pad] == [[0, 1], [2, 3]] and [c.take(2) for c in pad] == [
        [4, 0],
        [1, 2],
    ]
    drop = cg.DataCursor(5, shuffle=False, drop_last=True, rank=1, world_size=2)
    assert (
        drop.take(2) == [2, 3] and drop.exhausted(2) and drop.take(2) == [2, 3] and drop.epoch == 1
    )
    with pytest.raises(cg.ConfigError, match="seed=3"):
        cg.DataCursor(23, seed=4).load_state_dict(state)


def test_rules_refuse_what_they_cannot_carry(saved, tmp_path):
    """In one process, from the 2-rank save onto 1 rank: each refusal names the item and the fix,
    and leaves the live objects as they were."""
    root = tmp_path / "root"
    shutil.copytree(saved[2][0], root)
    manifest = root / "step_00000002" / "manifest.json"
    job, cursor, tokens, state = _job(0, 1, seed=99)
    before = _full(job)

    def refused(error, match, live=state, **cfg):
        with pytest.raises(error, match=match):
            cg.CheckpointManager(root, config=_config(**cfg)).restore(live)
        assert (
            all(torch.equal(before[k], v) for k, v in _full(job).items()) and cursor.consumed == 0
        )

    refused(
        cg.TopologyMismatchError,
        r"'world_size': 2.*'world_size': 1.*ReshardRule.BY_ITEM",
        rule=cg.ReshardRule.REFUSE,
    )
    refused(
        cg.TopologyMismatchError,
        r"item 'data' was saved under the rule 'data_cursor' and declares 'user'",
        {**state, "data": cg.PerRank(0, reshard=_split_tokens)},
    )
    refused(
        cg.StateMismatchError,
        r"_rules_refuse.*<lambda> of item 'tokens' returned a list of 2.*list of 1",
        {**state, "tokens": cg.PerRank(0, reshard=lambda old, new: old)},
    )
    refused(
        cg.TopologyMismatchError,
        r"item 'sched' \(stateful\) has no rule.*replicated=",
        replicated=(),
    )
    data = json.loads(manifest.read_text())
    del data["reshard"]["_rng"]  # as a save without rng_seed (or an older ckptguard) writes it
    data["digests"]["1"]["sched"] = "0" * 16
    manifest.write_text(json.dumps(data))
    refused(
        cg.TopologyMismatchError,
        r"the RNG streams .* have no rule: set CheckpointConfig\(reshard=ReshardOptions\(rng_seed=",
        rng_seed=None,
    )
    refused(
        cg.StateMismatchError,
        r"item 'sched' \(rule replicated\) was saved with different values.*ranks \[0\]; "
        r"ranks \[1\]",
    )
    assert tokens.value == 0
