"""benchmarks/proof_campaign.py in small, on examples/nanogpt.py (nanoGPT's train.py shape: a
memmap'd token file, get_batch from torch's global RNG with a prefetch, grad accumulation under DDP,
eval on rank 0 from the same RNG): 2 gloo ranks SIGKILLed with one rank ahead of the other, then in
a crash loop, then run past the next commit. No resume of this exact job may be called NOT proven,
the last one is PROVEN (by ``evaluate`` and by ``ckptguard prove --all --json`` alike), and every
step every launch recorded, and the final checkpoint, are bitwise an uninterrupted run's."""

from __future__ import annotations

import importlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

CAMPAIGN = Path(__file__).resolve().parents[2] / "benchmarks" / "proof_campaign.py"
STEPS = 100000  # never reached: every launch ends by a kill, as in the campaign

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
]  # 4 launches of 2 gloo ranks and a reference run


def _campaign(monkeypatch: pytest.MonkeyPatch) -> Any:
    # importable by name: the forkserver's ranks unpickle their target from it (the parent's
    # sys.path goes along)
    monkeypatch.syspath_prepend(str(CAMPAIGN.parent))
    monkeypatch.delitem(sys.modules, "proof_campaign", raising=False)
    return importlib.import_module("proof_campaign")


def test_nanogpt_killed_rank_ahead_and_in_a_crash_loop_is_never_called_not_proven(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    camp = _campaign(monkeypatch)
    root, ref, log = tmp_path / "ck", tmp_path / "ref" / "ck", tmp_path / "ranks.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # 1: after the commit of step 4 and rank 0's record of step 5, rank 1 stopped (one record behind
    # or level); rank 0 runs on until it blocks in a collective; both killed
    first = camp.Launch("nanogpt", root, STEPS, env, log)
    assert first.wait(
        lambda: (
            camp._tracker(root) >= 4
            and any(r["step"] > 4 for r in camp._since(root, first.since, "step"))
        )
    ), log.read_text()[-3000:]
    os.kill(first.rank_pid(1), signal.SIGSTOP)
    time.sleep(0.5)
    assert first.kill() == []
    # 2: a crash loop's kill, right after the first step past the restore
    second = camp.Launch("nanogpt", root, STEPS, env, log)
    assert second.wait(lambda: bool(camp._since(root, second.since, "step"))), log.read_text()[
        -3000:
    ]
    assert second.kill() == []
    # 3: until a step past a new commit is recorded; then the same job never killed, as far
    camp._finish("nanogpt", root, STEPS, env, log)
    camp.reference_run("nanogpt", root, ref, STEPS, env, log)

    rows = camp.judge("nanogpt", root)
    assert len(rows) == 2, rows  # launches 2 and 3 resumed
    assert [r for r in rows if r["outcome"] == "diverged"] == [], [r["failed"] for r in rows]
    assert rows[-1]["outcome"] == "proven", rows[-1]
    # evidence is missing only where no run recorded a step past the restored one before the resume
    assert all(not r["recorded_past_before"] for r in rows if r["outcome"] == "evidence missing"), (
        rows
    )
    assert [r["cli"].get("outcome") for r in rows] == [r["outcome"] for r in rows], [
        r["cli"] for r in rows
    ]
    records = camp.compare_records(root, ref)
    assert records["compared"] >= 8 and records["differ"] == [], records
    final = camp.compare_final(root, ref)
    assert final["compared"] and final["differ"] == [] and final["tensors"] > 0, final
