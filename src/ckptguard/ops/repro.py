"""A fast save-failure repro: the real save, repeated, stopping at the first failure.

Contract (docs/practices.md, 3.1 and 3.2): ``run_repro`` spawns ``ranks`` processes that form a
gloo group and repeat ckptguard's own save (same serializer, same concurrency, real-sized
tensors) for at most ``rounds`` rounds. It stops at the first failure and keeps the scene
(the failed temp directory, renamed ``.failed-...``) and returns a report: the first
exception (errno, rank, path, offset, requested and returned bytes), the filesystem type,
free space and inodes, the cgroup's oom_kill count before and after, and the threads,
processes and open files of rank 0 per round (growth across rounds is its own signal).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import multiprocessing.connection
import os
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import StateOptions, StorageOptions
from ..errors import ConfigError

REPRO_ROOT = "repro-root"


@dataclass(frozen=True, kw_only=True)
class ReproConfig:
    """One repro run."""

    rounds: int = 10
    """Most saves to attempt; size it to the failure probability (the failures it was built for came
    by round 2-6)."""
    size_gib: float = 1.0
    """Tensor state per save, in GiB, split evenly across ranks."""
    ranks: int = 1
    """Processes saving together (gloo on the CPU)."""
    timeout_s: float = 300.0
    """Timeout of every agreement inside the save."""

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ConfigError(f"ReproConfig.rounds must be >= 1, got {self.rounds}")
        if not 0 < self.size_gib <= 4096:
            raise ConfigError(f"ReproConfig.size_gib must be in (0, 4096], got {self.size_gib}")
        if not 1 <= self.ranks <= 64:
            raise ConfigError(f"ReproConfig.ranks must be in [1, 64], got {self.ranks}")


def filesystem(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Type of the filesystem holding ``path``, its free bytes and free inodes."""
    probe = Path(os.fspath(path))
    while not probe.exists():
        probe = probe.parent
    real = str(probe.resolve())
    fstype, mount = "not obtained", "/"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            inside = len(parts) >= 3 and (
                real == parts[1] or real.startswith(parts[1].rstrip("/") + "/")
            )
            if inside and (len(parts[1]) >= len(mount) or mount == "/"):
                mount, fstype = parts[1], parts[2]
    except OSError:
        pass
    st = os.statvfs(probe)
    return {
        "type": fstype,
        "mount": mount,
        "free_bytes": st.f_bavail * st.f_frsize,
        "free_inodes": st.f_favail,
        "quota": "not obtained (no quota query on this path)",
    }


def _oom_kills() -> int | None:
    from ..memory import HostProbe

    return HostProbe().read().oom_kill


def _process_figures() -> dict[str, Any]:
    from ..memory.process import read_process

    snap = read_process("self", with_pss=False)
    children = 0
    with contextlib.suppress(OSError):
        children = len(Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split())
    return {
        "threads": snap.threads if snap else None,
        "fds": snap.fds if snap else None,
        "children": children,
    }


def _rank(rank: int, world: int, port: int, target: str, cfg: ReproConfig, out: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from .. import CheckpointConfig, CheckpointManager, KeepLast
    from ..errors import CheckpointError, CheckpointWriteError

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=cfg.timeout_s),
        )
    per_rank = int(cfg.size_gib * (1 << 30) / world / 4 / 4)
    state = {"shards": {f"rank{rank}_{i}": torch.randn(per_rank) for i in range(4)}}
    config = CheckpointConfig(
        timeout_s=cfg.timeout_s,
        storage=StorageOptions(keep_failed=True),
        retention=KeepLast(1),
        state=StateOptions(capture_rng=False),
    )
    mgr = CheckpointManager(Path(target) / REPRO_ROOT, config=config)
    rounds: list[dict[str, Any]] = []
    failure: dict[str, Any] | None = None
    for n in range(1, cfg.rounds + 1):
        start = time.perf_counter()
        try:
            mgr.save(n, state)
        except CheckpointError as exc:
            failure = {"round": n, "type": type(exc).__name__, "message": str(exc)}
            if isinstance(exc, CheckpointWriteError) and exc.first is not None:
                failure["first"] = exc.first.to_json()
            break
        rounds.append({"round": n, "seconds": time.perf_counter() - start, **_process_figures()})
        if rank == 0:  # the parent's progress: one line per committed round
            with open(out + ".rounds", "a") as f:
                f.write(f"{n}\n")
    Path(out).write_text(json.dumps({"rank": rank, "rounds": rounds, "failure": failure}))
    os._exit(0)


