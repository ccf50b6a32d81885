"""A fresh run's proof records, held in memory until the first save creates the root (issue 39, item
2).

They are written as soon as the save's prepare created the root, so a job-wide kill right after the
first commit (before the save record) leaves the steps the run recorded; prove then finds the
process that trained the saved step. The held records are bounded: the first ones and the newest,
the rest counted.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from pathlib import Path

import torch

import ckptguard as cg
from ckptguard._records import proofwriter
from ckptguard._records.proofwriter import ProofLog
from ckptguard.ops.prove import Status, evaluate
from ckptguard.testing import run_ranks, values

SAVED = 3


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class _Small(ProofLog):
    HELD_HEAD = 2
    HELD_MAX = 5


def test_held_records_keep_the_first_and_the_newest_and_are_written_in_order(tmp_path, caplog):
    root = tmp_path / "root"
    plog = _Small(root, 0)
    for i in range(1, 21):
        plog.keep(plog.build("step", step=i), durable=False)
    assert plog.held == 2 + 5 and not root.exists()  # bounded; a record never creates the root
    root.mkdir()  # what a save's prepare does
    with caplog.at_level(logging.WARNING, logger="ckptguard"):
        proofwriter.write_held()
    assert [r["step"] for r in _lines(plog.path)] == [1, 2, 16, 17, 18, 19, 20]
    assert plog.held == 0
    assert "13 proof records made before" in caplog.text and "were dropped" in caplog.text
    plog.keep(
        plog.build("step", step=21), durable=False
    )  # written at once now, after the held ones
    assert [r["step"] for r in _lines(plog.path)][-2:] == [20, 21]


def test_the_real_bound_holds_however_long_the_root_stays_absent(tmp_path):
    plog = ProofLog(tmp_path / "absent", 0)
    record = plog.build("step", step=1)
    for _ in range(plog.HELD_HEAD + plog.HELD_MAX + 1000):
        plog.hold(record)
    assert plog.held == plog.HELD_HEAD + plog.HELD_MAX and plog.dropped == 1000
    assert (
        plog.HELD_HEAD + plog.HELD_MAX <= 25_000
    )  # about 1.3 KB a step record: some 30 MB at most


def test_records_kept_while_a_background_save_creates_the_root_are_all_written_in_order(tmp_path):
    root = tmp_path / "root"
    plog = ProofLog(root, 0)
    stop = threading.Event()

    def background_save() -> None:  # a save_async's prepare: the root appears, the held records go
        root.mkdir()
        while not stop.is_set():
            proofwriter.write_held()

    saver = threading.Thread(target=background_save)
    for i in range(1, 2001):
        plog.keep(plog.build("step", step=i), durable=False)
        if i == 500:
            saver.start()
    stop.set()
    saver.join()
    assert [r["step"] for r in _lines(plog.path)] == list(range(1, 2001))


def _job(rank: int, world: int, root: str, resumed: bool) -> int:
    import torch.distributed as dist

    from ckptguard._disk import layout

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mgr = cg.CheckpointManager(root, config=cg.CheckpointConfig(timeout_s=60))
    state = {"model": model, "optim": opt}
    start = mgr.restore(state)
    pids: list[int] = [0] * world
    dist.all_gather_object(pids, os.getpid())
    if not resumed and rank == 0:
        write = layout.write_tracker

        def write_then_die(
            where: Path, step: int
        ) -> None:  # the campaign's after_commit kill, job-wide
            write(where, step)
            if step == SAVED:
                os.kill(pids[1 - rank], signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)

        layout.write_tracker = write_then_die
    for step in range(start + 1, start + 4):
        x = torch.full((2, 4), float(step))
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        mgr.record_step(step, sample_ids=[step, step + 100], loss=loss.item())
        if step == SAVED:
            mgr.save(step, state)
    mgr.save(start + 3, state)
    return start


def test_a_fresh_run_killed_right_after_its_first_commit_keeps_the_steps_it_recorded(tmp_path):
    root = tmp_path / "root"
    killed = run_ranks(_job, 2, str(root), False)
    assert [r.exitcode for r in killed] == [-signal.SIGKILL] * 2, killed
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == str(SAVED)
    for rank in (
        0,
        1,
    ):  # the records made before the root existed are on disk, no save record after them
        recs = _lines(root / "proof" / f"rank_{rank:05d}.jsonl")
        assert [(r["event"], r.get("step")) for r in recs] == [
            ("restore", 0),
            ("step", 1),
            ("step", 2),
            ("step", 3),
        ], recs
    assert values(run_ranks(_job, 2, str(root), True)) == [SAVED, SAVED]
    gates = {g.name: g for g in evaluate(root)}
    pids = gates["all PIDs changed"]
    assert pids.status is Status.PASS, (
        pids
    )  # without the held records: "no record of the process that saved"
    assert all(g.status is not Status.FAIL for g in gates.values()), [g for g in gates.values()]
