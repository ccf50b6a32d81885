"""One writer per root: a lease with the owner's host and PID.

Contract: the first save of a process takes ``ROOT/lease.json`` and every later save
renews it; a save publishes only while this process still holds it (``confirm``). A
lease held by a live process on this host, or by another host and renewed within
``ttl_s``, is refused with the owner named; the manager checks this when it is created
and at ``restore`` too, so a duplicate launch stops before it trains. A lease whose owner
is dead (same host: the PID is gone or now runs another program) is taken over, so
kill-and-relaunch just works; of two relaunches taking over one dead lease at once,
exactly one wins (see ``_take_over``). ``override`` breaks any lease and reports whose
it broke. Lease files are created by ``link`` of a complete temp file and replaced by
rename, so a reader never sees a half-written lease.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import logging
import os
import stat
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .._agree import Agreement, Wire, gather_decide
from ..errors import CheckpointCorruptError, LeaseHeldError
from .layout import atomic_write_bytes, fsync_dir, parse_json, read_small
from .tempfiles import proc_start, temp_name, this_host, writer_gone

log = logging.getLogger("ckptguard")

LEASE_NAME = "lease.json"
TAKEOVER_PREFIX = f"{LEASE_NAME}.takeover-"
_LEASE_BYTES = 64 << 10
# A take-over holds its marker for milliseconds; one from another host older than this is stale.
_MARKER_TTL_S = 60.0
# An unreadable lease this young may be one being created where hard links are unsupported.
_YOUNG_S = 5.0


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
        return cls(this_host(), os.getpid(), proc_start(os.getpid()), now, now)

    def same_process(self, other: Owner) -> bool:
        return (self.host, self.pid, self.start) == (other.host, other.pid, other.start)

    def describe(self) -> str:
        age = time.time() - self.renewed_unix
        return f"pid {self.pid} on host {self.host} (renewed {age:.0f} s ago)"

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()


def holder_gone(host: str, pid: int, start: str | None, *, expired: bool) -> str | None:
    """Why a write lease's holder can no longer write, or None while it may: the one rule of every
    root's lease (this module's ``lease.json`` and an object store's, ``_commit.storelease``), which
    is the rule of every writer (``tempfiles.writer_gone``) except for another holder in this very
    process (another manager of it), whose lease's age decides: this process's liveness says nothing
    of that manager's."""
    if host == this_host() and pid == os.getpid() and start == proc_start(pid):
        return "it expired" if expired else None
    return writer_gone(host, pid, start, expired=expired)


@dataclass(frozen=True)
class _Seen:
    """One look at a lease (or take-over marker) file."""

    fingerprint: str | None  # None: absent; else a hash of its bytes
    owner: Owner | None  # None: absent or unreadable
    problem: str | None = None  # why it is unreadable
    being_created: bool = False  # empty and a moment old: an O_EXCL create not yet written
    foreign: bool = False  # not a small regular file: something else put it there

    def refuse_foreign(self, path: Path) -> None:
        if self.foreign:
            raise CheckpointCorruptError(
                f"{path} is not ckptguard's lease ({self.problem}); ckptguard writes it as a "
                f"small regular file and never opens anything else there. Find out what put it "
                f"there, then remove it by hand."
            )

    def describe(self) -> str:
        return self.owner.describe() if self.owner else f"an unreadable lease ({self.problem})"


def _look(path: Path) -> _Seen:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return _Seen(None, None)
    try:
        raw = read_small(path, limit=_LEASE_BYTES)
    except FileNotFoundError:
        return _Seen(None, None)
    except (
        OSError,
        ValueError,
    ) as exc:  # a link, FIFO or device is never ckptguard's; a huge file is damaged
        key = f"{st.st_ino}:{st.st_mtime_ns}:{st.st_size}:{st.st_mode}".encode()
        return _Seen(
            hashlib.sha256(key).hexdigest(), None, str(exc), foreign=not stat.S_ISREG(st.st_mode)
        )
    fingerprint = hashlib.sha256(raw).hexdigest()
    if not raw:
        young = time.time() - st.st_mtime < _YOUNG_S
        return _Seen(fingerprint, None, "an empty file", being_created=young)
    try:
        data = parse_json(raw, where=str(path))
        owner = Owner(**data)
        if not (isinstance(owner.pid, int) and isinstance(owner.host, str)):
            raise TypeError("host and pid must be a string and an int")
        float(owner.renewed_unix)
    except (ValueError, TypeError) as exc:
        return _Seen(fingerprint, None, f"{type(exc).__name__}: {str(exc)[:200]}")
    return _Seen(fingerprint, owner)


def _write(path: Path, owner: Owner) -> None:
    atomic_write_bytes(path, owner.encode())


