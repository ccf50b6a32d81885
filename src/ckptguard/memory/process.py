"""Per-process memory: PSS from smaps_rollup, threads, file descriptors, and the process tree.

Contract: ``read_process(pid)`` returns a ``ProcessSnapshot`` or None when the process is gone. PSS
is used, never a sum of RSS: RSS counts every shared page (plasma, /dev/shm, pinned buffers mapped
by several workers) once per mapper. Only ``comm`` and ``argv0`` are kept of the command line
(docs/practices.md: record comm/argv0 only; arguments may hold secrets). Reading smaps_rollup walks
the page tables, so it is sampled at a few Hz at most, never in a tight loop. Fields missing on an
old kernel (Pss_Anon/File/Shmem need 5.3) are None with a reason.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ._files import read_keyed, read_text

__all__ = ["ProcessSnapshot", "list_tree", "read_process"]

_SMAPS_FIELDS = {
    "pss": "Pss",
    "pss_anon": "Pss_Anon",
    "pss_file": "Pss_File",
    "pss_shmem": "Pss_Shmem",
    "rss": "Rss",
    "swap_pss": "SwapPss",
}


@dataclass(frozen=True, kw_only=True)
class ProcessSnapshot:
    """One process at one instant; byte figures per process, None when not obtained."""

    pid: int
    ppid: int | None
    comm: str
    argv0: str
    pss: int | None = None
    pss_anon: int | None = None
    pss_file: int | None = None
    pss_shmem: int | None = None
    rss: int | None = None
    rss_anon: int | None = None
    rss_file: int | None = None
    rss_shmem: int | None = None
    vm_hwm: int | None = None
    swap_pss: int | None = None
    uss: int | None = None
    threads: int | None = None
    fds: int | None = None
    not_obtained: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ProcessSnapshot:
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in names})


def read_process(
    pid: int | str = "self",
    *,
    proc_root: Path = Path("/proc"),
    with_fds: bool = True,
    with_pss: bool = True,
) -> ProcessSnapshot | None:
    """Snapshot one process; None if it does not exist (exited between listing and reading).

    RSS split and VmHWM come from /proc/<pid>/status (cheap). PSS needs smaps_rollup, a page
    table walk (about 3 ms for a 300 MB torch process); ``with_pss=False`` skips it and says so.
    """
    base = proc_root / str(pid)
    stat, why = read_text(base / "stat")
    if stat is None:
        return None
    real_pid, comm, ppid, threads = _parse_stat(stat)
    missing: dict[str, str] = {}
    values: dict[str, int | None] = {}
    status, _ = read_keyed(base / "status", unit_kib=True)
    for name, key in (
        ("rss_anon", "RssAnon"),
        ("rss_file", "RssFile"),
        ("rss_shmem", "RssShmem"),
        ("vm_hwm", "VmHWM"),
    ):
        values[name] = (status or {}).get(key)
        if values[name] is None:
            missing[name] = f"{base / 'status'} has no {key} line"
    if with_pss:
        rollup, why = read_keyed(base / "smaps_rollup", unit_kib=True)
    else:
        rollup, why = (
            None,
            "not read at this boundary (smaps_rollup is read at most every pss_every_s)",
        )
    if rollup is None:
        for name in (*_SMAPS_FIELDS, "uss"):
            missing[name] = why or "unreadable"
        if status and "VmRSS" in status:
            values["rss"] = status["VmRSS"]
            missing.pop("rss", None)
    else:
        for name, key in _SMAPS_FIELDS.items():
            values[name] = rollup.get(key)
            if values[name] is None:
                missing[name] = f"smaps_rollup has no {key} line" + (
                    " (needs Linux 5.3)" if key.startswith("Pss_") else ""
                )
        if "Private_Clean" in rollup and "Private_Dirty" in rollup:
            values["uss"] = rollup["Private_Clean"] + rollup["Private_Dirty"]
        else:
            missing["uss"] = "smaps_rollup has no Private_Clean/Private_Dirty"
    fds = None
    if with_fds:
        try:
            fds = len(os.listdir(base / "fd"))
        except OSError as exc:
            missing["fds"] = f"{base / 'fd'} not listable ({exc.strerror or exc})"
    else:
        missing["fds"] = "not requested"
    cmdline, _ = read_text(base / "cmdline")
    argv0 = cmdline.split("\0", 1)[0] if cmdline else ""
    return ProcessSnapshot(
        pid=real_pid if real_pid is not None else int(pid) if str(pid).isdigit() else -1,
        ppid=ppid,
        comm=comm,
        argv0=os.path.basename(argv0),
        threads=threads,
        fds=fds,
        not_obtained=missing,
        **values,
    )


def _parse_stat(text: str) -> tuple[int | None, str, int | None, int | None]:
    # comm may hold spaces and parentheses: it ends at the LAST ")".
    left, _, right = text.rpartition(")")
    pid_s, _, comm = left.partition(" (")
    rest = right.split()
    try:
        return int(pid_s), comm, int(rest[1]), int(rest[17])
    except (ValueError, IndexError):
        return None, comm, None, None


def list_tree(root_pid: int, *, proc_root: Path = Path("/proc")) -> list[int]:
    """``root_pid`` and all its descendants alive now, parents before children."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir(proc_root)
    except OSError:
        return []
    for name in entries:
        if not name.isdigit():
            continue
        text, _ = read_text(proc_root / name / "stat")
        if text is None:
            continue
        pid, _, ppid, _ = _parse_stat(text)
        if pid is not None and ppid is not None:
            children.setdefault(ppid, []).append(pid)
    if not (proc_root / str(root_pid)).exists():
        return []
    out, todo = [], [root_pid]
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo.extend(sorted(children.get(pid, [])))
    return out
