"""Temp files of atomic writes, named for their owner, and swept once that owner is dead.

Contract. Every file ckptguard writes atomically (the tracker, ``lease.json``, ``trust.json``, a
hold, a marker) goes to ``NAME.tmp-<pid>.<start>.<host>-<nonce>`` first, then is renamed over
``NAME``: the name records the writing process (its PID, the start time that tells it from a
recycled PID, 8 hex of its host name's hash). A writer killed before its rename leaves that name
behind; ``sweep`` removes such files once their owner is dead (same host: the PID no longer runs
that process; another host: older than ``max_age_s``), and never a live owner's. Names of the old
form ``NAME.tmp-<nonce>`` (no owner) count as dead only past ``max_age_s``.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import socket
import time
from pathlib import Path

import xxhash

_TEMP = re.compile(
    r"\.tmp-(?:(?P<pid>\d+)\.(?P<start>\d+|x)\.(?P<host>[0-9a-f]{8})-)?[0-9a-f]{8}\Z"
)


def proc_start(pid: int) -> str | None:
    # The start time tells a live owner from a recycled PID.
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


INIT_PID_NS = 0xEFFFFFFC
"""The inode of the kernel's initial PID namespace (``PROC_PID_INIT_INO``): a process outside any
container."""


def _pid_ns() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # no /proc (macOS): one namespace
        return None


def this_host() -> str:
    """This process's host as a writer's record names it: where its PID means this process. The
    host name, and beside it the PID namespace when that is not the host's own: two containers of
    one host name (with the host's network, say) number their processes apart, so a PID read in
    one says nothing of the other, whose records are then judged by age, as another host's."""
    host = socket.gethostname()
    ns = _pid_ns()
    return host if ns is None or ns == INIT_PID_NS else f"{host}#pidns{ns}"


def writer_gone(host: str, pid: int, start: str | None, *, expired: bool) -> str | None:
    """Why the process that wrote something can no longer write it, or None while it may: the one
    rule of every root for a writer of its own (a lease's holder, ``_disk.lease.holder_gone``; a
    save's temp directory and an atomic write's temp file, ``owner_state`` here and in ``layout``;
    an object store's attempt, ``ops.storegc``). On this host the process decides, however old its
    work: gone once its PID is absent or runs another program (its start time differs: a restarted
    container gets its PID back); a record without the start time, and a writer on another host or
    in another PID namespace of this one (``this_host``), are judged by age (``expired``)."""
    if host != this_host():
        return "it expired" if expired else None
    if not _pid_exists(pid):
        return "its process is dead"
    if (
        start is None
    ):  # the PID alone cannot tell a live writer from a recycled PID: its age decides
        return "it expired" if expired else None
    if proc_start(pid) != start:
        return "its process is dead (its PID now runs another program)"
    return None


def _pid_exists(pid: int) -> bool:
    if pid <= 0:
        return False
    if Path("/proc/self").exists():
        return Path(f"/proc/{pid}").exists()
    try:  # no /proc (macOS): ask the kernel
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _host_tag(host: str) -> str:
    return xxhash.xxh3_64_hexdigest(host.encode())[:8]


def owner_tag() -> str:
    """This process as the names of its files record it: ``<pid>.<start time>.<host tag>``."""
    pid = os.getpid()
    return f"{pid}.{proc_start(pid) or 'x'}.{_host_tag(this_host())}"


def temp_name(path: Path) -> Path:
    """Where an atomic write of ``path`` goes first: next to it, named for this process."""
    return path.with_name(f"{path.name}.tmp-{owner_tag()}-{secrets.token_hex(4)}")


def is_temp_file(path: Path, *, of: str | None = None) -> bool:
    """A temp file an atomic write left (of ``of``, or of any name when the name records its
    owner)."""
    if path.is_symlink():
        return False
    name = path.name
    if of is not None:
        return name.startswith(of) and bool(_TEMP.match(name[len(of) :]))
    match = _TEMP.search(name)
    return match is not None and match.start() > 0 and match.group("pid") is not None


def owner_state(path: Path, *, max_age_s: float) -> str:
    """ "dead", "alive" or "unknown" (an older name that records no owner): whether the process that
    wrote this temp file may still rename it. Another host's owner counts as dead past
    ``max_age_s``."""
    match = _TEMP.search(path.name)
    if match is None or match.group("pid") is None:
        return "unknown"
    here = this_host()
    host = here if match.group("host") == _host_tag(here) else f"host tag {match.group('host')}"
    start = None if match.group("start") == "x" else match.group("start")
    gone = writer_gone(host, int(match.group("pid")), start, expired=_age(path) > max_age_s)
    return "alive" if gone is None else "dead"


def _age(path: Path) -> float:
    try:
        return time.time() - path.lstat().st_mtime
    except OSError:
        return float("inf")


def describe_owner(path: Path) -> str:
    match = _TEMP.search(path.name)
    if match is None or match.group("pid") is None:
        return "no owner recorded in its name"
    return f"pid {match.group('pid')}, host tag {match.group('host')}"


def sweep(directory: Path, *, max_age_s: float, names: tuple[str, ...] = ()) -> list[Path]:
    """Remove the temp files of atomic writes in ``directory`` whose owner is dead: names that
    record an owner, and the older form only for ``names`` (ckptguard's own files: a foreign
    ``x.tmp-...`` file is never ours to remove); returns what was removed."""
    removed: list[Path] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        path = Path(entry.path)
        ours = entry.is_file(follow_symlinks=False) and (
            is_temp_file(path) or any(is_temp_file(path, of=n) for n in names)
        )
        state = owner_state(path, max_age_s=max_age_s) if ours else "alive"
        if state == "dead" or (state == "unknown" and _age(path) > max_age_s):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path)
    return removed