def _create(path: Path, owner: Owner) -> bool:
    """Create ``path`` holding ``owner``, only if it does not exist; True if this call did.

    A complete temp file is hard-linked to the name (link fails if the name exists), so a
    reader never sees an empty lease. Where links are unsupported, O_EXCL creates it and
    readers give an unreadable young lease a moment (``_YOUNG_S``) before judging it."""
    tmp = temp_name(path)  # names this process: swept if it is killed before the unlink below
    data = owner.encode()
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError:  # no hard links here (some FUSE and object-store mounts)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    fsync_dir(path.parent)
    return True


def _live(seen: _Seen, *, ttl_s: float) -> bool:
    """Whether the owner of what was seen may still be writing."""
    if seen.owner is None:
        return seen.being_created
    owner = seen.owner
    expired = time.time() - owner.renewed_unix > ttl_s
    return holder_gone(owner.host, owner.pid, owner.start, expired=expired) is None


def _take_over(path: Path, seen: _Seen, me: Owner) -> bool:
    """Replace the abandoned lease ``seen`` by ``me``; True if this process did.

    Two relaunches may both judge one lease abandoned. Each tries to create a marker named
    after what it saw (O_EXCL by link): one wins, re-reads the lease while holding the
    marker and replaces it only if it is still what it judged. A loser that gets the marker
    later finds the winner's lease there and backs off. A marker left by a taker that died
    is itself judged abandoned the same way, one level up, so a crash never wedges the root.
    """
    chain = [seen.fingerprint or ""]
    stale: list[tuple[Path, str]] = []
    mine: Path | None = None
    won = False
    try:
        for _level in range(8):
            key = hashlib.sha256("\n".join(chain).encode()).hexdigest()[:16]
            marker = path.with_name(TAKEOVER_PREFIX + key)
            if _create(marker, me):
                mine = marker
                if _look(path).fingerprint != chain[0] or any(
                    _look(m).fingerprint != f for m, f in stale
                ):
                    return False  # someone took it over first: the caller looks again
                _write(path, me)
                won = True
                return True
            other = _look(marker)
            if other.fingerprint is None:
                return False  # its taker finished meanwhile: the caller looks again
            if _live(other, ttl_s=_MARKER_TTL_S):
                deadline = time.monotonic() + 5.0
                while (
                    time.monotonic() < deadline and _look(marker).fingerprint == other.fingerprint
                ):
                    time.sleep(0.01)
                if _look(marker).fingerprint == other.fingerprint:
                    raise LeaseHeldError(
                        f"{path} is being taken over by {other.describe()} and that has not "
                        f"finished in 5 s; two runs must not write one root: stop one of them"
                    )
                return False
            stale.append((marker, other.fingerprint))
            chain.append(other.fingerprint)
        return False
    finally:
        done = [mine] if mine is not None else []
        if won:  # the lease changed: every marker about what it was is moot now
            done += [m for m, _ in stale]
        for marker in done:
            with contextlib.suppress(OSError):
                marker.unlink()


def acquire(root: Path, *, ttl_s: float, override: bool = False) -> str | None:
    """Take or renew the lease; returns a note when another owner's lease was taken over."""
    path = root / LEASE_NAME
    me = Owner.me()
    for _attempt in range(200):
        seen = _look(path)
        seen.refuse_foreign(path)
        if seen.fingerprint is None:
            if _create(path, me):  # of two runs taking a free lease at once, exactly one wins
                _release_at_exit(path, me)
                return None
            continue
        if seen.owner is not None and seen.owner.same_process(me):
            _write(
                path, Owner(me.host, me.pid, me.start, seen.owner.acquired_unix, me.renewed_unix)
            )
            return None
        if override:
            _write(path, me)
            _release_at_exit(path, me)
            return f"broke the lease of {seen.describe()} (override)"
        if _live(seen, ttl_s=ttl_s):
            if seen.owner is None:  # an empty lease a moment old: one being created
                time.sleep(0.05)
                continue
            raise _held(root, seen.owner)
        if _take_over(path, seen, me):
            _release_at_exit(path, me)
            if seen.owner is None:
                return f"took over {seen.describe()} at {path}: fix what damaged it"
            o = seen.owner
            expired = time.time() - o.renewed_unix > ttl_s
            if holder_gone(o.host, o.pid, o.start, expired=expired) != "it expired":
                return f"took over the lease of dead {seen.describe()}"
            return f"took over the expired lease of {seen.describe()} (ttl {ttl_s:.0f} s)"
    raise LeaseHeldError(
        f"{path} kept changing while this run tried to take it; stop the other runs on {root}"
    )


