"""A wrong or hostile object-store root, against a moto server on 127.0.0.1: every size a marker
declares is checked against the object itself before anything is allocated or requested, the first
failure stops a download, and a crafted record ends in a ckptguard error naming the object (never a
bare OSError, OverflowError or RecursionError)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

boto3 = pytest.importorskip("boto3", reason="the s3 extra (boto3) is not installed")
moto_server = pytest.importorskip("moto.server", reason="moto[server] (dev extra) is not installed")

import objstore_helper as h  # noqa: E402
from ckptguard._commit import storelease, storepublish  # noqa: E402
from ckptguard._resume.storefetch import resolve  # noqa: E402
from ckptguard.errors import (  # noqa: E402
    CheckpointCorruptError,
    CheckpointError,
    ObjectStoreError,
    ResumeError,
)
from ckptguard.storage.s3 import ObjectStore, _transfer  # noqa: E402

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
TIB = 1 << 40


@pytest.fixture(scope="module")
def moto():
    with h.moto_endpoint() as endpoint:
        yield endpoint


_n = iter(range(10**6))


@pytest.fixture(scope="module")
def saved(moto, tmp_path_factory):
    """A root with step 1 committed (its state: 6 MiB, two 5 MiB parts), and the marker's bytes."""
    name = f"hostile-{os.getpid()}"
    boto3.client("s3", endpoint_url=moto).create_bucket(Bucket=name)
    url = f"s3://{name}/run"
    ckpt = h.root(url, tmp_path_factory.mktemp("w"), moto)
    ckpt.save(1, h.state_at(1))
    ckpt.close()
    key = "run/step_00000001/manifest.json"
    return (
        url,
        name,
        key,
        boto3.client("s3", endpoint_url=moto).get_object(Bucket=name, Key=key)["Body"].read(),
    )


def _put_marker(moto: str, name: str, key: str, data: bytes) -> None:
    boto3.client("s3", endpoint_url=moto).put_object(Bucket=name, Key=key, Body=data)


def _biggest(marker: dict) -> str:
    return max(marker["objects"], key=lambda rel: marker["objects"][rel]["size"])


def _restore(moto: str, url: str, staging: Path) -> int:
    ckpt = h.root(url, staging, moto)
    try:
        return ckpt.restore(h.blank())
    finally:
        ckpt.close()


def _largest_file(root: Path) -> int:
    return max((p.stat().st_size for p in root.rglob("*") if p.is_file()), default=0)


@pytest.fixture
def marker(moto, saved):
    """The committed marker, parsed; put back as it was after the test."""
    _, name, key, data = saved
    yield json.loads(data)
    _put_marker(moto, name, key, data)


def test_a_marker_declaring_1_TiB_is_refused_in_seconds_naming_the_object(
    moto, saved, marker, tmp_path
):
    url, name, key, _ = saved
    rel = _biggest(marker)
    marker["objects"][rel]["size"] = TIB  # and its manifest agrees: only the object itself can tell
    for f in marker["manifest"]["files"]:
        if f["path"] == rel:
            f["size"] = TIB
    _put_marker(moto, name, key, json.dumps(marker).encode())
    started = time.monotonic()
    with pytest.raises(CheckpointCorruptError) as err:
        _restore(moto, url, tmp_path / "s")
    took = time.monotonic() - started
    print(f"a marker declaring 1 TiB refused in {took:.2f} s: {str(err.value)[:160]}")
    assert took < 5, f"refused after {took:.1f} s"
    assert f"s3://{name}/run/step_00000001/{marker['attempt']}/{rel}" in str(err.value)
    assert f"declares {TIB} bytes, the object has" in str(err.value)
    assert (
        _largest_file(tmp_path / "s") < 1 << 20
    )  # no 1 TiB sparse file, no part of the object fetched


@pytest.mark.parametrize("size", [-1, 6 << 40, 2**70, "17", True, 1.5, None])
def test_a_size_that_is_no_size_is_refused_naming_the_object(moto, saved, marker, tmp_path, size):
    url, name, key, _ = saved
    rel = _biggest(marker)
    marker["objects"][rel]["size"] = size
    _put_marker(moto, name, key, json.dumps(marker).encode())
    with pytest.raises(CheckpointError) as err:
        _restore(moto, url, tmp_path / "s")
    assert f"object {rel!r} declares size {size!r}" in str(err.value) and key in str(err.value)
    assert _largest_file(tmp_path / "s") < 1 << 20


