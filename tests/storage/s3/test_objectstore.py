"""Checkpoints on an S3-compatible object store, against real S3 servers started here on 127.0.0.1.

moto in server mode (``ThreadedMotoServer``, in this process, so its objects outlive a restart of
the server) for everything, and ministack (a second S3 implementation, in its own venv because it
pins botocore) for the conditional-create race and the part checksums the store must verify
(moto does not verify them). Writers that are killed run in their own processes.

- The store's promises: a second conditional create and a stale If-Match get 412 (the probe);
  a store that ignores them is refused, and works only in the weaker mode asked for by name.
- Save and restore bit for bit; the step's tensor state read by plain DCP (``FsspecReader`` + s3fs).
- SIGKILL between parts, after the shards before the marker, between marker and tracker: the
  restore resumes the last committed step exactly, nothing of the killed step is visible, gc
  removes its objects and aborts its multipart uploads, and the step saves again (an orphan marker
  replaced by the lease holder).
- The server stopped mid-upload and a server that stalls: bounded retries, an ObjectStoreError
  naming bucket, key and step, nothing visible.
- Two writer processes racing, 50 trials each: for the same step exactly one commits; for the
  tracker, both steps commit and the tracker ends at the newer one, never observed moving back;
  for the lease exactly one holds it.
- Rotation (marker first, no object of a deleted step left), gc (only ckptguard's objects),
  two gloo ranks saving and restoring through one store.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

boto3 = pytest.importorskip("boto3", reason="the s3 extra (boto3) is not installed")
moto_server = pytest.importorskip("moto.server", reason="moto[server] (dev extra) is not installed")

import ckptguard as cg  # noqa: E402
import objstore_helper as h  # noqa: E402
from ckptguard import Consistency  # noqa: E402
from ckptguard._commit import storepublish  # noqa: E402
from ckptguard._resume.storefetch import resolve  # noqa: E402
from ckptguard.errors import (  # noqa: E402
    CommitConflictError,
    ConditionalWriteUnsupportedError,
    ConfigError,
    ObjectStoreError,
)
from ckptguard.storage.s3 import ObjectStore  # noqa: E402
from ckptguard.testing import run_ranks, set_fault_hook, values  # noqa: E402

HELPER = str(Path(__file__).parents[2] / "objstore_helper.py")
TRIALS = 50

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module", autouse=True)
def credentials():
    saved = {k: os.environ.get(k) for k in h.CREDENTIALS}
    os.environ.update(h.CREDENTIALS)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def moto():
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = moto_server.ThreadedMotoServer(
        ip_address="127.0.0.1", port=h.free_port(), verbose=False
    )
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture(scope="module")
def ministack():
    if not h.ministack_ready():
        pytest.skip(
            f"{h.MINISTACK} is missing: `make ministack-venv` could not build it "
            f"(ministack pins botocore)"
        )
    server = h.Ministack()
    yield server.endpoint
    server.stop()


_buckets = iter(range(10**6))


def bucket(endpoint: str) -> str:
    name = f"ckpt-{os.getpid()}-{next(_buckets)}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=name)
    return name


def keys(endpoint: str, name: str) -> list[str]:
    pages = (
        boto3.client("s3", endpoint_url=endpoint)
        .get_paginator("list_objects_v2")
        .paginate(Bucket=name)
    )
    return sorted(o["Key"] for page in pages for o in page.get("Contents") or [])


def uploads(endpoint: str, name: str) -> list[str]:
    return [
        u["Key"]
        for u in boto3.client("s3", endpoint_url=endpoint)
        .list_multipart_uploads(Bucket=name)
        .get("Uploads")
        or []
    ]


def restored_step(endpoint: str, url: str, staging: Path) -> int:
    """Restore into a blank state in this process and check it is exactly the state saved at that
    step."""
    ckpt = h.root(url, staging, endpoint)
    state = h.blank()
    step = ckpt.restore(state)
    ckpt.close()
    if step:
        assert torch.equal(state["model"].w.detach(), h.values_at(step)), (
            f"step {step} restored other bytes"
        )
        assert state["counter"] == {"step": step}
    return step


def writer(endpoint: str, url: str, staging: Path, last: int, point: str | None = None) -> int:
    args = [
        sys.executable,
        HELPER,
        "write",
        endpoint,
        url,
        str(staging),
        str(last),
        *([point] if point else []),
    ]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=240)
    assert proc.returncode in (0, -signal.SIGKILL), proc.stderr[-3000:]
    return proc.returncode


# ---------------------------------------------------------------- the store's promises


def test_conditional_create_and_if_match_are_refused_with_412(moto, ministack):
    for endpoint in (moto, ministack):
        client = boto3.client("s3", endpoint_url=endpoint)
        name = bucket(endpoint)
        first = client.put_object(Bucket=name, Key="k", Body=b"1", IfNoneMatch="*")
        for cond in ({"IfNoneMatch": "*"}, {"IfMatch": '"0123"'}):
            with pytest.raises(client.exceptions.ClientError) as err:
                client.put_object(Bucket=name, Key="k", Body=b"2", **cond)
            assert err.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412, (endpoint, cond)
        client.put_object(Bucket=name, Key="k", Body=b"3", IfMatch=first["ETag"])


def test_a_store_ignoring_conditions_is_refused_unless_the_weaker_mode_is_named(moto, tmp_path):
    name = bucket(moto)
    proxy = h.Proxy(int(moto.rsplit(":", 1)[1]), strip=True)
    try:
        ckpt = h.root(f"s3://{name}/run", tmp_path / "a", proxy.endpoint)
        with pytest.raises(ConditionalWriteUnsupportedError, match="If-None-Match") as err:
            ckpt.save(1, h.state_at(1))
        assert err.value.bucket == name and "SINGLE_WRITER_UNSAFE" in str(err.value)
        assert [
            k for k in keys(moto, name) if not k.startswith("run/.ckptguard-probe")
        ] == []  # nothing written
        weak = h.root(
            f"s3://{name}/run",
            tmp_path / "b",
            proxy.endpoint,
            consistency=Consistency.SINGLE_WRITER_UNSAFE,
        )
        weak.save(1, h.state_at(1))
        weak.close()
        again = ObjectStore(
            f"s3://{name}/run",
            h.options(proxy.endpoint, consistency=Consistency.SINGLE_WRITER_UNSAFE),
        )
        again.ensure_root()  # plain PUTs: an existing tracker is never reset to 0
        assert again.tracker()[0] == 1
    finally:
        proxy.stop()
    assert restored_step(moto, f"s3://{name}/run", tmp_path / "c") == 1


def test_a_corrupted_part_is_refused_by_the_store(ministack, tmp_path, monkeypatch):
    from ckptguard.storage.s3 import _transfer

    name = bucket(ministack)
    url = f"s3://{name}/run"
    ckpt = h.root(url, tmp_path / "a", ministack)
    ckpt.save(1, h.state_at(1))
    real = _transfer._crc
    monkeypatch.setattr(
        _transfer, "_crc", lambda data: real(bytes(data[:-1]) + b"\0")
    )  # bytes != their checksum
    with pytest.raises(ObjectStoreError, match="BadDigest") as err:
        ckpt.save(2, h.state_at(2))
    assert err.value.bucket == name and err.value.step == 2 and "step_00000002" in err.value.key
    monkeypatch.undo()
    ckpt.close()
    assert restored_step(ministack, url, tmp_path / "b") == 1


# ---------------------------------------------------------------- save, restore, plain DCP


def test_save_restore_exactly_and_plain_dcp_reads_the_state_from_the_store(moto, tmp_path):
    s3fs = pytest.importorskip(
        "s3fs", reason="s3fs is not installed: DCP's FsspecReader cannot reach s3://"
    )
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import (
        FsspecReader,  # its home in torch 2.13
    )

    name = bucket(moto)
    url = f"s3://{name}/runs/one"
    ckpt = h.root(url, tmp_path / "stage", moto)
    assert ckpt.restore(h.blank()) == 0  # nothing there: a declared fresh start, nothing created
    assert keys(moto, name) == []
    for step in (1, 2):
        assert (
            ckpt.save(step, h.state_at(step))
            == (tmp_path / "stage" / f"step_{step:08d}").absolute()
        )
        assert ckpt.resolve().url == f"{url}/step_{step:08d}/manifest.json"
    assert ckpt.committed_steps() == [1, 2]
    ckpt.close()
    assert restored_step(moto, url, tmp_path / "fresh") == 2

    store = ObjectStore(url, h.options(moto))
    marker = resolve(store).marker
    assert marker is not None and marker.step == 2
    plain = {"model.w": torch.zeros(h.ELEMENTS)}
    s3fs.S3FileSystem.clear_instance_cache()
    dcp.load(
        plain,
        storage_reader=FsspecReader(store.state_url(marker), client_kwargs={"endpoint_url": moto}),
    )
    assert torch.equal(plain["model.w"], h.values_at(2))


def test_no_step_without_its_marker_and_the_tracker_never_moves_back(moto, tmp_path):
    name = bucket(moto)
    url = f"s3://{name}/run"
    store = ObjectStore(url, h.options(moto))
    store.ensure_root()
    data = tmp_path / "data.bin"
    data.write_bytes(b"x" * 1000)
    attempt = storepublish.begin(store, 3)
    store.upload(3, attempt, [("state/data.bin", data, 1000)])
    assert (
        resolve(store).step == 0 and store.committed_steps() == []
    )  # uploaded, no marker: invisible
    storepublish.commit(store, 3, attempt, {}, {"any": "manifest"})
    assert resolve(store).step == 3 and store.committed_steps() == [3]
    with pytest.raises(CommitConflictError, match="older than the tracker"):
        storepublish.begin(store, 2)
    with pytest.raises(CommitConflictError, match="already committed"):
        storepublish.begin(store, 3)
    assert store.tracker()[0] == 3
    with pytest.raises(ConfigError, match="not a ckptguard root"):
        h.gc(ObjectStore(f"s3://{name}/other", h.options(moto)))


# ---------------------------------------------------------------- kills


@pytest.mark.parametrize(
    "point", ["store.part_uploaded", "store.before_marker", "store.before_tracker"]
)
def test_a_writer_killed_mid_commit_leaves_the_last_committed_step(moto, tmp_path, point):
    name = bucket(moto)
    url = f"s3://{name}/run"
    h.write(moto, url, str(tmp_path / "w1"), 2, None)  # here: a process start costs a torch import
    assert (
        writer(moto, url, tmp_path / "killed", 3, point) == -signal.SIGKILL
    )  # restores 2, killed saving 3
    store = ObjectStore(url, h.options(moto))
    assert store.tracker()[0] == 2 and store.committed_steps() == [1, 2]
    orphan = store.marker(3)
    assert (orphan is not None) == (
        point == "store.before_tracker"
    )  # a marker past the tracker: an orphan
    assert restored_step(moto, url, tmp_path / "r1") == 2
    if point == "store.part_uploaded":
        assert any(
            "step_00000003" in k for k in uploads(moto, name)
        )  # the killed multipart upload is left
    calls: list[str] = []

    def logging_call(name: str, real):
        def logged(*args, **kwargs):
            calls.append(f"{name} {str(args[0]).rsplit('/', 1)[-1]}" if name == "delete" else name)
            return real(*args, **kwargs)

        return logged

    for method in ("abort", "delete", "delete_many"):  # the order gc removes in
        setattr(store.bucket, method, logging_call(method, getattr(store.bucket, method)))
    report = h.gc(store)
    assert h.foreign(report) == []
    if point == "store.part_uploaded":  # the upload aborted before its owner record goes
        assert calls.index("abort") < calls.index("delete owner.json"), calls
    if point != "store.before_tracker":
        assert [a.split("/")[0] for a in h.attempts(store, report.removed)] == ["step_00000003"]
        assert not [k for k in keys(moto, name) if "step_00000003" in k]
        assert not uploads(moto, name)
    h.write(
        moto, url, str(tmp_path / "w2"), 4, None
    )  # resumes at 2, saves 3 (an orphan marker replaced) and 4
    assert store.committed_steps() == [1, 2, 3, 4]
    assert restored_step(moto, url, tmp_path / "r2") == 4


def test_the_server_stopped_mid_upload_is_a_clear_error_and_nothing_is_visible(tmp_path):
    port = h.free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    name = bucket(endpoint)
    url = f"s3://{name}/run"
    ckpt = h.root(url, tmp_path / "a", endpoint, connect_timeout_s=0.5)
    ckpt.save(1, h.state_at(1))
    stopped = threading.Event()

    def stop() -> None:
        if not stopped.is_set():
            stopped.set()
            server.stop()

    set_fault_hook("store.part_uploaded", stop)
    started = time.monotonic()
    try:
        with pytest.raises(ObjectStoreError) as err:
            ckpt.save(2, h.state_at(2))
    finally:
        set_fault_hook("store.part_uploaded", None)
    assert time.monotonic() - started < 60  # bounded retries, not a hang
    message = str(err.value)
    assert (
        f"s3://{name}/run/step_00000002/" in message
        and "(step 2)" in message
        and "did not answer" in message
    )
    assert err.value.bucket == name and err.value.step == 2
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()  # same process: the objects survived; the step must not be visible
    try:
        store = ObjectStore(url, h.options(endpoint))
        assert (
            store.tracker()[0] == 1 and store.marker(2) is None and store.committed_steps() == [1]
        )
        ckpt.close()  # its lease: released
        assert restored_step(endpoint, url, tmp_path / "b") == 1
    finally:
        server.stop()


def test_a_stalling_server_fails_after_the_bounded_retries(moto, tmp_path):
    name = bucket(moto)
    url = f"s3://{name}/run"
    ckpt = h.root(url, tmp_path / "a", moto)
    ckpt.save(1, h.state_at(1))
    ckpt.close()
    proxy = h.Proxy(int(moto.rsplit(":", 1)[1]), stall_s=3.0)
    try:
        slow = h.root(url, tmp_path / "a", proxy.endpoint, read_timeout_s=1.0, attempts=2)
        started = time.monotonic()
        with pytest.raises(ObjectStoreError, match="did not answer") as err:
            slow.save(2, h.state_at(2))
        assert time.monotonic() - started < 30
        assert err.value.bucket == name and err.value.key.startswith("run/")
    finally:
        proxy.stop()
    assert ObjectStore(url, h.options(moto)).committed_steps() == [1]


# ---------------------------------------------------------------- races


class Races:
    """Every race of this module in one pair of spawned writer processes (each start imports
    torch)."""

    def __init__(self, moto: str, ministack: str | None, tmp: Path) -> None:
        self.buckets = {
            (moto, "step"): bucket(moto),
            (moto, "tracker"): bucket(moto),
            (moto, "lease"): bucket(moto),
        }
        if ministack is not None:
            self.buckets[(ministack, "step")] = bucket(ministack)
        self.seen: dict[int, list[int]] = {}
        self.results: dict[tuple[str, str], dict[int, list[tuple]]] = {}
        data = tmp / "data.bin"
        data.write_bytes(os.urandom(4096))
        races = [(endpoint, name, kind) for (endpoint, kind), name in self.buckets.items()]
        ctx = mp.get_context("spawn")
        barrier, out = ctx.Barrier(2), ctx.Queue()
        procs = [
            ctx.Process(target=h.race_worker, args=(races, role, TRIALS, barrier, out, str(data)))
            for role in (0, 1)
        ]
        done = threading.Event()
        watcher = threading.Thread(target=self._observe, args=(moto, done), daemon=True)
        watcher.start()
        for p in procs:
            p.start()
        started = time.monotonic()
        try:
            for _ in range(
                2 * sum(TRIALS if kind != "lease" else h.LEASE_TRIALS for _, _, kind in races)
            ):
                endpoint, kind, trial, role, step, attempt, result = out.get(timeout=180)
                self.results.setdefault((endpoint, kind), {}).setdefault(trial, []).append(
                    (role, step, attempt, result)
                )
        finally:
            done.set()
            watcher.join(10)
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
        self.exitcodes = [p.exitcode for p in procs]
        self.seconds = time.monotonic() - started

    def _observe(self, moto: str, done: threading.Event) -> None:
        """Tracker reads of the trial in progress during the tracker race: never a smaller value
        after a larger."""
        client, name = boto3.client("s3", endpoint_url=moto), self.buckets[(moto, "tracker")]
        while not done.wait(0.005):
            finished = self.results.get((moto, "tracker"), {})
            trial = sum(len(v) == 2 for v in finished.values())
            if (
                trial >= TRIALS
                or not any(k == (moto, "step") for k in self.results)
                or len(self.results.get((moto, "step"), {})) < TRIALS
            ):
                continue  # the tracker race comes after the step race on moto
            key = f"tracker-{trial:03d}/latest_checkpointed_iteration.txt"
            with contextlib.suppress(client.exceptions.NoSuchKey):
                self.seen.setdefault(trial, []).append(
                    int(client.get_object(Bucket=name, Key=key)["Body"].read())
                )


@pytest.fixture(scope="module")
def races(moto, tmp_path_factory):
    ministack = None
    if h.ministack_ready():
        server = h.Ministack()
        ministack = server.endpoint
    try:
        yield Races(moto, ministack, tmp_path_factory.mktemp("races"))
    finally:
        if ministack is not None:
            server.stop()


@pytest.mark.parametrize("server", ["moto", "ministack"])
def test_two_writers_racing_for_one_step_exactly_one_commits(server, races, moto):
    endpoint = moto if server == "moto" else next((e for e, k in races.buckets if e != moto), None)
    if endpoint is None:
        pytest.skip(
            f"{h.MINISTACK} is missing: `make ministack-venv` could not build it "
            f"(ministack pins botocore)"
        )
    assert races.exitcodes == [0, 0]
    results = races.results[(endpoint, "step")]
    assert len(results) == TRIALS
    for trial, outcome in sorted(results.items()):
        winners = [r for r in outcome if r[3] == "won"]
        assert len(winners) == 1, (trial, outcome)
        store = ObjectStore(
            f"s3://{races.buckets[(endpoint, 'step')]}/step-{trial:03d}", h.options(endpoint)
        )
        assert store.marker(1).attempt == winners[0][2] and store.tracker()[0] == 1
        assert store.marker(1).manifest == {"role": winners[0][0]}


def test_two_writers_racing_for_the_tracker_never_move_it_back(races, moto):
    results = races.results[(moto, "tracker")]
    assert len(results) == TRIALS
    for trial, outcome in sorted(results.items()):
        assert sorted(r[3] for r in outcome) == ["won", "won"], (
            trial,
            outcome,
        )  # steps 5 and 7: both commit
        store = ObjectStore(
            f"s3://{races.buckets[(moto, 'tracker')]}/tracker-{trial:03d}", h.options(moto)
        )
        assert store.tracker()[0] == 7 and store.committed_steps() == [5, 7]
    for trial, seen in races.seen.items():
        assert seen == sorted(seen), (trial, seen)
    assert (
        sum(len(v) for v in races.seen.values()) >= TRIALS // 2
    )  # the observer did look during the race


def test_two_writers_racing_for_the_lease_exactly_one_holds_it(races, moto):
    results = races.results[(moto, "lease")]
    assert len(results) == h.LEASE_TRIALS
    client = boto3.client("s3", endpoint_url=moto)
    for trial, outcome in sorted(results.items()):
        assert sorted(r[3][:4] for r in outcome) == ["lost", "won"], (trial, outcome)
        lease = json.loads(
            client.get_object(
                Bucket=races.buckets[(moto, "lease")], Key=f"lease-{trial:03d}/lease.json"
            )["Body"].read()
        )
        assert lease["holder"] == f"writer-{next(r for r in outcome if r[3] == 'won')[0]}"


# ---------------------------------------------------------------- rotation, gc, ranks


def test_rotation_deletes_marker_first_and_every_object_of_the_step(moto, tmp_path, monkeypatch):
    from ckptguard.storage.s3._bucket import Bucket

    name = bucket(moto)
    url = f"s3://{name}/run"
    config = cg.CheckpointConfig(timeout_s=60.0, retention=cg.KeepLast(2))
    ckpt = cg.CheckpointManager(url, config=h.config(moto, tmp_path / "a", base=config))
    deleted: list[str] = []
    real = Bucket.delete

    def spy(self: Bucket, key: str, **kw) -> None:
        deleted.append(key)
        real(self, key, **kw)

    monkeypatch.setattr(Bucket, "delete", spy)
    for step in range(1, 5):
        ckpt.save(step, h.state_at(step))
    ckpt.close()
    assert ckpt.committed_steps() == [3, 4]
    assert [k for k in deleted if k.endswith("manifest.json")] == [
        "run/step_00000001/manifest.json",
        "run/step_00000002/manifest.json",
    ]
    assert not [k for k in keys(moto, name) if "step_00000001" in k or "step_00000002" in k]


def test_rotation_keeps_the_same_steps_on_a_store_as_on_a_directory_root(moto, tmp_path):
    """One rotation decision for both kinds of root (``_records.retention.kept``): the policy's
    steps, the tracker's, and on the store the step this job restored (protected while it trains
    from it)."""
    config = cg.CheckpointConfig(timeout_s=60.0, retention=cg.KeepLast(1) | cg.KeepEvery(3))
    url = f"s3://{bucket(moto)}/run"
    roots = [
        cg.CheckpointManager(url, config=h.config(moto, tmp_path / "s", base=config)),
        cg.CheckpointManager(tmp_path / "d", config=config),
    ]
    for step in range(1, 5):
        for root in roots:
            root.save(step, h.state_at(step))
    assert roots[0].committed_steps() == roots[1].committed_steps() == [3, 4]
    for root in roots:
        root.close()
    again = cg.CheckpointManager(url, config=h.config(moto, tmp_path / "r", base=config))
    assert again.restore(h.blank()) == 4
    for step in range(5, 8):
        again.save(step, h.state_at(step))
    assert again.committed_steps() == [
        3,
        4,
        6,
        7,
    ]  # 4: restored here, kept while this job trains from it
    again.close()


def test_a_held_step_survives_the_stores_rotation_until_released(moto, tmp_path):
    """``hold`` on an s3:// root pins a step of the store: kept in the staging root, honoured by the
    rotation on the store after each publish; ``release`` lets the next rotation delete it."""
    config = cg.CheckpointConfig(timeout_s=60.0, retention=cg.KeepLast(1))
    ckpt = cg.CheckpointManager(
        f"s3://{bucket(moto)}/run", config=h.config(moto, tmp_path / "s", base=config)
    )
    ckpt.save(1, h.state_at(1))
    ckpt.hold(1, "evaluation of step 1")
    for step in (2, 3):
        ckpt.save(step, h.state_at(step))
    assert ckpt.committed_steps() == [1, 3]
    assert ckpt.release(1)
    ckpt.save(4, h.state_at(4))
    assert ckpt.committed_steps() == [4]
    ckpt.close()


def test_gc_removes_only_unmarked_attempts_it_owns(moto, tmp_path):
    name = bucket(moto)
    url = f"s3://{name}/run"
    client = boto3.client("s3", endpoint_url=moto)
    h.write(moto, url, str(tmp_path / "w"), 1, None)
    client.put_object(
        Bucket=name, Key="run/notes.txt", Body=b"mine"
    )  # foreign objects under the root
    client.put_object(
        Bucket=name, Key="run/step_00000002/a-feedbeef/state/x", Body=b"no owner record"
    )
    client.put_object(Bucket=name, Key="elsewhere/step_00000002/a-1/owner.json", Body=b"{}")
    store = ObjectStore(url, h.options(moto))
    attempt = storepublish.begin(store, 2)
    data = tmp_path / "d.bin"
    data.write_bytes(b"y" * 100)
    store.upload(2, attempt, [("state/d.bin", data, 100)])
    # Its writer is this process, alive: kept whatever its age, as a directory root's temp dir of a
    # live owner.
    assert h.attempts(store, h.gc(store).kept) == [f"step_00000002/{attempt}"]
    # A writer on another host: the attempt's age decides.
    h.rewrite_owner(moto, url, 2, attempt, host="another-host", pid=os.getpid())
    assert h.attempts(store, h.gc(store, min_age_s=3600).kept) == [f"step_00000002/{attempt}"]
    dry = h.gc(store, dry_run=True)
    assert h.attempts(store, dry.removed) == [f"step_00000002/{attempt}"]
    assert f"run/step_00000002/{attempt}/owner.json" in keys(moto, name)
    report = h.gc(store)
    assert h.attempts(store, report.removed) == [f"step_00000002/{attempt}"]
    assert "(2 objects)" in report.removed[0][1]
    assert sorted(h.foreign(report)) == ["run/notes.txt", "run/step_00000002/a-feedbeef/state/x"]
    left = keys(moto, name)
    assert "run/notes.txt" in left and "elsewhere/step_00000002/a-1/owner.json" in left
    assert not [k for k in left if attempt in k]
    assert restored_step(moto, url, tmp_path / "r") == 1


def test_gc_keeps_an_attempt_committed_between_its_survey_and_its_removal(moto, tmp_path):
    """``--force`` on a writer of another host that only looked gone: its marker published after
    gc's survey makes the attempt a committed step's objects; gc reads the marker again right
    before deleting (cold review)."""
    from ckptguard.ops.gc import collect
    from ckptguard.ops.storegc import StoreRoot

    name = bucket(moto)
    url = f"s3://{name}/run"
    h.write(moto, url, str(tmp_path / "w"), 1, None)
    store = ObjectStore(url, h.options(moto))
    attempt = storepublish.begin(store, 2)
    data = tmp_path / "d.bin"
    data.write_bytes(b"z" * 10)
    store.upload(2, attempt, [("state/d.bin", data, 10)])
    h.rewrite_owner(moto, url, 2, attempt, host="another-host", pid=os.getpid())

    class Late(StoreRoot):
        def survey(self, **kwargs):  # its writer commits while gc has looked but not deleted
            found = super().survey(**kwargs)
            storepublish.commit(store, 2, attempt, {}, {"any": "manifest"})
            return found

    report = collect(Late(store, min_age_s=0), force=True)
    assert h.attempts(store, report.removed) == [], report
    kept = [w for w, why in report.kept if "a marker names it now" in why]
    assert kept == [store.where("step_00000002", attempt)], report
    assert store.marker(2) is not None
    assert f"run/step_00000002/{attempt}/state/d.bin" in keys(moto, name)


def _ranks_save(rank: int, world: int, endpoint: str, url: str, staging: str, fresh: str) -> dict:
    os.environ.update(h.CREDENTIALS)
    ckpt = h.root(url, staging, endpoint)
    for step in (1, 2):  # the tensor replicated (DCP stores it once), the counter per rank (extras)
        ckpt.save(
            step, {"model": h.state_at(step)["model"], "counter": {"step": step, "rank": rank}}
        )
    ckpt.close()
    again = h.root(url, fresh, endpoint)
    state = {"model": h.Blob(), "counter": {}}
    step = again.restore(state)
    again.close()
    return {
        "step": step,
        "exact": bool(torch.equal(state["model"].w.detach(), h.values_at(step))),
        "counter": state["counter"],
    }


def test_two_gloo_ranks_save_and_restore_through_the_store(moto, tmp_path):
    name = bucket(moto)
    got = values(
        run_ranks(
            _ranks_save, 2, moto, f"s3://{name}/run", str(tmp_path / "s"), str(tmp_path / "f")
        )
    )
    assert got == [{"step": 2, "exact": True, "counter": {"step": 2, "rank": r}} for r in (0, 1)]


# ---------------------------------------------------------------- the CLI on s3:// roots


def test_cli_list_and_verify_an_s3_root(moto, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from ckptguard.cli import main

    name = bucket(moto)
    url = f"s3://{name}/run"
    h.write(moto, url, str(tmp_path / "w"), 2, None)
    store = ObjectStore(url, h.options(moto))
    data = tmp_path / "d.bin"
    data.write_bytes(b"z" * 10)
    store.upload(
        3, storepublish.begin(store, 3), [("state/d.bin", data, 10)]
    )  # an interrupted save: no marker
    monkeypatch.setenv(
        "AWS_ENDPOINT_URL", moto
    )  # the CLI takes the endpoint from boto3's configuration
    runner = CliRunner()
    listed = runner.invoke(main, ["list", url, "--json"])
    assert listed.exit_code == 0, listed.output
    got = json.loads(listed.output)
    assert got["tracker"] == 2 and [
        (e["step"], e["state"].split(" (")[0].split(":")[0]) for e in got["entries"]
    ] == [(1, "committed"), (2, "committed"), (3, "NOT committed")]
    ok = runner.invoke(main, ["verify", url, "--deep"])
    assert ok.exit_code == 0 and "OK: 2 step(s) checked with checksums" in ok.output, ok.output
    victim = next(k for k in keys(moto, name) if "step_00000001/a-" in k and k.endswith(".distcp"))
    boto3.client("s3", endpoint_url=moto).delete_object(
        Bucket=name, Key=victim
    )  # the negative control
    bad = runner.invoke(main, ["verify", url, "--json"])
    assert bad.exit_code == 1, bad.output
    findings = json.loads(bad.output)["findings"]
    assert [f["code"] for f in findings] == ["missing-object"] and victim in findings[0]["path"]
    usage = runner.invoke(main, ["list", f"s3://{name}"])
    assert (
        usage.exit_code == 2 and "give a prefix" in usage.output and "Traceback" not in usage.output
    )


# ---------------------------------------------------------------- no server needed


def test_store_errors_cross_ranks_with_their_fields():
    from ckptguard.errors import error_payload, rebuild

    for exc in (
        ObjectStoreError("put failed", bucket="b", key="run/k", step=3, status=503),
        ConditionalWriteUnsupportedError("ignored", bucket="b", key="run/.probe"),
        CommitConflictError("taken", step=4),
    ):
        back = rebuild(error_payload(exc))
        assert type(back) is type(exc) and str(back) == str(exc)
        assert {n: getattr(back, n) for n in type(exc).fields} == {
            n: getattr(exc, n) for n in type(exc).fields
        }


@pytest.mark.parametrize(
    "url",
    [
        "/local/path",
        "s3://",
        "s3://Bad_Bucket/x",
        "s3://bucket",
        "s3://bucket/",
        "s3://bucket/a/../b",
        "s3://bucket/a//b",
    ],
)
def test_a_bad_url_is_refused_naming_the_fix(url):
    from ckptguard.storage.s3 import StoreURL

    with pytest.raises(ConfigError, match="s3://"):
        StoreURL.parse(url)


def test_a_manager_on_a_bad_s3_root_or_with_a_policy_a_store_cannot_follow_is_refused(tmp_path):
    """``CheckpointManager(url)`` checks its object-store root and options as it is made, before any
    request."""
    with pytest.raises(ConfigError, match="give a prefix such as s3://bucket/runs/run1"):
        cg.CheckpointManager("s3://bucket")
    with pytest.raises(
        ConfigError, match=r"StorageOptions\.object_store must be an ObjectStoreOptions"
    ):
        cg.StorageOptions(object_store={"endpoint_url": "http://x"})
    coalesce = h.config(
        None,
        tmp_path / "s",
        base=cg.CheckpointConfig(async_save=cg.AsyncOptions(on_busy=cg.OnBusy.COALESCE)),
    )
    with pytest.raises(
        ConfigError, match=r"CheckpointManager\('s3://bucket/run'\).*OnBusy.SKIP, OnBusy.WAIT"
    ):
        cg.CheckpointManager("s3://bucket/run", config=coalesce)
    assert not (tmp_path / "s").exists()


def test_without_boto3_a_directory_root_works_and_an_s3_root_names_the_extra(tmp_path):
    """``import ckptguard`` and a directory root never need boto3; an s3:// root without it is
    refused when the manager is made, naming the extra (not a ModuleNotFoundError at the first
    upload)."""
    script = f"""
