"""The proof's "replicas equal after load" gate (issue 29, item 3) on 2 gloo ranks of a real DDP
job.

Every tensor that several ranks hold (DDP parameters, their Adam moments) must have one value
across its holders after the restore, equal to the save's. A load that leaves rank 1 with another
value (Megatron-LM PR#6920: a skipped post-load all-gather) fails the restore on every rank naming
the tensor and the ranks on each side, and ``prove`` FAILs the gate; an optimizer moment dropped on
one rank (AReaL PR#1468) is named too; an exact restore PASSes.
"""

from __future__ import annotations

from pathlib import Path

import torch

import ckptguard as cg
from ckptguard import ReshardOptions
from ckptguard._resume.layoutcheck import describe_replicas, replica_report
from ckptguard.ops.prove import Status, evaluate
from ckptguard.testing import run_ranks, values


class _Net(torch.nn.Module):
    """A tiny model; ``tamper`` adds 1 to ``fc.weight`` after every load on this rank."""

    def __init__(self, tamper: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(4, 3)
        self.tamper = tamper

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)

    def load_state_dict(self, *args, **kwargs):  # type: ignore[override]
        out = super().load_state_dict(*args, **kwargs)
        if self.tamper:
            with torch.no_grad():
                self.fc.weight.add_(1.0)
        return out


class _DroppingAdam(torch.optim.Adam):
    """Drops the first parameter's ``exp_avg`` after every load on this rank."""

    def __init__(self, params, drop: bool = False) -> None:
        super().__init__(params, lr=0.1)
        self.drop = drop

    def load_state_dict(self, state_dict):  # type: ignore[override]
        super().load_state_dict(state_dict)
        if self.drop:
            first = self.param_groups[0]["params"][0]
            self.state[first].pop("exp_avg", None)


def _job(rank: int, root: str, tamper: bool = False, drop: bool = False):
    net = _Net(tamper=tamper)
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = _DroppingAdam(model.parameters(), drop=drop)
    mgr = cg.CheckpointManager(root, config=cg.CheckpointConfig(timeout_s=60))
    return net, model, opt, mgr, {"model": net, "optim": opt}


def _train_and_save(rank: int, world: int, root: str) -> None:
    _net, model, opt, mgr, state = _job(rank, root)
    for step in (1, 2):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step * 10 + rank))
        model(x).square().mean().backward()  # DDP averages the gradients: replicas stay equal
        opt.step()
        opt.zero_grad()
        mgr.record_step(step, loss=1.0, grad_norm=1.0)
    mgr.save(2, state)


def _restore(
    rank: int, world: int, root: str, tamper_rank: int | None, drop_rank: int | None
) -> str:
    *_built, mgr, state = _job(rank, root, tamper=rank == tamper_rank, drop=rank == drop_rank)
    try:
        mgr.restore(state)
    except cg.StateMismatchError as exc:
        return f"StateMismatchError: {exc}"
    return "restored"


def _gate(root: Path):
    gates = {g.name: g for g in evaluate(root)}
    return gates["replicas equal after load"]


def _saved(tmp_path: Path, name: str) -> Path:
    root = tmp_path / name
    values(run_ranks(_train_and_save, 2, str(root)))
    return root


def test_exact_restore_passes_and_a_replica_loaded_differently_fails_on_every_rank(tmp_path):
    root = _saved(tmp_path, "exact")
    assert values(run_ranks(_restore, 2, str(root), None, None)) == ["restored", "restored"]
    gate = _gate(root)
    assert gate.status is Status.PASS and gate.required, gate
    # fc.weight and fc.bias, their two Adam moments and Adam's step tensors: held by both ranks
    assert "8 tensor chunk(s) held by several ranks (up to 2 each)" in gate.evidence, gate

    root = _saved(tmp_path, "tampered")
    out = values(run_ranks(_restore, 2, str(root), 1, None))
    for text in out:  # every rank refuses, with the same words
        assert (
            text.startswith("StateMismatchError: ") and "differ between their replicas" in text
        ), text
        assert "'model.fc.weight' (item 'model', offset (0, 0)): ranks [0] vs ranks [1]" in text, (
            text
        )
    gate = _gate(root)
    assert (
        gate.status is Status.FAIL
        and "'model.fc.weight' (item 'model'): ranks [0] vs ranks [1]" in gate.evidence
    )


