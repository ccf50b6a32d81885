"""One writer per root: a lease with the owner's host and PID.

Contract: the first save of a process takes ``ROOT/lease.json`` and every later save
renews it. A lease held by a live process on this host, or by another host and renewed
within ``ttl_s``, is refused with the owner named. A lease whose owner is dead (same
host: the PID is gone or now runs another program) is taken over, so kill-and-relaunch
just works. ``override`` breaks any lease and reports whose it broke.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import CheckpointCorruptError, LeaseHeldError, UnsafeCheckpointError
from .layout import _proc_start, atomic_write_bytes, read_json

log = logging.getLogger("ckptguard")

LEASE_NAME = "lease.json"


@dataclass(frozen=True)
class Owner:
    host: str
    pid: int
    start: str | None
    acquired_unix: float
    renewed_unix: float

    @classmethod
    def me(cls) -> Owner:
        now = time.time()
        return cls(socket.gethostname(), os.getpid(), _proc_start(os.getpid()), now, now)

    def same_process(self, other: Owner) -> bool:
        return (self.host, self.pid, self.start) == (other.host, other.pid, other.start)

    def describe(self) -> str:
        age = time.time() - self.renewed_unix
        return f"pid {self.pid} on host {self.host} (renewed {age:.0f} s ago)"


def _alive_here(owner: Owner) -> bool:
    return Path(f"/proc/{owner.pid}").exists() and _proc_start(owner.pid) == owner.start


def _read(path: Path) -> Owner | None:
    try:
        return Owner(**read_json(path, what="write lease"))
    except FileNotFoundError:
        return None
    except UnsafeCheckpointError:
        raise  # a link, FIFO or device: refused, never read and never taken for abandoned
    except (ValueError, TypeError) as exc:
        log.warning("ckptguard: unreadable lease %s (%s) is treated as abandoned", path, exc)
        return None


def _write(path: Path, owner: Owner) -> None:
    atomic_write_bytes(path, json.dumps(asdict(owner)).encode())


def acquire(root: Path, *, ttl_s: float, override: bool = False) -> str | None:
    """Take or renew the lease; returns a note when another owner's lease was taken over."""
    path = root / LEASE_NAME
    me = Owner.me()
    held = _read(path)
    if held is None:
        try:  # O_EXCL: of two runs taking a free lease at once, exactly one wins
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            if _read(path) is None and os.path.lexists(path):
                # There but unreadable (torn, damaged): retrying would recurse forever.
                if override and not path.is_symlink():
                    _write(path, me)
                    _release_at_exit(path, me)
                    return f"replaced the unreadable lease {path} (override)"
                raise CheckpointCorruptError(
                    f"{path} exists but is not a readable lease; if no run is writing {root}, remove it and "
                    "relaunch (or pass CheckpointConfig(break_lease=True))"
                ) from None
            return acquire(root, ttl_s=ttl_s, override=override)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(asdict(me)))
            f.flush()
            os.fsync(f.fileno())
        _release_at_exit(path, me)
        return None
    if held.same_process(me):
        _write(path, Owner(me.host, me.pid, me.start, held.acquired_unix, me.renewed_unix))
        return None
    _release_at_exit(path, me)
    if override:
        _write(path, me)
        return f"broke the lease of {held.describe()} (override)"
    if held.host == me.host and not _alive_here(held):
        _write(path, me)
        return f"took over the lease of dead {held.describe()}"
    if held.host != me.host and time.time() - held.renewed_unix > ttl_s:
        _write(path, me)
        return f"took over the expired lease of {held.describe()} (ttl {ttl_s:.0f} s)"
    raise LeaseHeldError(
        f"{root} is being written by another run: {held.describe()}. Two runs must not write one root. "
        "Stop that run, point this one at another root, or, if you are sure it is gone, pass "
        "CheckpointConfig(break_lease=True)."
    )


def check_idle(root: Path, *, ttl_s: float) -> None:
    """Raise if a live run holds the root's lease (``gc`` must not race a commit)."""
    held = _read(root / LEASE_NAME)
    if held is None or held.same_process(Owner.me()):
        return
    live = _alive_here(held) if held.host == socket.gethostname() else time.time() - held.renewed_unix <= ttl_s
    if live:
        raise LeaseHeldError(
            f"{root} is being written by {held.describe()}; a step newer than the tracker may be a commit in "
            "flight. Run gc when that run has stopped, or pass --force if you are sure it is gone."
        )


_registered: set[str] = set()


def _release_at_exit(path: Path, me: Owner) -> None:
    """A clean exit hands the lease back, so a relaunch on another host need not wait for it."""
    if str(path) in _registered:
        return
    _registered.add(str(path))

    def release() -> None:
        try:
            held = _read(path)
        except UnsafeCheckpointError:
            return  # replaced by a link or FIFO since: not ours to remove, and exit must not raise
        if held is not None and held.same_process(me):
            with contextlib.suppress(OSError):
                path.unlink()

    atexit.register(release)
