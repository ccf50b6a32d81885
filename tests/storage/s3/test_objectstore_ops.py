"""The operator commands on object-store roots: preflight, gc, transfer (both directions) and prove
on ``s3://`` roots, against one moto server started for the module on 127.0.0.1 (as in
tests/storage/s3/test_objectstore.py); every other command refuses an ``s3://`` argument by name.

Each command: ``--json``, an error naming bucket/key/step, exit 1 (refused) or 2 (bad usage), never
a traceback. Transfers killed (SIGKILL, in a subprocess) before the marker, between marker and
tracker, and before the local rename leave nothing visible, and the same transfer run again
finishes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

boto3 = pytest.importorskip("boto3", reason="the s3 extra (boto3) is not installed")
moto_server = pytest.importorskip("moto.server", reason="moto[server] (dev extra) is not installed")

from click.testing import CliRunner  # noqa: E402

import ckptguard as cg  # noqa: E402
import objstore_helper as h  # noqa: E402
from ckptguard._commit import storelease, storepublish  # noqa: E402
from ckptguard._resume.storefetch import resolve  # noqa: E402
from ckptguard.cli import main  # noqa: E402
from ckptguard.storage.s3 import ObjectStore  # noqa: E402

HELPER = str(Path(__file__).parents[2] / "objstore_helper.py")
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def moto():
    with h.moto_endpoint() as endpoint:
        yield endpoint


_n = iter(range(10**6))


def bucket(endpoint: str) -> str:
    name = f"ops-{os.getpid()}-{next(_n)}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=name)
    return name


def keys(endpoint: str, name: str) -> list[str]:
    pages = (
        boto3.client("s3", endpoint_url=endpoint)
        .get_paginator("list_objects_v2")
        .paginate(Bucket=name)
    )
    return sorted(o["Key"] for page in pages for o in page.get("Contents") or [])


def cli(*args: str) -> tuple[int, str]:
    out = CliRunner().invoke(main, list(args))
    assert "Traceback" not in out.output, out.output
    return out.exit_code, out.output


def cli_json(*args: str) -> tuple[int, dict]:
    code, output = cli(*args, "--json")
    return code, json.loads(output.strip().splitlines()[-1])


def local_root(root: Path, steps: int) -> Path:
    mgr = cg.CheckpointManager(root, config=h.config())
    for step in range(1, steps + 1):
        mgr.save(step, h.state_at(step))
    mgr.close()
    return root


def restores_exactly(root: Path) -> int:
    mgr = cg.CheckpointManager(root, config=h.config())
    state = h.blank()
    step = mgr.restore(state)
    mgr.close()
    assert torch.equal(state["model"].w.detach(), h.values_at(step)) and state["counter"] == {
        "step": step
    }
    return step


def store_restores_exactly(endpoint: str, url: str, staging: Path) -> int:
    ckpt = h.root(url, staging, endpoint)
    state = h.blank()
    step = ckpt.restore(state)
    ckpt.close()
    assert torch.equal(state["model"].w.detach(), h.values_at(step)) and state["counter"] == {
        "step": step
    }
    return step


def killed_cli(point: str, *args: str) -> int:
    """``ckptguard ARGS`` in its own process, SIGKILLed at the fault point ``point``."""
    code = (
        "import sys; from ckptguard.testing import kill_at; kill_at(sys.argv[1]); from "
        "ckptguard.cli import main; sys.argv = ['ckptguard', *sys.argv[2:]]; main()"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, point, *args],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    return proc.returncode


# ---------------------------------------------------------------- preflight


def test_preflight_an_s3_root(moto, tmp_path):
    name = bucket(moto)
    url = f"s3://{name}/run"
    code, got = cli_json("preflight", url)
    assert (
        code == 1
        and [f["code"] for f in got["findings"]] == ["no-root"]
        and name in got["findings"][0]["path"]
    )
    h.write(moto, url, str(tmp_path / "w"), 2, None)
    code, got = cli_json("preflight", url)
    assert (
        code == 0
        and got["ok"]
        and got["step"] == 2
        and got["path"] == f"{url}/step_00000002/manifest.json"
    )
    code, output = cli("preflight", url, "--expect-step", "1")
    assert code == 1 and "expect-step" in output and "NOT READY" in output
    live = h.root(url, tmp_path / "live", moto)
    live.restore(h.blank())
    live.save(
        3, h.state_at(3)
    )  # holds the lease: a launch now would be refused; said, not an error
    code, got = cli_json("preflight", url)
    assert code == 0 and [f["code"] for f in got["findings"]] == ["lease-held"], got
    live.close()
    victim = next(k for k in keys(moto, name) if "step_00000003/a-" in k and k.endswith(".distcp"))
    boto3.client("s3", endpoint_url=moto).delete_object(
        Bucket=name, Key=victim
    )  # the negative control
    code, got = cli_json("preflight", url)
    assert (
        code == 1
        and [f["code"] for f in got["findings"]] == ["missing-object"]
        and victim in got["findings"][0]["path"]
    )
    hosts = tmp_path / "hosts"
    hosts.write_text("a\n")
    code, output = cli("preflight", url, "--hosts", str(hosts))
    assert code == 2 and "every rank downloads" in output


# ---------------------------------------------------------------- gc


def test_gc_an_s3_root(moto, tmp_path):
    name = bucket(moto)
    url = f"s3://{name}/run"
    h.write(moto, url, str(tmp_path / "w"), 1, None)
    store = ObjectStore(url, h.options(moto))
    data = tmp_path / "d.bin"
    data.write_bytes(b"q" * 10)
    attempt = storepublish.begin(store, 2)
    store.upload(2, attempt, [("state/d.bin", data, 10)])  # an interrupted save: no marker
    # This process wrote it and still runs: kept, however old (a live save's attempt).
    live = f"{url}/step_00000002/{attempt}"
    code, got = cli_json("gc", url, "--min-age", "0")
    assert code == 0 and [k["path"] for k in got["kept"]] == [live] and got["removed"] == [], got
    assert "its writer may still write" in got["kept"][0]["why"]
    # Its owner record names a process of this host's name that is not running here: still kept
    # while young (a writer in another PID namespace of a host of the same name looks dead from here
    # while it uploads).
    h.rewrite_owner(moto, url, 2, attempt, host=socket.gethostname(), pid=h.dead_pid())
    code, got = cli_json("gc", url, "--dry-run")
    assert code == 0 and [k["path"] for k in got["kept"]] == [live], got
    code, got = cli_json(
        "gc", url, "--min-age", "0", "--dry-run"
    )  # past the age, and dead: removable
    assert code == 0 and [r["path"] for r in got["removed"]] == [live], got
    assert any(attempt in k for k in keys(moto, name))
    storelease.acquire(store, "a-live-job")  # a live job (this process) holds the lease: refused
    code, got = cli_json("gc", url, "--min-age", "0")
    assert code == 1 and "gc refused" in got["error"] and "--force" in got["error"]
    code, got = cli_json("gc", url, "--min-age", "0", "--force")
    assert code == 0 and [r["path"] for r in got["removed"]] == [live], got
    assert "(2 objects)" in got["removed"][0]["what"]
    assert not any(attempt in k for k in keys(moto, name))
    storelease.release(store, "a-live-job")
    assert store_restores_exactly(moto, url, tmp_path / "r") == 1
    code, output = cli("gc", url, "--orphans")
    assert code == 2 and "--orphans works on local roots" in output
    code, got = cli_json("gc", f"s3://{name}/not-a-root", "--min-age", "0")
    assert code == 2 and "not a ckptguard root" in got["error"]
    code, got = cli_json("gc", f"s3://no-such-bucket-{os.getpid()}/run")
    assert code == 1 and f"no-such-bucket-{os.getpid()}" in got["error"], got


# ---------------------------------------------------------------- transfer


def test_transfer_a_local_step_to_the_store_and_back_exactly(moto, tmp_path):
    name = bucket(moto)
    url = f"s3://{name}/run"
    src = local_root(tmp_path / "src", 2)
    held = ObjectStore(url, h.options(moto))
    held.ensure_root()
    storelease.acquire(
        held, "a-live-job"
    )  # a live job writes the store: the transfer is refused, nothing committed
    code, got = cli_json("transfer", str(src / "step_00000002"), url)
    assert code == 1 and "held by a-live-job" in got["error"] and held.tracker()[0] == 0
    storelease.release(held, "a-live-job")
    code, got = cli_json("transfer", str(src / "step_00000002"), url)
    assert (
        code == 0
        and got["step"] == 2
        and got["destination"] == f"{url}/step_00000002/manifest.json"
    ), got
    assert got["tracker_set_to"] == 2
    assert store_restores_exactly(moto, url, tmp_path / "staging") == 2
    code, got = cli_json(
        "transfer", str(src / "step_00000002"), url
    )  # the store's commit rules apply
    assert code == 1 and "already committed" in got["error"] and "step_00000002" in got["error"]
    code, got = cli_json("transfer", str(src / "step_00000001"), url)
    assert code == 1 and "older than the tracker (2)" in got["error"]
    code, got = cli_json("transfer", url, str(tmp_path / "dest"))
    assert code == 0 and got["step"] == 2, got
    assert got["step"] == 2 and got["destination"] == str(tmp_path / "dest" / "step_00000002")
    assert (
        json.loads(Path(got["record"]).read_text())["source"]
        == f"{url}/step_00000002/manifest.json"
    )
    assert restores_exactly(tmp_path / "dest") == 2
    code, output = cli("verify", str(tmp_path / "dest"), "--deep")
    assert code == 0, output
    code, got = cli_json("transfer", url, str(tmp_path / "dest2"), "--step", "1")
    assert code == 1 and "step 1" in got["error"] and "no marker" in got["error"]
    code, output = cli("transfer", url, f"s3://{name}/other")
    assert code == 2 and "transfer through a local root" in output
    code, got = cli_json("transfer", f"s3://{name}/empty", str(tmp_path / "dest3"))
    assert code == 2 and "no checkpoint root" in got["error"] and not (tmp_path / "dest3").exists()


@pytest.mark.parametrize("point", ["store.before_marker", "store.before_tracker"])
def test_a_transfer_to_the_store_killed_leaves_nothing_visible_and_runs_again(
    moto, tmp_path, point
):
    name = bucket(moto)
    url = f"s3://{name}/run"
    h.write(moto, url, str(tmp_path / "w"), 1, None)
    src = (
        tmp_path / "src"
    )  # the same run chain: the store's step 1 brought here, then step 2 saved after it
    assert cli_json("transfer", url, str(src))[0] == 0
    mgr = cg.CheckpointManager(src, config=h.config())
    assert mgr.restore(h.blank()) == 1
    mgr.save(2, h.state_at(2))
    mgr.close()
    killed_cli(point, "transfer", str(src / "step_00000002"), url)
    store = ObjectStore(url, h.options(moto))
    assert store.tracker()[0] == 1 and store.committed_steps() == [1] and resolve(store).step == 1
    assert (store.marker(2) is not None) == (
        point == "store.before_tracker"
    )  # an orphan: invisible to resolve
    code, got = cli_json("transfer", str(src / "step_00000002"), url)
    assert code == 0 and got["tracker_set_to"] == 2, got
    assert store_restores_exactly(moto, url, tmp_path / "staging") == 2
    code, got = cli_json("gc", url, "--min-age", "0")
    # the killed transfer's attempt (its orphan marker, if any, was replaced by the second
    # transfer's): gone
    removed = [r["path"][len(url) + 1 :].split("/")[0] for r in got["removed"]]
    assert code == 0 and removed == ["step_00000002"], got
    assert (
        store.committed_steps() == [1, 2]
        and store_restores_exactly(moto, url, tmp_path / "again") == 2
    )


def test_a_transfer_from_the_store_killed_before_its_rename_leaves_nothing_visible(moto, tmp_path):
    name = bucket(moto)
    url = f"s3://{name}/run"
    h.write(moto, url, str(tmp_path / "w"), 2, None)
    dest = local_root(tmp_path / "dest", 1)  # a root at step 1: the transfer must not disturb it
    code, _ = cli_json(
        "transfer", url, str(dest), "--step", "1"
    )  # another run chain: refused, untouched
    assert code == 2
    dest = tmp_path / "fresh"
    code, got = cli_json("transfer", url, str(dest), "--step", "1")
    assert code == 0 and got["tracker_set_to"] == 1
    killed_cli("transfer.before_rename", "transfer", url, str(dest))
    assert not (dest / "step_00000002").exists() and restores_exactly(dest) == 1
    assert [
        p.name for p in dest.iterdir() if p.name.startswith(".tmp-")
    ]  # the dead transfer's temp dir
    code, got = cli_json("gc", str(dest))
    assert code == 0 and any(".tmp-" in r["path"] for r in got["removed"]), json.dumps(
        got, indent=1
    )
    code, got = cli_json("transfer", url, str(dest))
    assert code == 0 and got["step"] == 2 and restores_exactly(dest) == 2


# ---------------------------------------------------------------- prove


def test_prove_reads_every_rank_s_records_from_the_store(moto, tmp_path):
    name = bucket(moto)
    url = f"s3://{name}/run"
    code, got = cli_json("prove", url)
    assert code == 1 and "holds no proof records" in got["error"]
    for last in (2, 3):  # a run saves 1..2, a second process resumes at 2 and saves 3
        proc = subprocess.run(
            [sys.executable, HELPER, "write", moto, url, str(tmp_path / f"s{last}"), str(last)],
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    code, got = cli_json("prove", url)
    gates = {g["gate"]: g for g in got["gates"]}
    assert gates["all PIDs changed"]["status"] == "PASS", gates["all PIDs changed"]
    assert gates["digests equal, item by item"]["status"] == "PASS", gates[
        "digests equal, item by item"
    ]
    code, output = cli("prove", url)
    assert "all PIDs changed" in output and "resume" in output.splitlines()[-1]


# ---------------------------------------------------------------- the commands that stay local


@pytest.mark.parametrize(
    "command",
    [["resolve"], ["hold", "{url}", "1"], ["status"], ["goodput"], ["adopt", "{url}", "1"]],
)
def test_a_command_that_reads_local_paths_refuses_an_s3_url_by_name(command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    url = "s3://bucket/run"
    args = [a.format(url=url) for a in command] + ([url] if len(command) == 1 else [])
    code, output = cli(*args)
    assert (
        code == 2 and "works on local paths only" in output and "list, verify, preflight" in output
    ), output
    assert list(tmp_path.iterdir()) == []  # nothing made at a local path named s3:


def test_verify_given_a_step_s_prefix_names_the_root_and_never_advises_a_tracker_there(
    moto, tmp_path
):
    """Review finding: `verify s3://bkt/run/step_00000001` advised setting a tracker by hand under
    the step."""
    name = bucket(moto)
    url = f"s3://{name}/run"
    h.write(moto, url, str(tmp_path / "w"), 1, None)
    code, output = cli("verify", f"{url}/step_00000001")
    assert (
        code == 1 and "names step 1 of the root" in output and f"ckptguard verify {url}`" in output
    ), output
    assert "set it by hand" not in output
