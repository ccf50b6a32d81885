"""Proof records are pruned at saves, never what a proof of a retained checkpoint reads.

Three processes of one job (``KeepLast(2)``, a save every 5 steps, ``ProofLog.PRUNE_BYTES``
0 so every save prunes): the first is killed after step 28 (last save 25), the second
resumes from 25 and is killed after step 53 (last save 50), the third resumes from 50. The
records file loses the steps no retained checkpoint's proof reads, keeps each killed segment
and the newest restore's window, and the resumes are still PROVEN.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import ckptguard as cg
from ckptguard._records import proofwriter
from ckptguard._records.proofreader import ProofRecord
from ckptguard.demo import loops
from ckptguard.ops.prove import evaluate, passed, verdict
from ckptguard.testing import run_ranks, values


def _segment(rank: int, world: int, root: str, steps: int, stop_after: int | None) -> int:
    proofwriter.ProofLog.PRUNE_BYTES = (
        0  # every save prunes (the default waits for 8 MiB of records, then doubling)
    )
    proofwriter.ProofLog.PRUNE_GROWTH = 0
    # Retention also keeps the newest verified step (trust), and pruning then keeps its records too;
    # this spawned worker pins KeepLast(2) alone, so the expected windows below are KeepLast's.
    from ckptguard.config import CheckpointConfig

    cg.CheckpointConfig = functools.partial(  # type: ignore[misc]
        CheckpointConfig, health=cg.HealthPolicy(verify_after=1_000_000)
    )
    return loops.run(root, steps=steps, save_every=5, stop_after=stop_after)["start"]


def _records(root: Path) -> list[dict]:
    return [
        json.loads(line) for line in (root / "proof" / "rank_00000.jsonl").read_text().splitlines()
    ]


def _steps(recs: list[dict], pid: int | None = None) -> list[int]:
    return [r["step"] for r in recs if r["event"] == "step" and (pid is None or r["pid"] == pid)]


def test_pruned_records_still_prove_every_resume_and_keep_the_killed_segment(tmp_path):
    root = tmp_path / "job"
    assert values(run_ranks(_segment, 1, str(root), 30, 28, distributed=False)) == [0]
    first = _records(root)
    # retained 20 and 25: the interval that led to save 20 on, and the killed segment 26-28
    assert _steps(first) == [*range(1, 6), *range(16, 29)], _steps(
        first
    )  # 1-5: the fresh start's window
    assert [r["step"] for r in first if r["event"] == "save"] == [5, 20, 25]

    assert values(run_ranks(_segment, 1, str(root), 55, 53, distributed=False)) == [25]
    gates = evaluate(root)  # the records on disk right after the kill: resume 25 -> replay 26-28
    assert passed(gates), verdict(gates)
    second = _records(root)
    pids = list(dict.fromkeys(r["pid"] for r in second))
    # step 25 stays on disk while the run restored from it lives (retention protects it): kept from
    # step 21
    assert _steps(second, pids[0]) == [*range(21, 29)] and _steps(second, pids[1]) == [
        *range(26, 54)
    ]

    assert values(run_ranks(_segment, 1, str(root), 60, None, distributed=False)) == [50]
    gates = evaluate(root)
    assert passed(gates), verdict(gates)
    replay = next(g for g in gates if g.name == "data order identical")
    assert "steps 51-53 replayed after the restore of step 50" in replay.evidence
    third = _records(root)
    # on disk 50 (restored), 55 and 60: from the interval before save 50 on, the killed segment
    # 51-53 in it
    assert [r["step"] for r in third if r["event"] == "restore"] == [50]
    assert _steps(third, pids[1]) == [*range(46, 54)] and pids[0] not in {r["pid"] for r in third}
    assert [r["step"] for r in third if r["event"] == "save"] == [50, 55, 60]


def test_nothing_is_pruned_without_the_save_a_proof_needs():
    def rec(event: str, step: int, pid: int = 1) -> ProofRecord:
        return ProofRecord.from_json({"event": event, "step": step, "pid": pid}, where="test")

    recs = [rec("step", 1), rec("save", 1), rec("step", 2), rec("save", 2), rec("step", 3)]
    assert proofwriter.prunable(recs, 2) == [
        (0, 2)
    ]  # everything before the interval that led to save 2
    assert proofwriter.prunable(recs, 7) == []  # no save of the oldest step on disk in this file
    restored = [
        rec("step", 1),
        rec("save", 1),
        rec("step", 2),
        rec("restore", 9, pid=2),
        rec("save", 10, pid=2),
    ]
    assert proofwriter.prunable(restored, 10) == []  # the restore's step 9 was never saved here


def test_a_restore_older_than_every_checkpoint_keeps_its_window():
    """The restored step was deleted by hand (``ckptguard gc``): the newest restore's proof still
    reads its saver's interval, its killed segment and its first records; the middle goes."""

    def rec(event: str, step: int, pid: int) -> ProofRecord:
        return ProofRecord.from_json({"event": event, "step": step, "pid": pid}, where="test")

    recs = [
        rec("step", 1, 1),
        rec("save", 1, 1),
        rec("step", 2, 1),
        rec("save", 2, 1),
        rec("step", 3, 1),
        rec("step", 4, 1),
        rec("restore", 2, 2),
        rec("step", 3, 2),
        rec("save", 3, 2),
        rec("step", 4, 2),
        rec("export", 4, 2),
        rec("step", 5, 2),
        rec("save", 5, 2),
        rec("step", 6, 2),
        rec("save", 6, 2),
        rec("step", 7, 2),
    ]
    # kept: step 2 .. the restore (the interval before save 2, the killed 3-4), after it up to its
    # first save, step 4 (killed up to 4) and the first export; then from the interval before save 6
    # on
    assert proofwriter.prunable(recs, 6) == [(0, 2), (11, 13)]
