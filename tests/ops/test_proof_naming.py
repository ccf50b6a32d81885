"""Every FAIL names the object and the cause class: a defect injected into a real 2-rank gloo job,
and the gate's evidence checked for the rank, tensor or cause it must name (a naming that regresses
fails here).

The job: a model with a Dropout (torch's global RNG) behind a DataLoader, gradients all-reduced, a
save every 3 steps. Segment 1 runs to step 4 and ends right after recording it (what a SIGKILL there
leaves); segment 2, a new process per rank, resumes from step 3 and replays step 4.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptguard as cg
from ckptguard._records.exportdigest import export_fingerprint
from ckptguard._records.proofwriter import ProofLog
from ckptguard.ops.prove import Outcome, Status, evaluate, outcome
from ckptguard.testing import run_ranks, values

SAMPLES, BATCH = 64, 4


class _Position:
    """How many batches this rank consumed: the loader is re-iterated and fast-forwarded after a
    restore."""

    def __init__(self) -> None:
        self.batches = 0

    def state_dict(self) -> dict[str, int]:
        return {"batches": self.batches}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.batches = int(sd["batches"])


def _job(
    rank: int, world: int, root: str, steps: int, stop_after: int | None, defect: str | None
) -> int:
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1)
    )
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = list(range(rank, SAMPLES, world))
    # The fix the proof names: a loader with its own generator draws nothing from torch's global RNG
    gen = None if defect == "loader_after_restore" else torch.Generator().manual_seed(1)
    loader = DataLoader(ids, batch_size=BATCH, generator=gen)
    position = _Position()
    state: dict[str, Any] = {"model": model, "optim": optim, "position": position}
    if gen is not None:
        state["loader_gen"] = cg.GeneratorState(gen)
    mgr = cg.CheckpointManager(
        root, config=cg.CheckpointConfig(proof=cg.ProofPlan(), retention=cg.KeepLast(2))
    )
    start = mgr.restore(state)
    if defect == "one_rank_rng" and start and rank == 1:
        torch.manual_seed(1234)  # rank 1's streams are not the ones saved (only rank 0's put back)
    if defect == "drift" and start and rank == 1:
        with torch.no_grad():  # a hook after restore() returned: rank 1's replica moves
            model[0].weight.add_(1e-3)
    it = iter(
        loader
    )  # created after restore(): without its own generator it draws from the restored RNG
    for _ in range(position.batches):
        next(it)
    for step in range(start + 1, steps + 1):
        batch = next(it)
        position.batches += 1
        x = torch.stack(
            [torch.randn(8, generator=torch.Generator().manual_seed(int(i))) for i in batch]
        )
        loss = model(x).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters())))
        optim.step()
        mgr.record_step(step, sample_ids=batch, loss=loss, grad_norm=norm)
        if step == stop_after:
            break
        if step % 3 == 0:
            try:
                mgr.save(step, state)
            except cg.ReplicatedDivergenceError:
                return start
    return start


def _resumed(tmp_path: Path, defect: str | None) -> list:
    root = str(tmp_path / "ck")
    torch.set_num_threads(1)
    assert values(run_ranks(_job, 2, root, 20, 4, defect)) == [0, 0]
    assert values(run_ranks(_job, 2, root, 6, None, defect)) == [3, 3]
    return evaluate(Path(root))


def _gate(gates: list, name: str):
    return next(g for g in gates if g.name == name)


def test_the_job_without_a_defect_is_proven(tmp_path):
    gates = _resumed(tmp_path, None)
    assert outcome(gates) is Outcome.PROVEN, [(g.name, g.status.value, g.evidence) for g in gates]
    for rank in (
        0,
        1,
    ):  # the streams after step 4: equal in the killed and the resumed run (a save draws nothing)
        lines = (tmp_path / "ck" / "proof" / f"rank_{rank:05d}.jsonl").read_text().splitlines()
        fours = [
            r["rng"] for r in map(json.loads, lines) if r["event"] == "step" and r["step"] == 4
        ]
        assert len(fours) == 2 and fours[0] == fours[1], fours


def test_one_ranks_rng_stream_not_restored_is_named_with_the_rank(tmp_path):
    gates = _resumed(tmp_path, "one_rank_rng")
    numbers = _gate(gates, "replayed steps identical")
    assert numbers.status is Status.FAIL and outcome(gates) is Outcome.DIVERGED
    assert numbers.evidence.startswith("rank 1, step 4: "), numbers.evidence
    assert (
        "Cause: rank 1's RNG stream: its global RNG streams (cpu) after step 4 differ"
        in numbers.evidence
    )
    assert "while rank(s) [0] match" in numbers.evidence


def test_a_dataloader_iterator_created_after_the_restore_is_named_with_the_fix(tmp_path):
    gates = _resumed(tmp_path, "loader_after_restore")
    numbers = _gate(gates, "replayed steps identical")
    assert numbers.status is Status.FAIL, numbers.evidence
    assert "differ from the killed run's on every rank ([0, 1])" in numbers.evidence
    assert "typically a DataLoader iterator created after restore()" in numbers.evidence
    assert (
        "DataLoader(..., generator=g)" in numbers.evidence
        and "ckptguard.DataCursor" in numbers.evidence
    )
    assert (
        "which is saved" not in numbers.evidence
    )  # the old hint pointed at the global RNG as the safe choice


def test_an_export_of_a_dict_of_tensors_names_the_tensors_that_differ(tmp_path):
    w, b = torch.arange(12.0).reshape(3, 4), torch.ones(3)
    delta = torch.full((3, 4), 0.5)
    saved = export_fingerprint(
        {"layer.weight": w + delta, "layer.bias": b}
    )  # the adapter merged once
    resumed = export_fingerprint(
        {"layer.weight": w + 2 * delta, "layer.bias": b}
    )  # merged again after the restore
    assert set(saved["tensors"]) == {"layer.weight", "layer.bias"}
    plan = {"rl": True, "deterministic": False, "replay_steps": 1}
    records = [
        {"event": "save", "pid": 1, "step": 6, "plan": plan},
        {"event": "export", "pid": 1, "step": 6, "fingerprint": saved},
        {"event": "restore", "pid": 2, "step": 6, "ok": True, "digests_match": {"model": True}},
        {"event": "export", "pid": 2, "step": 6, "fingerprint": resumed},
    ]
    path = tmp_path / "proof" / "rank_00000.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text(
        "".join(
            json.dumps({"rank": 0, "host": "h", "time": float(i), "mono": float(i), **r}) + "\n"
            for i, r in enumerate(records)
        )
    )
    export = _gate(evaluate(tmp_path), "first export byte-identical")
    assert export.status is Status.FAIL and "tensors ['layer.weight']" in export.evidence, (
        export.evidence
    )
    assert "layer.bias" not in export.evidence


@pytest.mark.parametrize("payload", [b"raw bytes", [torch.ones(2)], {}])
def test_an_export_that_is_not_a_dict_of_tensors_keeps_one_digest(payload):
    assert "tensors" not in export_fingerprint(payload)


def test_the_rng_streams_are_recorded_with_the_first_step_after_a_save_or_restore(tmp_path):
    proof = ProofLog(tmp_path, 0)
    assert "rng" not in proof.build("step", step=1)
    proof.build("save", step=1)
    first = proof.build("step", step=2)
    assert set(first["rng"]) >= {"cpu", "python", "numpy"}
    assert "rng" not in proof.build("step", step=3)
    torch.rand(1)  # a draw moves the CPU stream: the next digest after a restore differs
    proof.build("restore", step=3)
    assert proof.build("step", step=4)["rng"]["cpu"] != first["rng"]["cpu"]


def _records(tmp_path: Path, resumed_ids: list[str]) -> Path:
    plan = {"rl": False, "deterministic": True, "replay_steps": 1}
    killed = [
        {"event": "step", "pid": 1, "step": s, "sample_ids": f"a{s}", "ids_head": [s]}
        for s in (7, 8, 9)
    ]
    resumed = [
        {"event": "step", "pid": 2, "step": s, "sample_ids": f"a{i}", "ids_head": [i]}
        for s, i in zip((7, 8, 9), resumed_ids, strict=False)
    ]
    records = [
        {"event": "save", "pid": 1, "step": 6, "plan": plan},
        *killed,
        {"event": "restore", "pid": 2, "step": 6, "ok": True, "digests_match": {"model": True}},
        *resumed,
    ]
    path = tmp_path / "proof" / "rank_00000.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text(
        "".join(
            json.dumps({"rank": 0, "host": "h", "time": float(i), "mono": float(i), **r}) + "\n"
            for i, r in enumerate(records)
        )
    )
    return tmp_path


def test_a_cursor_saved_ahead_of_training_is_named_apart_from_a_lost_prefetch(tmp_path):
    # the prefetched batch was kept (step 7 matches), the cursor behind it was saved one batch ahead
    ahead = _gate(evaluate(_records(tmp_path / "ahead", ["7", "9"])), "data order identical")
    assert ahead.status is Status.FAIL and ahead.evidence.startswith("rank 0, step 8 "), (
        ahead.evidence
    )
    assert "Cursor saved ahead of training: steps 7-7 matched the killed run's" in ahead.evidence
    assert (
        "was 1 batch(es) ahead of the steps trained" in ahead.evidence
        and "prefetch) was lost" not in ahead.evidence
    )
    # the first replayed step is already ahead: a lost prefetch, or a cursor ahead with no prefetch
    # at all
    lost = _gate(evaluate(_records(tmp_path / "lost", ["8", "9"])), "data order identical")
    assert (
        lost.status is Status.FAIL
        and "a batch drawn before the save point (a prefetch) was lost" in lost.evidence
    )


def test_replicas_that_drift_after_the_restore_are_named_by_the_next_save(tmp_path):
    gates = _resumed(tmp_path, "drift")
    replicas = _gate(gates, "replicas equal after load")
    assert replicas.status is Status.FAIL and outcome(gates) is Outcome.DIVERGED, replicas.evidence
    assert (
        "the save of step 6 after the restore of step 3 found replicas that differ across ranks"
        in replicas.evidence
    )
    assert "model.0.weight" in replicas.evidence, replicas.evidence


def test_a_micro_batch_prefetch_lost_within_a_step_is_named_with_the_shift(tmp_path):
    # gradient accumulation, 2 micro-batches of 4 per step, the next drawn after each forward: the
    # killed run's step 7 read [P, A] (P drawn before the save of 6), the resumed run's [A, B]:
    # ahead by 4 samples
    mb = {s: list(range(100 + 4 * s, 104 + 4 * s)) for s in range(12, 20)}
    plan = {"rl": False, "deterministic": True, "replay_steps": 1}
    killed = [
        {
            "event": "step",
            "pid": 1,
            "step": s,
            "sample_ids": f"k{s}",
            "samples": 8,
            "ids_head": mb[2 * s - 2] + mb[2 * s - 1],
        }
        for s in (7, 8, 9)
    ]
    resumed = [
        {
            "event": "step",
            "pid": 2,
            "step": s,
            "sample_ids": f"r{s}",
            "samples": 8,
            "ids_head": mb[2 * s - 1] + mb[2 * s],
        }
        for s in (7, 8)
    ]
    records = [
        {"event": "save", "pid": 1, "step": 6, "plan": plan},
        *killed,
        {"event": "restore", "pid": 2, "step": 6, "ok": True, "digests_match": {"model": True}},
        *resumed,
    ]
    path = tmp_path / "proof" / "rank_00000.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text(
        "".join(
            json.dumps({"rank": 0, "host": "h", "time": float(i), "mono": float(i), **r}) + "\n"
            for i, r in enumerate(records)
        )
    )
    data = _gate(evaluate(tmp_path), "data order identical")
    assert data.status is Status.FAIL and data.evidence.startswith("rank 0, step 7 "), data.evidence
    assert (
        "Prefetch lost within the step: the resumed run's ids of step 7 start with the killed "
        "run's from position 4 on, so 4 sample(s) drawn before the save point" in data.evidence
    ), data.evidence
    assert (
        "consumed ids [152, 153, 154, 155] ... (digest r7)" in data.evidence
    )  # 4 of the 8 ids kept are shown
    assert "DataLoader" not in data.evidence