def test_a_marker_whose_object_and_manifest_disagree_is_refused_before_any_request(
    moto, saved, marker, tmp_path
):
    url, name, key, _ = saved
    rel = _biggest(marker)
    marker["objects"][rel]["size"] -= 1
    _put_marker(moto, name, key, json.dumps(marker).encode())
    with pytest.raises(CheckpointCorruptError, match="its manifest says") as err:
        _restore(moto, url, tmp_path / "s")
    assert rel in str(err.value) and "nothing was downloaded" in str(err.value)


@pytest.mark.parametrize("where", ["whole", "manifest", "writer", "created_unix"])
def test_crafted_marker_json_is_a_ckptguard_error_naming_the_marker(
    moto, saved, marker, tmp_path, where
):
    url, name, key, _ = saved
    deep = 200_000
    if where == "whole":
        data = ('{"a":' * deep + "1" + "}" * deep).encode()
    else:
        value = {
            "manifest": json.loads('{"x":' * 500 + "1" + "}" * 500),
            "writer": {"host": "h", "pid": "x"},
            "created_unix": 10**400,
        }[where]
        marker[where] = value
        data = (
            json.dumps(marker).encode()
            if where != "created_unix"
            else json.dumps({**marker, where: 0})
            .encode()
            .replace(b'"created_unix": 0', b'"created_unix": 1' + b"0" * 400)
        )
    _put_marker(moto, name, key, data)
    with pytest.raises(CheckpointError) as err:
        _restore(moto, url, tmp_path / "s")
    assert key in str(err.value), str(err.value)
    assert not isinstance(
        err.value.__cause__, (RecursionError, OverflowError, ValueError)
    ) or isinstance(err.value.__cause__, CheckpointError)


def test_the_first_failure_stops_the_download(moto, saved, tmp_path, monkeypatch):
    url, name, _, _ = saved
    store = ObjectStore(url, h.options(moto))
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(40 << 20))  # eight 5 MiB spans
    attempt = storepublish.begin(store, 2)
    etag = store.upload(2, attempt, [("state/big.bin", big, big.stat().st_size)])["state/big.bin"]
    item = _transfer.Incoming(
        store.url.key("step_00000002", attempt, "state/big.bin"),
        tmp_path / "d" / "big.bin",
        big.stat().st_size,
        etag,
        "0",
    )
    calls: list[int] = []
    real = _transfer._get_span

    def failing(bucket, it, fd, offset, length, step):
        calls.append(offset)
        if offset == 0:
            raise ObjectStoreError("the first span failed", bucket=name, key=it.key, step=step)
        time.sleep(0.2)
        return real(bucket, it, fd, offset, length, step)

    monkeypatch.setattr(_transfer, "_get_span", failing)
    with pytest.raises(ObjectStoreError, match="the first span failed"):
        _transfer.download(store.bucket, [item], step=2)
    assert len(calls) <= store.options.workers, (
        calls
    )  # the spans not started yet were never requested
    assert not list((tmp_path / "d").iterdir())  # the temp file went with the failure

    stale = _transfer.Incoming(
        item.key, item.path, item.size, '"0123"', "0"
    )  # replaced since its commit
    calls.clear()
    with pytest.raises(ObjectStoreError, match="was replaced after its step was committed"):
        _transfer.download(store.bucket, [stale], step=2)
    assert calls == []  # refused by HEAD: not one range request


# ---------------------------------------------------------------- gc, verify, conditional writes


def _bucket(moto: str) -> str:
    name = f"hostile-{os.getpid()}-{next(_n)}"
    boto3.client("s3", endpoint_url=moto).create_bucket(Bucket=name)
    return name


def _keys(moto: str, name: str) -> list[str]:
    pages = (
        boto3.client("s3", endpoint_url=moto).get_paginator("list_objects_v2").paginate(Bucket=name)
    )
    return sorted(o["Key"] for page in pages for o in page.get("Contents") or [])


