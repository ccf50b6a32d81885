"""The write lease of an object-store root: taken, renewed, checked and released (``acquire``,
``check``, ``release``).

The store (``ckptguard.storage.s3.ObjectStore``) gives the primitives: ``lease()`` reads
``lease.json`` and its ETag, ``put_lease`` writes it by compare-and-set (create if absent, else
``If-Match`` on the ETag read) and checks once that the store refuses the same write again. The rule
of who may write is here, beside the commit that relies on it: the holder renews its own lease; a
lease whose holder is gone (``_disk.lease.holder_gone``, the rule of every root's lease: on this
host its process is dead or its PID runs another program, elsewhere its ``expires_unix`` passed), or
``override`` (``break_lease=True``), is taken over with a note; any other holder raises
``LeaseHeldError`` naming it, when it expires and what to do. Each write is conditional, so two jobs
that both judged a lease free cannot both take it: one write loses and that job reads the lease
again.
"""

from __future__ import annotations

import time

from .._disk.lease import holder_gone
from .._disk.tempfiles import this_host
from ..errors import ConditionalWriteUnsupportedError, LeaseHeldError
from ..storage.s3 import ObjectStore
from ..storage.s3._objrecords import LEASE, Lease, Writer

__all__ = ["acquire", "check", "confirm", "release"]

_TRIES = 8


def acquire(store: ObjectStore, holder: str, *, override: bool = False) -> str | None:
    """Take or renew the store's lease for ``holder``; returns a note when another holder's lease
    was taken over. Raises ``LeaseHeldError`` while another live holder has it."""
    for _ in range(_TRIES):
        now = time.time()
        mine = Lease(holder, Writer.here(), now + store.options.lease_ttl_s, now)
        found, etag = store.lease()
        note = _takeover(store, found, holder, now, override) if found is not None else None
        try:
            if store.put_lease(mine, etag):
                return note
        except ConditionalWriteUnsupportedError:
            release(
                store, holder
            )  # a lease on such a store protects nothing: it must not block a relaunch
            raise
        # another writer wrote it between our read and our write: read it again
    raise LeaseHeldError(
        f"{store.where(LEASE)}: {_TRIES} conditional writes in a row lost to other writers; two "
        "jobs start on this root at once: stop one"
    )


def check(store: ObjectStore, holder: str, *, override: bool = False) -> None:
    """Raise ``LeaseHeldError`` while another live holder has the lease (reads only)."""
    found, _ = store.lease()
    if found is not None:
        _takeover(store, found, holder, time.time(), override)


def confirm(store: ObjectStore, holder: str, *, step: int) -> None:
    """Right before a commit: the lease is ``holder``'s still (renewed at the attempt's begin), so a
    job whose lease was taken over, released or broken never commits beside the new holder."""
    found, _ = store.lease()
    if found is not None and found.holder == holder:
        return
    who = f"{found.holder} ({found.writer.describe()})" if found is not None else "nobody"
    raise LeaseHeldError(
        f"step {step} is not committed on {store.url}: this job ({holder}) no longer "
        f"holds the store's write lease, {who} does (taken over as expired or dead, or "
        f"broken with break_lease). Two jobs must not write one root: stop one of "
        f"them, then restore and save again"
    )


def release(store: ObjectStore, holder: str) -> None:
    """Mark ``holder``'s lease expired (anyone may take it at once); another holder's is left
    alone."""
    found, etag = store.lease()
    if found is None or found.holder != holder:
        return
    store.put_lease(Lease(holder, Writer.here(), 0.0, time.time()), etag, verify=False)


def _takeover(
    store: ObjectStore, lease: Lease, holder: str, now: float, override: bool
) -> str | None:
    """None: ``holder``'s own lease; a note: another's lease ``holder`` may take over; else
    ``LeaseHeldError``. Whether the other holder is gone is the rule every root's lease follows
    (``_disk.lease.holder_gone``)."""
    if lease.holder == holder:
        return None
    w = lease.writer
    why = "break_lease" if override else None
    if why is None and lease.expires_unix <= 0:
        why = "released"  # ``release`` marks it so: anyone may take it at once
    why = why or holder_gone(w.host, w.pid, w.start, expired=lease.expires_unix < now)
    if why is not None:
        return f"took over the write lease of {lease.holder} ({w.describe()}; {why})"
    if w.host == this_host():  # alive here: its lease's age does not free it
        raise LeaseHeldError(
            f"{store.where(LEASE)} is held by {lease.holder} ({w.describe()}), a live process on "
            f"this host: another job writes this root. Stop it, or pass break_lease=True if you "
            f"are sure it no longer writes"
        )
    raise LeaseHeldError(
        f"{store.where(LEASE)} is held by {lease.holder} ({w.describe()}) until "
        f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(lease.expires_unix))}: another "
        f"live job writes this root. Stop it, wait for the lease to expire, or pass "
        f"break_lease=True if it is dead"
    )
