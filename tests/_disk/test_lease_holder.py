"""One rule for whether a write lease's holder is gone (``_disk.lease.holder_gone``), the same cases
on a directory root's ``lease.json`` and an object store's (moto): on this host the holder's process
decides, however old its lease (a PID now running another program, as in a restarted container, is
gone); on another host the lease's age. Before, the object store judged a process on this host by
its PID alone and took over any expired lease."""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from pathlib import Path

import pytest

pytest.importorskip("boto3", reason="the s3 extra (boto3) is not installed")
pytest.importorskip("moto.server", reason="moto[server] (dev extra) is not installed")

import objstore_helper as h
from ckptguard._commit import storelease
from ckptguard._disk import lease as dirlease
from ckptguard.errors import LeaseHeldError
from ckptguard.storage.s3 import ObjectStore, Writer
from ckptguard.storage.s3._objrecords import Lease
from liveproc import live_process

TTL = 3600.0


@pytest.fixture(scope="module")
def moto():
    with h.moto_endpoint() as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def live():
    """A live process on this host besides the test's own: (pid, start time)."""
    with live_process() as found:
        yield found


class DirRootLease:
    def __init__(self, tmp_path: Path) -> None:
        self.root = tmp_path / "root"
        self.root.mkdir()

    def held_by(self, host: str, pid: int, start: str | None, age_s: float) -> None:
        now = time.time()
        owner = {
            "host": host,
            "pid": pid,
            "start": start,
            "acquired_unix": now - age_s,
            "renewed_unix": now - age_s,
        }
        (self.root / dirlease.LEASE_NAME).write_text(json.dumps(owner))

    def acquire(self) -> str | None:
        return dirlease.acquire(self.root, ttl_s=TTL)


class StoreLease:
    def __init__(self, endpoint: str) -> None:
        import boto3

        name = f"lease-{secrets.token_hex(4)}"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=name)
        self.store = ObjectStore(f"s3://{name}/run", h.options(endpoint, lease_ttl_s=TTL))
        self.store.ensure_root()

    def held_by(self, host: str, pid: int, start: str | None, age_s: float) -> None:
        now = time.time()
        lease = Lease(
            "the earlier job", Writer(host, pid, None, start), now - age_s + TTL, now - age_s
        )
        assert self.store.put_lease(lease, None)

    def acquire(self) -> str | None:
        return storelease.acquire(self.store, f"this job {secrets.token_hex(2)}")


@pytest.fixture(params=["directory", "object store"])
def root(request, tmp_path):
    return (
        DirRootLease(tmp_path)
        if request.param == "directory"
        else StoreLease(request.getfixturevalue("moto"))
    )


def test_a_lease_of_an_earlier_process_that_had_this_pid_is_taken_over(root):
    # A container restarted: the job comes back with the PID its killed predecessor had.
    root.held_by(socket.gethostname(), os.getpid(), "1", age_s=5)
    note = root.acquire()
    assert note is not None and "dead" in note, note


def test_a_live_process_on_this_host_keeps_its_lease_however_old(root, live):
    pid, start = live
    root.held_by(socket.gethostname(), pid, start, age_s=2 * TTL)  # expired by its age: never taken
    with pytest.raises(LeaseHeldError, match=f"pid {pid}") as held:
        root.acquire()
    assert "wait for the lease to expire" not in str(held.value)  # waiting never frees it here


@pytest.mark.parametrize("age_s, taken", [(60, False), (2 * TTL, True)])
def test_a_record_without_a_start_time_on_this_host_is_judged_by_its_age(root, live, age_s, taken):
    # Written before records carried the start time: the PID alone cannot tell the holder from a
    # later process.
    root.held_by(socket.gethostname(), live[0], None, age_s=age_s)
    if taken:
        note = root.acquire()
        assert note is not None and "expired" in note, note
    else:
        with pytest.raises(LeaseHeldError):
            root.acquire()


def test_a_dead_process_on_this_host_frees_its_lease_at_once(root, live):
    root.held_by(socket.gethostname(), 2**22 + 17, None, age_s=1)  # no such PID
    note = root.acquire()
    assert note is not None and "dead" in note, note


@pytest.mark.parametrize("age_s, taken", [(60, False), (2 * TTL, True)])
def test_another_hosts_lease_is_judged_by_its_age(root, age_s, taken):
    root.held_by("some-other-host", 4242, "99", age_s=age_s)
    if taken:
        note = root.acquire()
        assert note is not None and "expired" in note, note
    else:
        with pytest.raises(LeaseHeldError, match="some-other-host"):
            root.acquire()


def test_a_writer_record_without_a_start_time_reads_and_a_crafted_one_is_refused():
    from ckptguard.errors import CheckpointCorruptError

    def record(**writer: object) -> bytes:
        body = {"holder": "x", "writer": {"host": "h", "pid": 3, "lease": None, **writer}}
        return json.dumps({**body, "expires_unix": 1.0, "renewed_unix": 1.0}).encode()

    # Written before the field existed:
    assert Lease.from_bytes(record(), "lease.json").writer.start is None
    assert Lease.from_bytes(record(start="123"), "lease.json").writer.start == "123"
    for bad in ("9" * 40, 7, ["1"]):
        with pytest.raises(CheckpointCorruptError, match="field 'writer'"):
            Lease.from_bytes(record(start=bad), "lease.json")