def _held(root: Path, owner: Owner) -> LeaseHeldError:
    return LeaseHeldError(
        f"{root} is being written by another run: {owner.describe()}. Two runs must not write one "
        f"root. Stop that run, point this one at another root, or, if you are sure it is gone, "
        f"pass break_lease=True to the save (and the restore) that takes it over. To only read one "
        f"of its steps, restore(path=...) from a manager of another root."
    )


def live_holder(root: Path, *, ttl_s: float) -> Owner | None:
    """The live owner of the root's lease other than this process, or None; never writes."""
    seen = _look(root / LEASE_NAME)
    if seen.owner is None or seen.owner.same_process(Owner.me()):
        return None
    return seen.owner if _live(seen, ttl_s=ttl_s) else None


def check_free(root: Path, *, ttl_s: float) -> None:
    """Raise LeaseHeldError if another live run holds the root's lease (manager creation,
    restore). A damaged or foreign lease file is left to the save, which refuses or replaces it."""
    owner = live_holder(root, ttl_s=ttl_s)
    if owner is not None:
        raise _held(root, owner)


def check_idle(root: Path, *, ttl_s: float) -> None:
    """Raise if a live run holds the root's lease (``gc`` must not race a commit), or if
    something that is not a lease sits in its place (no owner can be ruled out)."""
    _look(root / LEASE_NAME).refuse_foreign(root / LEASE_NAME)
    held = live_holder(root, ttl_s=ttl_s)
    if held is not None:
        raise LeaseHeldError(
            f"{root} is being written by {held.describe()}; a step newer than the tracker "
            f"may be a commit in flight. Run gc when that run has stopped, or pass --force "
            f"if you are sure it is gone."
        )


def confirm(root: Path, *, step: int) -> None:
    """Right before publishing: this process still holds the lease (or it vanished and is
    recreated), so a writer whose lease was taken over never commits alongside the new one."""
    path = root / LEASE_NAME
    me = Owner.me()
    seen = _look(path)
    seen.refuse_foreign(path)
    if seen.owner is not None and seen.owner.same_process(me):
        return
    if seen.fingerprint is None and _create(path, me):
        _release_at_exit(path, me)
        return
    seen = _look(path)
    if seen.owner is not None and seen.owner.same_process(me):
        return
    raise LeaseHeldError(
        f"save of step {step} under {root} is not published: this run no longer holds the write "
        f"lease, {seen.describe() if seen.fingerprint else 'nobody'} does (broken with "
        f"break_lease, or taken over as expired). Two runs must not write one root: stop one of "
        f"them, then restore and save again."
    )


def is_mine(root: Path) -> bool:
    held = _look(root / LEASE_NAME).owner
    return held is not None and held.same_process(Owner.me())


def release(root: Path) -> bool:
    """Hand the lease back now if this process holds it (``transfer`` when it is done)."""
    path = root / LEASE_NAME
    held = _look(path).owner
    if held is not None and held.same_process(Owner.me()):
        with contextlib.suppress(OSError):
            path.unlink()
            return True
    return False


def leftover_markers(root: Path) -> list[tuple[Path, bool]]:
    """Lease take-over markers under ``root``, each with whether its writer is dead."""
    out = []
    for marker in sorted(root.glob(f"{LEASE_NAME}.*")):
        if marker.name.startswith(TAKEOVER_PREFIX):
            out.append((marker, not _live(_look(marker), ttl_s=_MARKER_TTL_S)))
    return out


_registered: set[str] = set()


def _release_at_exit(path: Path, me: Owner) -> None:
    """A clean exit hands the lease back, so a relaunch on another host need not wait for it."""
    if str(path) in _registered:
        return
    _registered.add(str(path))

    def release() -> None:
        held = _look(path).owner
        if held is not None and held.same_process(me):
            with contextlib.suppress(OSError):
                path.unlink()

    atexit.register(release)


@dataclass(frozen=True)
class _Nothing(Wire):
    """A rank's part of an agreement where only rank 0 acts."""


def check_on_every_rank(
    agreement: Agreement, root: Path, *, ttl_s: float, where: str, key: str
) -> None:
    """Rank 0 looks for another live run holding ``root``'s write lease, and never writes: at
    creation (``where="create"``) a loud warning (a manager that only reads stays usable),
    elsewhere a LeaseHeldError on every rank, so a duplicate launch stops before its first
    training step instead of at its first save."""

    def decide(_: list[_Nothing]) -> _Nothing:
        if not root.is_dir():
            return _Nothing()
        try:
            check_free(root, ttl_s=ttl_s)
        except LeaseHeldError as exc:
            if where != "create":
                raise
            log.warning("ckptguard: %s (restore and save will refuse)", exc)
        return _Nothing()

    gather_decide(agreement, key, _Nothing(), decide, decision=_Nothing)