import sys
class NoBoto:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("boto3", "botocore"):
            raise ModuleNotFoundError(f"No module named {{name!r}}")
sys.meta_path.insert(0, NoBoto())
import ckptguard as cg
cfg = cg.CheckpointConfig(storage=cg.StorageOptions(object_store=cg.ObjectStoreOptions(threads=2)))
assert cg.CheckpointManager({str(tmp_path / "d")!r}, config=cfg).save(1, {{"n": 1}}) is not None
try:
    cg.CheckpointManager("s3://bucket/run")
except cg.ConfigError as exc:
    print("refused:", exc)
assert "boto3" not in sys.modules
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "refused: s3://bucket/run: an object-store root needs the s3 extra" in out.stdout, (
        out.stdout
    )
    assert "pip install 'ckptguard[s3]'" in out.stdout


def test_the_staging_root_defaults_to_a_node_local_directory_named_by_the_store(
    tmp_path, monkeypatch
):
    import tempfile

    from ckptguard._core.rootstage import local_root

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    default = local_root("s3://bucket/runs/one", cg.CheckpointConfig())
    assert default.relative_to(tmp_path).parts[0] == f"ckptguard-staging-{os.getuid()}", default
    assert default.parts[-3:] == ("bucket", "runs", "one"), default
    other = cg.CheckpointConfig(
        storage=cg.StorageOptions(
            object_store=cg.ObjectStoreOptions(endpoint_url="http://other:9000")
        )
    )
    assert local_root("s3://bucket/runs/one", other) != default, (
        "another endpoint: another staging root"
    )
    given = cg.CheckpointConfig(storage=cg.StorageOptions(object_staging="rel/stage"))
    assert local_root("s3://bucket/runs/one", given) == Path("rel/stage").absolute()
    assert (
        local_root(tmp_path / "disk", given) == tmp_path / "disk"
    )  # a directory root is its own local root


