"""The whole process tree of a command, and killing all of it.

torchrun (2.13) starts every worker in its own session, so a signal to the launcher's
process group leaves the workers running. The tree is read from ``/proc`` (each process's
parent), followed while the command runs (so a worker whose parent died is still known),
frozen with SIGSTOP from the top down until no new process appears (a stopped process
cannot fork, and its children keep it as their parent), and then SIGKILLed. The caller is
made a child subreaper, so orphans of the tree are reparented to it and reaped here.
Processes are told apart by (pid, start time), so a reused pid is never signalled.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from pathlib import Path

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Orphans of our descendants come to us instead of init (Linux); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (field 3, the state, first)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()


def _parents() -> dict[int, int]:
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat(int(entry))) is not None:
            out[int(entry)] = int(fields[1])
    return out


def start_time(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[19]) if fields is not None else None


def alive(pid: int, started: int | None = None) -> bool:
    """Running or stopped (a zombie has exited); with ``started``, only that incarnation of pid."""
    fields = _stat(pid)
    if fields is None or fields[0] in ("Z", "X", "x"):
        return False
    return started is None or int(fields[19]) == started


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it, parents before children."""
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    out, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(sorted(children.get(p, [])))
    return out


class Tree:
    """The processes of one launched command, including those it started in other sessions."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.known: dict[int, int] = {}  # pid -> start time

    def scan(self) -> None:
        for pid in descendants(self.proc.pid):
            started = start_time(pid)
            if started is not None:
                self.known.setdefault(pid, started)

    def members(self) -> list[int]:
        self.scan()
        return [p for p, started in self.known.items() if alive(p, started)]

    def freeze(self) -> list[int]:
        """SIGSTOP every member until no new one appears; returns the stopped pids."""
        stopped: list[int] = []
        for _ in range(50):
            new = [p for p in self.members() if p not in stopped]
            if not new:
                break
            for pid in new:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
            stopped += new
            time.sleep(0.02)
        return stopped

    def thaw(self, pids: list[int]) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def kill(
        self, *, frozen: list[int] | None = None, timeout_s: float = 20.0
    ) -> tuple[list[int], list[int]]:
        """SIGKILL the whole tree; returns (killed pids, survivors). Survivors are an error for the
        caller."""
        pids = sorted(set(frozen or []) | set(self.freeze()))
        for pid in pids:
            if alive(pid, self.known.get(pid)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout_s)
        deadline = time.monotonic() + timeout_s
        reaped_by = time.monotonic() + 5.0
        while True:
            for pid in pids:  # our children and the orphans we adopted as subreaper
                with contextlib.suppress(ChildProcessError, OSError):
                    os.waitpid(pid, os.WNOHANG)
            survivors = [p for p in pids if alive(p, self.known.get(p))]
            # A zombie still holds its pid, and a pid check (e.g. of the root's write lease) would
            # take it for a live run: wait until they are reaped (orphans come to us as subreaper;
            # others to init).
            zombies = [p for p in pids if not alive(p) and start_time(p) == self.known.get(p)]
            now = time.monotonic()
            if (not survivors and (not zombies or now > reaped_by)) or now > deadline:
                return pids, survivors
            time.sleep(0.05)