def test_gc_keeps_the_tracker_steps_data_when_its_marker_is_gone(moto, tmp_path):
    from click.testing import CliRunner

    from ckptguard.cli import main

    name = _bucket(moto)
    url = f"s3://{name}/run"
    h.write(moto, url, str(tmp_path / "w"), 2, None)
    boto3.client("s3", endpoint_url=moto).delete_object(
        Bucket=name, Key="run/step_00000002/manifest.json"
    )
    store = ObjectStore(url, h.options(moto))
    with pytest.raises(CheckpointError, match="restore the objects"):
        resolve(store)  # what the operator is told
    before = [k for k in _keys(moto, name) if "step_00000002/" in k]
    assert before
    result = CliRunner().invoke(main, ["gc", "--min-age", "0", url])
    assert result.exit_code == 1, result.output
    assert (
        "gc refused" in result.output
        and f"{url}/step_00000002/manifest.json does not exist" in result.output
    )
    assert "Traceback" not in result.output
    assert [
        k for k in _keys(moto, name) if "step_00000002/" in k
    ] == before  # every object of step 2 is there
    with pytest.raises(CheckpointCorruptError, match="gc refused"):
        h.gc(store, dry_run=True)


def test_markers_without_a_tracker_are_refused_as_on_a_directory_never_a_fresh_start(
    moto, tmp_path
):
    """The resume rule is one for every root: steps committed under a root whose tracker is gone
    were a fresh start on the store (the old rule read the tracker only) and are a ResumeError on a
    directory."""
    name = _bucket(moto)
    url = f"s3://{name}/run"
    h.write(moto, url, str(tmp_path / "w"), 2, None)
    boto3.client("s3", endpoint_url=moto).delete_object(
        Bucket=name, Key="run/latest_checkpointed_iteration.txt"
    )
    with pytest.raises(ResumeError, match=r"holds steps \[(1, )?2\] but no tracker"):
        resolve(ObjectStore(url, h.options(moto)))


def test_markers_without_a_root_record_or_a_tracker_are_refused_never_a_fresh_start(moto, tmp_path):
    """Both records of the root gone, its markers left: a damaged root, not a new one (the old rule,
    which read only the tracker and the root record, started fresh and the next save replaced a
    committed step)."""
    name = _bucket(moto)
    url = f"s3://{name}/run"
    h.write(moto, url, str(tmp_path / "w"), 2, None)
    client = boto3.client("s3", endpoint_url=moto)
    for key in ("run/latest_checkpointed_iteration.txt", "run/ckptguard-root.json"):
        client.delete_object(Bucket=name, Key=key)
    store = ObjectStore(url, h.options(moto))
    assert not store.has_root() and store.tracker()[0] is None
    with pytest.raises(ResumeError, match=r"holds steps \[(1, )?2\] but no tracker"):
        resolve(store)


@pytest.mark.parametrize("what", ["typo", "tracker deleted"])
def test_verify_of_a_root_with_nothing_there_is_an_error_naming_the_path(moto, tmp_path, what):
    from click.testing import CliRunner

    from ckptguard.cli import main

    name = _bucket(moto)
    url = f"s3://{name}/run"
    h.write(moto, url, str(tmp_path / "w"), 1, None)
    if what == "tracker deleted":
        boto3.client("s3", endpoint_url=moto).delete_object(
            Bucket=name, Key="run/latest_checkpointed_iteration.txt"
        )
    target = f"s3://{name}/typo" if what == "typo" else url
    result = CliRunner().invoke(main, ["verify", target])
    assert result.exit_code == 1, result.output
    assert "OK" not in result.output and "Traceback" not in result.output
    assert (
        f"no checkpoint root at {target}"
        if what == "typo"
        else f"{url}/latest_checkpointed_iteration.txt"
    ) in result.output
    ok = CliRunner().invoke(main, ["verify", url] if what == "typo" else ["verify", url, "--json"])
    assert (ok.exit_code, "OK: 1 step(s) checked" in ok.output) == (
        (0, True) if what == "typo" else (1, False)
    )


