"""The first write error names its cause: a per-rank extras file that hits ENOSPC is an OSError with
errno 28, its path and offset (not torch's "unexpected pos", errno 0), and across ranks the error
that carries an errno is "the first" over an earlier symptom without one.

ENOSPC comes from /dev/full: a storage (the public seam) links the rank's extras name to it after
writing the tensors, so the extras write is the one that fails, mid-file, like a full disk.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import torch

import ckptguard as cg
from ckptguard import ProofPlan
from ckptguard.errors import CheckpointWriteError, WriteFailure
from ckptguard.storage import StreamingStorage
from ckptguard.testing import run_ranks, values


class _FullExtras(StreamingStorage):
    """Rank ``full``'s extras go to /dev/full; rank ``symptom`` fails first without an errno."""

    def __init__(self, rank: int, full: int, symptom: int | None) -> None:
        super().__init__()
        self.rank, self.full, self.symptom = rank, full, symptom

    def write(self, state_dir, tensors, ctx):
        files = super().write(state_dir, tensors, ctx)  # collective: both ranks take part
        if self.rank == self.symptom:
            raise RuntimeError(
                "[enforce fail at inline_container.cc:672] . unexpected pos 1216 vs 1110"
            )
        if self.rank == self.full:
            time.sleep(
                0.3
            )  # after the other rank's symptom: "first" by time alone would pick that one
            os.symlink("/dev/full", Path(state_dir).parent / f"rank_{self.rank:05d}.pt")
        return files


def _job(rank: int, world: int, root: str, symptom: int | None) -> dict:
    mgr = cg.CheckpointManager(
        root,
        config=cg.CheckpointConfig(timeout_s=30.0, proof=ProofPlan(record=False)),
        storage=_FullExtras(rank, 1, symptom),
    )
    state = {"w": torch.zeros(4), "mine": cg.PerRank(torch.full((4096,), float(rank)))}
    try:
        mgr.save(1, state)
    except CheckpointWriteError as exc:
        f = exc.first
        return {
            "errno": exc.errno,
            "first": f.__dict__ if f else None,
            "msg": str(exc),
            "all": [x.__dict__ for x in exc.failures],
        }
    return {"errno": None}


def test_an_enospc_on_the_per_rank_extras_names_errno_path_and_offset(tmp_path):
    for r in values(run_ranks(_job, 2, str(tmp_path / "ck"), None, timeout=120)):
        first = r["first"]
        assert first is not None and first["rank"] == 1, r
        assert first["errno"] == errno.ENOSPC and r["errno"] == errno.ENOSPC, r
        assert first["path"] and first["path"].endswith("rank_00001.pt"), r
        assert first["offset"] is not None and first["exc_type"] == "OSError", r
        assert "unexpected pos" not in first["message"], r


def test_the_os_error_is_the_first_error_over_an_earlier_symptom(tmp_path):
    for r in values(run_ranks(_job, 2, str(tmp_path / "ck"), 0, timeout=120)):
        first = r["first"]
        assert first["rank"] == 1 and first["errno"] == errno.ENOSPC, (
            "the symptom was picked over the cause",
            r,
        )
        assert (
            "rank 1" in r["msg"].split("first error:")[1][:20] and "errno 28 (ENOSPC)" in r["msg"]
        ), r["msg"]


def test_cause_order_prefers_an_errno_then_time_and_keeps_collateral_failures_last():
    early_symptom = WriteFailure(
        rank=0, phase="write", exc_type="RuntimeError", message="unexpected pos", time_ns=1
    )
    late_cause = WriteFailure(
        rank=1, phase="write", exc_type="OSError", message="full", errno=28, time_ns=5
    )
    collateral = WriteFailure(
        rank=2,
        phase="write (another rank failed first)",
        exc_type="OSError",
        message="x",
        errno=5,
        time_ns=10**18 + 2,
    )
    err = CheckpointWriteError("x", step=1, failures=[early_symptom, collateral, late_cause])
    assert err.first == late_cause and err.errno == 28
    assert (
        CheckpointWriteError("x", step=1, failures=[early_symptom, collateral]).first
        == early_symptom
    )
