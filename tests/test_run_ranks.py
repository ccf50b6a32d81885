"""ckptguard.testing.run_ranks forks its ranks from a fork server that imported torch once; each
rank must still start as a spawned process would: the caller's environment and working directory at
the call (not the server's from its start), its output captured with the caller's, its own random
streams."""

from __future__ import annotations

import os
import random
import signal
import sys

import numpy as np
import torch

from ckptguard.testing import run_ranks, values


def _report(rank: int, world: int, tag: str) -> dict:
    print(f"stdout of rank {rank} for {tag}", flush=True)
    print(f"stderr of rank {rank} for {tag}", file=sys.stderr, flush=True)
    return {
        "env": os.environ.get("CKPTGUARD_TEST_RUN_RANKS"),
        "cwd": os.getcwd(),
        "torch": torch.rand(4).tolist(),
        "numpy": np.random.rand(4).tolist(),
        "random": random.random(),
        "world": torch.distributed.get_world_size(),
    }


def _die(rank: int, world: int) -> None:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    raise ValueError(f"rank {rank} raised")


def test_ranks_start_with_the_callers_environment_output_and_fresh_random_streams(
    tmp_path, monkeypatch, capfd
):
    for n, where in enumerate(
        (tmp_path / "a", tmp_path / "b")
    ):  # the second call runs on a started server
        where.mkdir()
        monkeypatch.chdir(where)
        monkeypatch.setenv("CKPTGUARD_TEST_RUN_RANKS", f"call {n}")
        out = values(run_ranks(_report, 2, f"call {n}"))
        assert [o["env"] for o in out] == [f"call {n}"] * 2 and [o["cwd"] for o in out] == [
            str(where)
        ] * 2
        assert [o["world"] for o in out] == [2, 2]
        for key in ("torch", "numpy", "random"):  # forked ranks would share the server's streams
            assert out[0][key] != out[1][key], key
        captured = capfd.readouterr()
        for rank in (0, 1):
            assert f"stdout of rank {rank} for call {n}" in captured.out, captured
            assert f"stderr of rank {rank} for call {n}" in captured.err, captured
    died = run_ranks(_die, 2)
    assert died[0].error_type == "ValueError" and "rank 0 raised" in (died[0].error or "")
    assert died[1].exitcode == -signal.SIGKILL