def test_prefer_verified_is_refused_on_a_store_root(moto, tmp_path):
    url = f"s3://{bucket(moto)}/run"
    verified = cg.CheckpointConfig(timeout_s=60.0, health=cg.HealthPolicy(prefer="verified"))
    ckpt = cg.CheckpointManager(url, config=h.config(moto, tmp_path / "a", base=verified))
    ckpt.save(1, h.state_at(1))
    with pytest.raises(
        ConfigError, match="prefer='verified' is not supported on an object-store root"
    ):
        ckpt.restore(h.blank())
    ckpt.close()


def test_bad_options_are_refused_naming_the_field():
    from ckptguard import ObjectStoreOptions

    for kw, field in (
        ({"part_bytes": 1 << 20}, "part_bytes"),
        ({"max_inflight_bytes": 1}, "max_inflight_bytes"),
        ({"threads": 0}, "threads"),
        ({"consistency": "none"}, "consistency"),
        ({"read_timeout_s": 0}, "read_timeout_s"),
    ):
        with pytest.raises(ConfigError, match=field):
            ObjectStoreOptions(**kw)
    assert (
        ObjectStoreOptions(part_bytes=8 << 20, max_inflight_bytes=20 << 20, threads=8).workers == 2
    )


def test_a_job_refused_by_the_stores_lease_changes_nothing_and_break_lease_reaches_the_store(
    moto, tmp_path
):
    from ckptguard.errors import LeaseHeldError

    name = bucket(moto)
    url = f"s3://{name}/leased"
    first = h.root(url, tmp_path / "a", moto)
    first.save(1, h.state_at(1))  # the first job holds the store's lease from now on
    second = h.root(url, tmp_path / "b", moto)
    with pytest.raises(LeaseHeldError):
        second.save(2, h.state_at(2))
    assert not (tmp_path / "b").exists() or not any(
        (tmp_path / "b").iterdir()
    )  # refused before staging
    with pytest.raises(LeaseHeldError):
        second.restore(h.blank())
    assert second.restore(h.blank(), break_lease=True) == 1
    assert second.save(2, h.state_at(2), break_lease=True) is not None
    assert second.resolve().url == f"{url}/step_00000002/manifest.json"
    second.close()
    first.close()
    assert restored_step(moto, url, tmp_path / "c") == 2