def test_an_optimizer_moment_dropped_on_one_rank_is_named(tmp_path):
    root = _saved(tmp_path, "dropped")
    out = values(run_ranks(_restore, 2, str(root), None, 1))
    assert all(t.startswith("StateMismatchError: ") for t in out), out
    assert (
        "rank 1: " in out[0] and "state item 'optim' (optimizer) differs after restore" in out[0]
    ), out[0]
    assert (
        "tensors saved and missing after the load: ['optim.state.fc.weight.exp_avg']" in out[0]
    ), out[0]
    assert "rank 0:" not in out[0]  # rank 0 loaded its moments


def test_replica_report_names_each_side_and_counts_what_it_compared():
    a = {
        "m.w@(0,)": ["m", "m.w", "torch.float32|(4,)", "01"],
        "m.s@(0,)": ["m", "m.s", "torch.float32|(2,)", "0a"],
        "m.own@(2,)": ["m", "m.own", "torch.float32|(4,)", "05"],
    }
    b = {
        "m.w@(0,)": ["m", "m.w", "torch.float32|(4,)", "02"],
        "m.s@(0,)": ["m", "m.s", "torch.float32|(2,)", "0a"],
        "m.own@(0,)": ["m", "m.own", "torch.float32|(4,)", "07"],
    }
    c = {"m.w@(0,)": ["m", "m.w", "torch.float32|(4,)", "01"]}
    report = replica_report([a, b, c])
    assert (
        report["checked"] == 2 and report["most"] == 3 and report["differing"] == 1
    )  # m.own: one holder each
    assert report["differ"] == [
        {"item": "m", "key": "m.w", "offset": "(0,)", "ranks": [[0, 2], [1]]}
    ]
    assert "'m.w' (item 'm', offset (0,)): ranks [0, 2] vs ranks [1]" in describe_replicas(report)
    alone = replica_report([a])
    assert alone["checked"] == 0 and alone["world"] == 1 and describe_replicas(alone) == ""


class _Counter:
    """A stateful object; ``skew`` makes this rank's load keep another value."""

    def __init__(self, skew: bool = False) -> None:
        self.n, self.skew = 0, skew

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        self.n = sd["n"] + (1 if self.skew else 0)


def _counter_job(rank: int, world: int, root: str, skew_rank: int | None, save: bool) -> str:
    net = _Net()
    counter = _Counter(skew=not save and rank == skew_rank)
    config = cg.CheckpointConfig(timeout_s=60, reshard=ReshardOptions(replicated=("counter",)))
    mgr = cg.CheckpointManager(root, config=config)
    state = {"model": net, "counter": counter}
    if save:  # skew_rank saves another value: the replicas had diverged before the save
        counter.n = 7 + (rank == skew_rank)
        mgr.save(1, state)
        return "saved"
    try:
        mgr.restore(state)
    except cg.StateMismatchError as exc:
        return f"StateMismatchError: {exc}"
    return "restored"


def test_an_item_declared_replicated_must_hold_one_value_on_every_rank(tmp_path):
    exact = str(tmp_path / "exact")
    values(run_ranks(_counter_job, 2, exact, None, True))
    assert values(run_ranks(_counter_job, 2, exact, None, False)) == ["restored", "restored"]
    # rank 1 loads another value: its own digest check names the item
    out = values(run_ranks(_counter_job, 2, exact, 1, False))
    assert all("rank 1: " in t and "state item 'counter' (stateful) differs" in t for t in out), out
    # the replicas diverged before the save: each rank restores what it saved (its own check
    # passes), and only the replica check sees that the declared-replicated item has two values
    diverged = str(tmp_path / "diverged")
    values(run_ranks(_counter_job, 2, diverged, 1, True))
    out = values(run_ranks(_counter_job, 2, diverged, None, False))
    named = "item 'counter' (declared in ReshardOptions.replicated): ranks [0] vs ranks [1]"
    assert all(named in t for t in out), out
    gate = _gate(Path(diverged))
    assert gate.status is Status.FAIL
    assert "item 'counter' (declared replicated): ranks [0] vs ranks [1]" in gate.evidence, gate
