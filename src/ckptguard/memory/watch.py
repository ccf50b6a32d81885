"""``mem watch``: run a command and sample the node and every process of its tree.

Contract: ``watch(cmd, config)`` starts ``cmd``, writes a ``watch_start`` record, then one
``sample`` record every ``interval_s`` (host figures, Ray's figure, and per process pid, ppid, comm,
argv0 basename, PSS split, threads and FDs) until the command exits, then a ``watch_end`` record
with its exit status (negative: killed by that signal; -9 is what the OOM killer and Ray leave). It
returns the command's exit status. Only /proc is read: the watched processes are never attached to
or signalled (docs/practices.md, memory budget: on a running job, only read /proc), except that an
interrupt of the watcher is passed on to the command.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .host import HostProbe, HostProbeConfig, hostname
from .process import list_tree, read_process
from .ray import RayConfig, ray_figure
from .records import FORMAT_VERSION, RecordKind

__all__ = ["WatchConfig", "watch"]


@dataclass(frozen=True, kw_only=True)
class WatchConfig:
    """How ``watch`` samples and where it writes."""

    out: Path
    """The JSONL file to append records to."""
    interval_s: float = 1.0
    """Seconds between samples. docs/practices.md samples PSS once a minute on long runs;
    smaps_rollup walks page tables, so below ~0.05 s the watcher itself becomes the load."""
    proc_root: Path = Path("/proc")
    """procfs mount point."""
    ray: RayConfig = field(default_factory=RayConfig.from_env)
    """Ray monitor settings used for the Ray figure in each sample."""

    def __post_init__(self) -> None:
        if not (0.01 <= self.interval_s <= 3600):
            raise ConfigError(
                f"WatchConfig.interval_s must be in [0.01, 3600] seconds, got {self.interval_s}"
            )


def _record(kind: RecordKind, **fields: Any) -> dict[str, Any]:
    return {
        "v": FORMAT_VERSION,
        "kind": kind.value,
        "mono_ns": time.monotonic_ns(),
        "wall_time": time.time(),
        "node": hostname(),
        "pid": os.getpid(),
        **fields,
    }


def sample(root_pid: int, probe: HostProbe, config: WatchConfig) -> dict[str, Any]:
    """One ``sample`` record of the node and the tree under ``root_pid``."""
    host = probe.read()
    procs = []
    for pid in list_tree(root_pid, proc_root=config.proc_root):
        snap = read_process(pid, proc_root=config.proc_root)
        if snap is not None:  # exited between listing and reading
            procs.append(snap.to_json())
    return _record(
        RecordKind.SAMPLE,
        root_pid=root_pid,
        host=host.to_json(),
        ray=ray_figure(host, config.ray).to_json(),
        procs=procs,
    )


def watch(cmd: Sequence[str], config: WatchConfig, *, probe: HostProbe | None = None) -> int:
    """Run ``cmd`` to completion while sampling; return its exit status."""
    if not cmd:
        raise ConfigError("mem watch needs a command after '--'")
    probe = probe or HostProbe(HostProbeConfig(proc_root=config.proc_root))
    with open(config.out, "a", encoding="utf-8") as out:

        def emit(rec: dict[str, Any]) -> None:
            out.write(json.dumps(rec, separators=(",", ":")) + "\n")
            out.flush()

        try:
            child = subprocess.Popen(list(cmd))
        except OSError as exc:
            raise ConfigError(
                f"mem watch could not start {cmd[0]!r}: {exc.strerror or exc}"
            ) from None
        emit(
            _record(
                RecordKind.WATCH_START,
                root_pid=child.pid,
                argv0=os.path.basename(cmd[0]),
                interval_s=config.interval_s,
            )
        )
        next_t = time.monotonic()
        try:
            while True:
                emit(sample(child.pid, probe, config))
                next_t += config.interval_s
                try:
                    rc = child.wait(timeout=max(0.0, next_t - time.monotonic()))
                    break
                except subprocess.TimeoutExpired:
                    continue
        except KeyboardInterrupt:
            child.terminate()
            rc = child.wait()
        emit(
            _record(
                RecordKind.WATCH_END,
                root_pid=child.pid,
                exit_code=rc,
                signal=-rc if rc < 0 else None,
            )
        )
    return rc