def test_save_async_commits_staging_then_store_in_the_background_a_failed_publish_raises(
    moto, tmp_path
):
    """The store door's one shape: ``save_async`` returns a pending commit whose ``wait()`` is the
    staging directory once the store committed the step too; ``resolve`` a ``Resolution`` naming the
    marker; a publish that fails in the background is raised by ``wait()`` (once), the store's
    tracker stays, and the next save of that step replaces the staging copy the store never
    committed."""
    name = bucket(moto)
    url = f"s3://{name}/async"
    staging = (tmp_path / "stage").absolute()
    ckpt = h.root(url, staging, moto)
    pending = ckpt.save_async(1, h.state_at(1))
    assert isinstance(pending, cg.PendingCommit) and pending.step == 1
    assert pending.wait() == staging / "step_00000001"
    assert (
        ckpt.wait() == staging / "step_00000001"
    )  # as CheckpointManager.wait: the last pending save's
    res = ckpt.resolve()
    assert (
        isinstance(res, cg.Resolution) and res.step == 1 and res.path == staging / "step_00000001"
    )
    assert res.url == f"{url}/step_00000001/manifest.json" and url in res.describe()

    def refuse() -> None:
        raise ObjectStoreError(
            "injected: the store refused the marker", bucket=name, key="k", step=2
        )

    set_fault_hook("store.before_marker", refuse)
    try:
        failing = ckpt.save_async(2, h.state_at(2))
        assert failing is not None
        with pytest.raises(ObjectStoreError, match="injected"):
            ckpt.wait()
    finally:
        set_fault_hook("store.before_marker", None)
    assert failing.done() and ckpt.wait() is None  # raised once
    store = ObjectStore(url, h.options(moto))
    assert store.tracker()[0] == 1 and store.committed_steps() == [
        1
    ]  # the staging root holds 2; the store never did
    assert (
        ckpt.save(2, h.state_at(2)) == staging / "step_00000002"
    )  # replaces the uncommitted staging copy
    assert ckpt.resolve().step == 2 and store.committed_steps() == [1, 2]
    fresh = h.blank()
    assert ckpt.restore(fresh) == 2 and torch.equal(fresh["model"].w, h.values_at(2))
    ckpt.close()