def run_repro(
    target: str | os.PathLike[str], cfg: ReproConfig, progress: Callable[[int], None] | None = None
) -> dict[str, Any]:
    """Repeat the save under ``target``; returns the report (also when a round failed).
    ``progress(rounds committed)`` is called as rank 0 commits them."""
    target = Path(os.fspath(target)).absolute()
    if (
        not target.parent.is_dir()
    ):  # a typo must not become a tree of new directories on the suspect filesystem
        raise ConfigError(
            f"repro-save target {target}: its parent {target.parent} is not a "
            f"directory; name a directory on the filesystem under suspicion (it is "
            f"made if only its last part is missing)"
        )
    target.mkdir(exist_ok=True)
    before = {"fs": filesystem(target), "oom_kill": _oom_kills()}
    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="ckptguard-repro-") as tmp:
        outs = [str(Path(tmp) / f"rank{r}.json") for r in range(cfg.ranks)]
        procs = [
            ctx.Process(target=_rank, args=(r, cfg.ranks, port, str(target), cfg, outs[r]))
            for r in range(cfg.ranks)
        ]
        for p in procs:
            p.start()
        seen = 0
        while alive := [p.sentinel for p in procs if p.is_alive()]:
            mp.connection.wait(
                alive, timeout=0.25
            )  # a rank's exit, or the next look at the progress file
            seen = _report_rounds(outs[0] + ".rounds", seen, progress)
        for p in procs:
            p.join()
        _report_rounds(outs[0] + ".rounds", seen, progress)
        results = [json.loads(Path(o).read_text()) if Path(o).exists() else None for o in outs]
    return _report(target, cfg, before, results, [p.exitcode for p in procs])


def _report_rounds(path: str, seen: int, progress: Callable[[int], None] | None) -> int:
    """Rounds rank 0 has committed (its progress file), passed on when the count grew."""
    try:
        n = len(Path(path).read_text().split())
    except OSError:
        return seen
    if n > seen and progress is not None:
        progress(n)
    return max(n, seen)


def _report(
    target: Path, cfg: ReproConfig, before: dict[str, Any], results: list[Any], exitcodes: list[Any]
) -> dict[str, Any]:
    rank0 = results[0] or {"rounds": [], "failure": None}
    failures = [r["failure"] for r in results if r and r.get("failure")]
    dead = [r for r, code in enumerate(exitcodes) if code != 0]
    first = next((f for f in failures if "first" in f), failures[0] if failures else None)
    rounds = rank0["rounds"]
    growth = (
        {k: [rounds[0][k], rounds[-1][k]] for k in ("threads", "fds", "children")} if rounds else {}
    )
    kept = sorted(str(p) for p in (target / REPRO_ROOT).glob(".failed-*"))
    after_fs = filesystem(target)
    return {
        "target": str(target),
        "config": {"rounds": cfg.rounds, "size_gib": cfg.size_gib, "ranks": cfg.ranks},
        "filesystem": before["fs"],
        "free_bytes_after": after_fs["free_bytes"],
        "free_inodes_after": after_fs["free_inodes"],
        "oom_kill_before": before["oom_kill"],
        "oom_kill_after": _oom_kills(),
        "completed_rounds": len(rounds),
        "seconds_per_round": [round(r["seconds"], 3) for r in rounds],
        "gib_per_s_median": (cfg.size_gib / sorted(r["seconds"] for r in rounds)[len(rounds) // 2])
        if rounds
        else None,
        "growth_first_to_last_round": growth,
        "failed": bool(failures or dead),
        "first_failure": first,
        "dead_ranks": dead,
        "kept_scene": kept,
    }
