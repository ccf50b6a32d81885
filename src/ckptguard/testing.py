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

Fake nodes: ``fake_node(name, disks={shared: own})`` makes the calling rank a rank of node
``name`` (the node identity ckptguard groups ranks by, and with ``hostname=True`` its host
name) that sees its own directory at a path every rank uses: node-local disks at one path,
on one machine. It needs root (private mount and UTS namespaces).
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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._agree import NODE_ENV
from ._faults import COMMIT_POINTS
from ._faults import POINTS as FAULT_POINTS
from ._faults import set_hook as set_fault_hook

__all__ = [
    "COMMIT_POINTS",
    "FAULT_POINTS",
    "RankResult",
    "fake_node",
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
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "numpy",
    "ckptguard",
    "ckptguard.ops.prove",
    "pytest",
]


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
            # The rendezvous waits as long as a loaded machine takes to start every rank, whatever
            # the group's own timeout (a test's 3 s group timeout failed its rendezvous when a rank
            # started late).
            store = dist.TCPStore(
                "127.0.0.1",
                port,
                world,
                is_master=rank == 0,
                timeout=datetime.timedelta(seconds=max(60.0, pg_timeout_s)),
            )
            dist.init_process_group(
                "gloo",
                store=store,
                rank=rank,
                world_size=world,
                timeout=datetime.timedelta(seconds=pg_timeout_s),
            )
            # Every rank past gloo's connect before any runs ``fn``: a rank that failed at once and
            # exited would otherwise reset the connect of a peer still in it (a DistNetworkError,
            # not the test's error).
            dist.barrier()
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
                args=(
                    fn,
                    rank,
                    world if distributed else 0,
                    port,
                    out,
                    pg_timeout_s,
                    args,
                    env,
                    _StdStreams(),
                ),
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
                        rank,
                        None,
                        error_type="HelperTimeout",
                        error=f"rank {rank} still running after {timeout} s",
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
        raise AssertionError(
            "\n".join(f"rank {r.rank} exit {r.exitcode}: {r.error_type}: {r.error}" for r in bad)
        )
    return [r.value for r in results]


def kill_at(point: str) -> None:
    """SIGKILL this process when the protocol reaches ``point`` (a crash, with no cleanup)."""
    import signal

    set_fault_hook(point, lambda: os.kill(os.getpid(), signal.SIGKILL))


_CLONE_NEWNS, _CLONE_NEWUTS = 0x00020000, 0x04000000
_MS_BIND, _MS_REC, _MS_PRIVATE = 0x1000, 0x4000, 1 << 18


def fake_node(
    name: str | None = None,
    *,
    disks: Mapping[str | os.PathLike[str], str | os.PathLike[str]] | None = None,
    hostname: bool = False,
) -> None:
    """Make this process a rank of a fake node, for tests that fake several nodes on one machine.

    ``name``: the node this rank reports (``CKPTGUARD_NODE``, the identity ckptguard groups
    ranks by); ``None`` keeps the real one (ranks of one node that see different disks).
    ``hostname``: also set the host name to ``name`` (a private UTS namespace: what the lease
    and ``socket.gethostname()`` see). ``disks``: ``{shared: own}``, the directory ``own``
    bound over the path ``shared`` in a private mount namespace, so this process and its
    children see ``own`` at ``shared`` while every other rank keeps its own view: a node's
    local disk at the path every node uses. Both directories must exist.

    Call it first thing in a rank (``run_ranks``): the change lasts for the process. Needs root
    (CAP_SYS_ADMIN); raises ``PermissionError`` naming the step that failed otherwise.
    """
    import ctypes

    if hostname and name is None:
        raise ValueError("fake_node(hostname=True) needs the node's name")
    binds = {os.fspath(shared): os.fspath(own) for shared, own in (disks or {}).items()}
    libc = ctypes.CDLL(None, use_errno=True)

    def check(ok: bool, what: str) -> None:
        if not ok:
            errno = ctypes.get_errno()
            raise PermissionError(
                errno, f"fake_node({name!r}): {what} failed: {os.strerror(errno)} (needs root)"
            )

    flags = (_CLONE_NEWUTS if hostname else 0) | (_CLONE_NEWNS if binds else 0)
    if flags:
        check(libc.unshare(flags) == 0, "unshare (private namespaces)")
    if hostname and name is not None:
        raw = name.encode()
        check(libc.sethostname(raw, len(raw)) == 0, f"sethostname {name}")
    if binds:
        # Private first: a bind in a shared mount tree would show in every other rank's view too.
        check(
            libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None) == 0,
            "mount --make-rprivate /",
        )
    for shared, own in binds.items():
        check(
            libc.mount(own.encode(), shared.encode(), None, _MS_BIND, None) == 0,
            f"mount --bind {own} {shared}",
        )
    if name is not None:
        os.environ[NODE_ENV] = name