def test_a_staging_step_that_is_a_symlink_is_refused_and_what_it_points_to_is_untouched(
    moto, tmp_path
):
    """A restore that finds the staging copy of its step differing from the store's clears it first:
    through a symlink that would uncommit another root's step (its manifest deleted), outside the
    staging root."""
    from ckptguard.errors import UnsafeCheckpointError

    name = bucket(moto)
    url = f"s3://{name}/runs/linked"
    ckpt = h.root(url, tmp_path / "stage", moto)
    ckpt.save(1, h.state_at(1))
    ckpt.close()
    other = cg.CheckpointManager(tmp_path / "other")
    other.save(1, h.state_at(2))  # another root's committed step of the same name, other bytes
    other.close()
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    # a staging root of this store (claimed), into which a link was planted
    record = "ckptguard-staging.json"
    (fresh / record).write_bytes((tmp_path / "stage" / record).read_bytes())
    (fresh / "step_00000001").symlink_to(tmp_path / "other" / "step_00000001")
    ckpt = h.root(url, fresh, moto)
    with pytest.raises(UnsafeCheckpointError, match="symlink"):
        ckpt.restore(h.blank())
    ckpt.close()
    assert (tmp_path / "other" / "step_00000001" / "manifest.json").is_file()


def test_an_existing_root_as_staging_root_is_refused_at_the_first_save_and_keeps_its_steps(
    moto, tmp_path
):
    """Review finding: KeepLast(1) of the staging root deleted the steps of a root given as
    object_staging."""
    victim = tmp_path / "old-run"
    old = cg.CheckpointManager(victim)
    for step in (1, 2, 3):
        old.save(step, h.state_at(step))
    old.close()
    before = sorted(os.listdir(victim))
    ckpt = h.root(f"s3://{bucket(moto)}/run", victim, moto)
    with pytest.raises(cg.ConfigError, match="is not a staging root"):
        ckpt.save(10, h.state_at(10))
    ckpt.close()
    assert sorted(os.listdir(victim)) == before


