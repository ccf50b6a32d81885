"""Test helpers for integrators: N real gloo ranks on the CPU, and the named fault points.

``run_ranks(fn, world, *args)`` spawns ``world`` processes, initializes a gloo process
group in each (TCP store on a free local port), calls ``fn(rank, world, *args)`` and
returns one ``RankResult`` per rank: its exit code, its return value or the type and
message of the exception it raised. A rank that SIGKILLs itself reports exit code -9.
Nothing is mocked: the collectives are torch.distributed's own. (The result files are
pickles this helper's own children wrote into a private temp directory.)

The ranks are forked from one fork server per parent process that has imported torch and
ckptguard once (a spawned rank paid that import, 2-3 s of CPU, every time). Each rank still
starts as a spawned one would: the caller's environment, working directory, sys.path,
stdout and stderr at the call, and fresh random seeds (torch, NumPy, ``random``).

Fault points: ``kill_at(point)`` makes this process SIGKILL itself when the commit protocol
reaches ``point`` (one of ``FAULT_POINTS``); ``set_fault_hook(point, fn)`` runs any callable
there, ``None`` removes it. Nothing happens at a point without a hook.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._faults import COMMIT_POINTS
from ._faults import POINTS as FAULT_POINTS
from ._faults import set_hook as set_fault_hook

__all__ = [
    "COMMIT_POINTS",
    "FAULT_POINTS",
    "RankResult",
    "free_port",
    "kill_at",
    "run_ranks",
    "set_fault_hook",
    "values",
]


@dataclass
class RankResult:
    rank: int
    exitcode: int | None
    value: Any = None
    error_type: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.exitcode == 0 and self.error_type is None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# What the fork server imports once; every rank forked from it starts with these loaded.
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp",
            "torch.distributed.tensor", "numpy", "ckptguard", "ckptguard.ops.prove", "pytest"]


class _StdStreams:
    """The caller's stdout and stderr as they are at the call, handed to the rank: the fork server's
    own are those of the call that started it (under pytest, another test's capture)."""

    def __init__(self) -> None:
        self.fds: list[int] = []

    def __getstate__(self) -> dict[str, Any]:
        from multiprocessing import reduction

        sys.stdout.flush()
        sys.stderr.flush()
        return {"dup": [reduction.DupFd(1), reduction.DupFd(2)]}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.fds = [d.detach() for d in state["dup"]]

    def install(self) -> None:
        for target, fd in zip((1, 2), self.fds, strict=True):
            os.dup2(fd, target)
            os.close(fd)


def _fresh_process(env: dict[str, str], streams: _StdStreams) -> None:
    """Make a rank forked from the fork server look spawned: the caller's environment now (the
    server has the one of its start) and output, and random streams of its own (forked ranks
    would share the server's torch and NumPy states; ``random`` reseeds itself after a fork)."""
    os.environ.clear()
    os.environ.update(env)
    streams.install()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()


def _child(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    port: int,
    out: str,
    pg_timeout_s: float,
    args: tuple[Any, ...],
    env: dict[str, str],
    streams: _StdStreams,
) -> None:
    _fresh_process(env, streams)
    os.environ["OMP_NUM_THREADS"] = "1"
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    result: dict[str, Any] = {}
    try:
        if world > 0:
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world,
                timeout=datetime.timedelta(seconds=pg_timeout_s),
            )
        result["value"] = fn(rank, max(world, 1), *args)
    except BaseException as exc:
        result["error_type"] = type(exc).__name__
        result["error"] = f"{exc}\n{traceback.format_exc()}"
    with open(out, "wb") as f:
        pickle.dump(result, f)
    # Skip destroy_process_group: a peer may be dead, and teardown must not hang.
    os._exit(0)


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 240.0,
    pg_timeout_s: float = 60.0,
    distributed: bool = True,
) -> list[RankResult]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned ranks; ``distributed=False``
    runs one plain process with no process group (world must be 1)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    port = free_port()
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="ckptguard-ranks-") as tmp:
        procs = []
        for rank in range(world):
            out = str(Path(tmp) / f"rank{rank}.pkl")
            p = ctx.Process(
                target=_child,
                args=(fn, rank, world if distributed else 0, port, out, pg_timeout_s, args, env, _StdStreams()),
                daemon=False,
            )
            p.start()
            procs.append((p, out))
        deadline = time.monotonic() + timeout
        results = []
        for rank, (p, out) in enumerate(procs):
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
                results.append(
                    RankResult(
                        rank, None, error_type="HelperTimeout", error=f"rank {rank} still running after {timeout} s"
                    )
                )
                continue
            res = RankResult(rank, p.exitcode)
            if os.path.exists(out):
                with open(out, "rb") as f:
                    data = pickle.load(f)
                res.value = data.get("value")
                res.error_type = data.get("error_type")
                res.error = data.get("error")
            results.append(res)
        return results


def values(results: list[RankResult]) -> list[Any]:
    """Every rank's return value, failing with each rank's error if any rank failed."""
    bad = [r for r in results if not r.ok]
    if bad:
        raise AssertionError("\n".join(f"rank {r.rank} exit {r.exitcode}: {r.error_type}: {r.error}" for r in bad))
    return [r.value for r in results]


def kill_at(point: str) -> None:
    """SIGKILL this process when the protocol reaches ``point`` (a crash, with no cleanup)."""
    import signal

    set_fault_hook(point, lambda: os.kill(os.getpid(), signal.SIGKILL))
