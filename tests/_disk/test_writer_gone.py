"""One rule for whether a writer is gone (``_disk.tempfiles.writer_gone``), judged alike for a
save's temp directory (its owner record), an atomic write's temp file (its name) and a lease's
holder: on this host the process decides however old its work (a PID now running another program is
gone); without the process's start time, or on another host, the age. Before, a temp directory whose
owner record had no start time was judged dead while its process ran. An object store's attempts
follow the same rule (tests/storage/s3/test_objectstore.py, test_objectstore_ops.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from ckptguard._disk import layout, tempfiles
from ckptguard._disk.lease import holder_gone
from ckptguard._disk.tempfiles import writer_gone
from liveproc import live_process

MAX_AGE_S = 3600.0


@pytest.fixture(scope="module")
def live():
    """A live process on this host besides the test's own: (pid, start time)."""
    with live_process() as found:
        yield found


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _temp_dir(tmp_path: Path, host: str, pid: int, start: str | None, age_s: float) -> str:
    path = tmp_path / ".tmp-step_00000003-0123456789ab"
    path.mkdir()
    (path / layout.OWNER_NAME).write_text(json.dumps({"host": host, "pid": pid, "start": start}))
    then = time.time() - age_s
    os.utime(path, (then, then))
    return layout.owner_state(path, max_age_s=MAX_AGE_S)


def _temp_file(tmp_path: Path, host: str, pid: int, start: str | None, age_s: float) -> str:
    tag = tempfiles._host_tag(host)
    path = tmp_path / f"latest_checkpointed_iteration.txt.tmp-{pid}.{start or 'x'}.{tag}-0123abcd"
    path.write_text("3\n")
    then = time.time() - age_s
    os.utime(path, (then, then))
    return tempfiles.owner_state(path, max_age_s=MAX_AGE_S)


# (case, host, pid, start, age in s) -> whether the writer is gone
CASES = {
    "live, old": ("here", "live", "live", 10 * MAX_AGE_S, False),
    "dead, young": ("here", "dead", "1", 0.0, True),
    "pid now another program": ("here", "live", "1", 0.0, True),
    "no start time, young": ("here", "live", None, 0.0, False),
    "no start time, old": ("here", "live", None, 10 * MAX_AGE_S, True),
    "another host, young": ("elsewhere", "self", "1", 0.0, False),
    "another host, old": ("elsewhere", "self", "1", 10 * MAX_AGE_S, True),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("what", ["temp dir", "temp file", "rule"])
def test_a_writer_is_gone_by_one_rule_for_every_record_of_it(tmp_path, live, case, what):
    where, who, start, age_s, gone = CASES[case]
    host = socket.gethostname() if where == "here" else "another-host-of-the-job"
    pid = {"live": live[0], "dead": _dead_pid(), "self": os.getpid()}[who]
    start = live[1] if start == "live" else start
    if what == "rule":
        verdict = writer_gone(host, pid, start, expired=age_s > MAX_AGE_S)
        assert (verdict is not None) == gone, verdict
        if who != "self":  # another process: a lease's holder is judged as any writer
            assert holder_gone(host, pid, start, expired=age_s > MAX_AGE_S) == verdict
        return
    state = (_temp_dir if what == "temp dir" else _temp_file)(tmp_path, host, pid, start, age_s)
    assert state == ("dead" if gone else "alive")


OTHER_NS = 4026532999  # a PID namespace's inode other than the host's own (0xEFFFFFFC) and ours


@pytest.mark.parametrize("what", ["temp dir", "temp file", "rule"])
def test_a_writer_in_another_pid_namespace_of_this_host_name_is_judged_by_age(
    tmp_path, monkeypatch, what
):
    """Two containers of one host name (with the host's network, say) number their processes
    apart: a PID read in one says nothing of a writer in the other, whose records are judged by
    age, as another host's. Before, a young temp directory of a live save in the other container
    looked dead here (its PID not running) and gc removed it; a lease's holder there was taken over.
    """
    monkeypatch.setattr(tempfiles, "_pid_ns", lambda: 4026532000)  # this test, in a container
    name = socket.gethostname()
    here = tempfiles.this_host()
    assert here == f"{name}#pidns4026532000"
    dead = _dead_pid()
    cases = [
        (f"{name}#pidns{OTHER_NS}", 0.0, False),  # another container of this host name, young
        (name, 0.0, False),  # the host's own namespace, young
        (f"{name}#pidns{OTHER_NS}", 10 * MAX_AGE_S, True),  # ... past the age: gone
        (here, 0.0, True),  # this namespace: the PID decides, at once
    ]
    for i, (host, age_s, gone) in enumerate(cases):
        if what == "rule":
            verdict = writer_gone(host, dead, "1", expired=age_s > MAX_AGE_S)
            assert (verdict is not None) == gone, (host, verdict)
            assert holder_gone(host, dead, "1", expired=age_s > MAX_AGE_S) == verdict
            continue
        (tmp_path / str(i)).mkdir()
        make = _temp_dir if what == "temp dir" else _temp_file
        state = make(tmp_path / str(i), host, dead, "1", age_s)
        assert state == ("dead" if gone else "alive"), (host, age_s)


def test_records_name_this_process_s_pid_namespace_where_it_is_not_the_host_s(
    tmp_path, monkeypatch
):
    from ckptguard._disk.lease import Owner
    from ckptguard.storage.s3._objrecords import Writer

    assert tempfiles.this_host() == socket.gethostname() or "#pidns" in tempfiles.this_host()
    monkeypatch.setattr(tempfiles, "_pid_ns", lambda: tempfiles.INIT_PID_NS)
    assert tempfiles.this_host() == socket.gethostname()  # outside any container: as before
    monkeypatch.setattr(tempfiles, "_pid_ns", lambda: 4026532000)
    layout.write_owner(tmp_path)
    recorded = json.loads((tmp_path / layout.OWNER_NAME).read_text())["host"]
    assert recorded == Owner.me().host == Writer.here().host == tempfiles.this_host()
    assert layout.owner_state(tmp_path, max_age_s=MAX_AGE_S) == "alive"  # this very process
    assert tempfiles.owner_state(tempfiles.temp_name(tmp_path / "x"), max_age_s=MAX_AGE_S) == (
        "alive"
    )