@pytest.mark.parametrize("readable_later", [True, False], ids=["read-again", "still-unreadable"])
def test_a_long_runs_proof_log_is_read_past_16_mib_and_never_replaced_by_one_that_lacks_it(
    moto, tmp_path, monkeypatch, readable_later
):
    """Review finding: a store's proof log over 16 MiB could not be read back, and after a lost node
    the next save replaced it with the new node's few records (the killed run's evidence gone)."""
    url = f"s3://{bucket(moto)}/run"
    ckpt = h.root(url, tmp_path / "node1", moto)
    ckpt.save(1, h.state_at(1))
    ckpt.close()
    store = ObjectStore(url, h.options(moto))
    name = "rank_00000.jsonl"
    long_log = store.get_proof(name) + b'{"event": "step", "pad": "' + b"x" * (17 << 20) + b'"}\n'
    store.put_proof(name, long_log)
    assert store.get_proof(name) == long_log, "a 17 MiB proof log reads back whole"
    real = ObjectStore.get_proof
    fails = {"left": 1 if readable_later else 10**6}

    def flaky(self, proof_name):
        if fails["left"] > 0:
            fails["left"] -= 1
            raise ObjectStoreError("the store did not answer (test)", bucket="b", key="k")
        return real(self, proof_name)

    monkeypatch.setattr(ObjectStore, "get_proof", flaky)
    lost = h.root(url, tmp_path / "node2", moto)  # a new node: its staging root has no proof log
    assert lost.restore(h.blank()) == 1
    lost.save(2, h.state_at(2))
    lost.close()
    monkeypatch.setattr(ObjectStore, "get_proof", real)
    now = store.get_proof(name)
    if readable_later:
        assert now.startswith(long_log) and len(now) > len(long_log), (
            "the killed run's records, then the new ones"
        )
    else:
        assert now == long_log, "a store copy that could not be read is never replaced"


def test_a_read_that_cannot_reach_the_store_says_run_it_again_and_a_save_says_save_again():
    """Review finding: list, verify, gc and prove on an unreachable store told the operator to "save
    again"."""
    from ckptguard.storage.s3._bucket import _READS, _hint

    assert all(
        doing.startswith(_READS) for doing in ("reading the tracker", "listing", "downloading")
    )
    read = _hint("EndpointConnectionError", None, "http://127.0.0.1:1", reading=True)
    assert "run the same again" in read and "save again" not in read and "marker" not in read
    assert "save again" in _hint("EndpointConnectionError", None, "http://127.0.0.1:1")