def test_a_store_that_honours_conditions_for_the_probe_only_never_lets_two_writers_commit_one_step(
    moto, tmp_path
):
    from ckptguard.errors import CommitConflictError, ConditionalWriteUnsupportedError
    from ckptguard.storage.s3 import StoredObject

    name = _bucket(moto)
    url = f"s3://{name}/run"
    proxy = h.Proxy(
        int(moto.rsplit(":", 1)[1]), strip_only="manifest.json"
    )  # markers' keys only: the probe passes
    try:
        writers = [ObjectStore(url, h.options(proxy.endpoint)) for _ in range(2)]
        data = tmp_path / "data.bin"
        data.write_bytes(os.urandom(4096))
        writers[0].ensure_root()
        attempts = [storepublish.begin(w, 3) for w in writers]
        etags = [
            w.upload(3, a, [("state/data.bin", data, 4096)])["state/data.bin"]
            for w, a in zip(writers, attempts, strict=True)
        ]
        outcomes = []
        for role, (w, a, e) in enumerate(zip(writers, attempts, etags, strict=True)):
            try:
                storepublish.commit(
                    w, 3, a, {"state/data.bin": StoredObject(4096, "0", e)}, {"role": role}
                )
                outcomes.append("won")
            except (ConditionalWriteUnsupportedError, CommitConflictError) as exc:
                outcomes.append(f"{type(exc).__name__}: {exc}")
    finally:
        proxy.stop()
    assert outcomes.count("won") <= 1, outcomes
    # The first to commit creates its marker and finds the store does not refuse the same create
    # again; the second finds that marker newer than the tracker and, holding no lease, never
    # replaces it.
    assert "run/step_00000003/manifest.json" in outcomes[0] and "If-None-Match" in outcomes[0], (
        outcomes
    )
    assert (
        outcomes[1].startswith("CommitConflictError")
        and "marker newer than the tracker" in outcomes[1]
    )
    store = ObjectStore(url, h.options(moto))
    assert (
        store.tracker()[0] == 0 and resolve(store).step == 0
    )  # nothing committed: the tracker did not move


@pytest.mark.parametrize("first", [True, False])
def test_a_store_that_ignores_conditions_on_the_lease_never_lets_a_job_believe_it_holds_it(
    moto, tmp_path, first
):
    from ckptguard.errors import ConditionalWriteUnsupportedError

    name = _bucket(moto)
    url = f"s3://{name}/run"
    # a lease there already (an earlier job's, released): this job's renewal is an If-Match replace
    if not first:
        earlier = ObjectStore(url, h.options(moto))
        earlier.ensure_root()
        storelease.acquire(earlier, "earlier-job")
        storelease.release(earlier, "earlier-job")
    proxy = h.Proxy(int(moto.rsplit(":", 1)[1]), strip_only="lease.json")
    try:
        store = ObjectStore(url, h.options(proxy.endpoint))
        store.ensure_root()  # the probe passes: its key keeps its conditions
        with pytest.raises(
            ConditionalWriteUnsupportedError, match="two jobs could both hold the write lease"
        ) as err:
            storelease.acquire(store, "this-job")
        assert err.value.key == "run/lease.json" and (
            "If-None-Match" if first else "stale If-Match"
        ) in str(err.value)
    finally:
        proxy.stop()
    storelease.acquire(
        ObjectStore(url, h.options(moto)), "honest-store"
    )  # through an honest path it is taken once


def test_verify_names_a_committed_step_whose_marker_is_unreadable(moto, tmp_path):
    from click.testing import CliRunner

    from ckptguard.cli import main

    name = _bucket(moto)
    url = f"s3://{name}/run"
    h.write(moto, url, str(tmp_path / "w"), 2, None)
    _put_marker(
        moto,
        name,
        "run/step_00000001/manifest.json",
        b'{"kind": "ckptguard-objectstore-step", "format": 1}',
    )
    result = CliRunner().invoke(main, ["verify", url, "--json"])
    assert result.exit_code == 1, result.output
    findings = json.loads(result.output)["findings"]
    assert [(f["code"], f["path"]) for f in findings] == [
        ("marker-unreadable", f"{url}/step_00000001/manifest.json")
    ]


class _Headed:
    """A bucket whose HEAD answers with a given ETag spelling (stores quote it in one reply and not
    another)."""

    def __init__(self, etag: str) -> None:
        self.etag = etag
        self.url = type("U", (), {"bucket": "b"})()

    def head(self, key, *, step=None, what="object"):
        return 17, self.etag


@pytest.mark.parametrize("spelling", ['"0123abcd"', "0123abcd", 'W/"0123abcd"'])
def test_an_etag_quoted_differently_by_head_is_the_same_etag(spelling, tmp_path):
    from ckptguard.storage.s3._transfer import Incoming, _head

    _head(_Headed(spelling), Incoming("k", tmp_path / "k", 17, '"0123abcd"', "x"), 3)  # no error


def test_another_etag_is_still_refused_as_replaced(tmp_path):
    from ckptguard.storage.s3._transfer import Incoming, _head

    with pytest.raises(ObjectStoreError, match="was replaced after its step was committed"):
        _head(_Headed('"ffff"'), Incoming("k", tmp_path / "k", 17, '"0123abcd"', "x"), 3)
