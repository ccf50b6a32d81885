"""Nothing committed is lost, nothing foreign is touched.

gc and retention keep committed steps whatever the tracker says; one writer per root and a
tracker that never moves back; gc only in roots and only on entries ckptguard created; demo
--workdir; transfer under the lease; one bad entry never disables retention; holds and crash
leftovers. Each test builds a real root through the public API, then breaks it (a lost
tracker, a stale lease taken over twice, a foreign directory, a killed transfer...).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckptguard as cg
from ckptguard import StorageOptions, _faults
from ckptguard._disk import layout as _layout
from ckptguard._disk.lease import LEASE_NAME
from ckptguard._records import retention
from ckptguard.cli import main

NAMING = _layout.StepNaming("step_{step:08d}")
TRACKER = _layout.TRACKER_NAME


def _w(step: int) -> dict:
    return {"w": torch.full((4,), float(step))}


def _root(root: Path, steps=(1, 2, 3), template: str = "step_{step:08d}") -> Path:
    """Committed ``steps``, no retention, and no lease of this (live) test process left behind."""
    config = cg.CheckpointConfig(retention=None, storage=StorageOptions(dir_template=template))
    mgr = cg.CheckpointManager(root, config=config)
    for step in steps:
        mgr.save(step, _w(step))
    (root / LEASE_NAME).unlink()
    return root


def _on_disk(root: Path) -> list[str]:
    return sorted(
        p.name for p in root.iterdir() if p.is_dir() and (p / _layout.MANIFEST_NAME).is_file()
    )


def _gc(root: Path, *args: str):
    return CliRunner().invoke(main, ["gc", str(root), *args])


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _dead_owner() -> dict:
    return {"host": socket.gethostname(), "pid": _dead_pid(), "start": "1"}


def _dead_lease(root: Path) -> None:
    now = time.time()
    (root / LEASE_NAME).write_text(
        json.dumps({**_dead_owner(), "acquired_unix": now - 60, "renewed_unix": now - 30})
    )


# ---------------------------------------------------------------- gc and retention keep committed
# steps


@pytest.mark.parametrize("template", ["step_{step:08d}", "global_step_{step}"])
def test_gc_keeps_every_complete_step_without_a_tracker(tmp_path, template):
    root = _root(tmp_path / "ck", template=template)
    (root / TRACKER).unlink()  # a root copied by hand without its tracker
    out = _gc(root, "--template", template)
    assert out.exit_code == 0, out.output
    assert _on_disk(root) == sorted(template.format(step=s) for s in (1, 2, 3))
    assert "restore(path=" in out.output and "ckptguard adopt" in out.output
    # --orphans needs a tracker: without one every step would look like an orphan.
    refused = _gc(root, "--template", template, "--orphans")
    assert refused.exit_code == 2 and "tracker" in refused.output
    assert len(_on_disk(root)) == 3


def test_gc_keeps_committed_steps_under_tracker_zero_and_an_older_tracker(tmp_path):
    root = _root(tmp_path / "ck")
    (root / TRACKER).write_text("0\n")
    assert _gc(root).exit_code == 0 and _on_disk(root) == [
        "step_00000001",
        "step_00000002",
        "step_00000003",
    ]
    (root / TRACKER).write_text("1\n")
    out = _gc(root)
    assert out.exit_code == 0 and len(_on_disk(root)) == 3
    orphan_lines = [line for line in out.output.splitlines() if "step_00000003" in line]
    assert (
        orphan_lines
        and "newer than the tracker" in orphan_lines[0]
        and "--orphans" in orphan_lines[0]
    )
    # Only the explicit flag removes orphans, and only those newer than the tracker.
    out = _gc(root, "--orphans")
    assert out.exit_code == 0, out.output
    assert _on_disk(root) == ["step_00000001"]


def test_retention_deletes_nothing_beyond_or_without_the_tracker(tmp_path):
    root = _root(tmp_path / "ck", (1, 2, 3, 4))
    (root / TRACKER).write_text("2\n")
    report = retention.apply(root, NAMING, retention.KeepLast(1))
    assert report.deleted == [1] and _on_disk(root) == [
        "step_00000002",
        "step_00000003",
        "step_00000004",
    ]
    assert "ckptguard adopt" in report.not_counted["step_00000004"]
    (root / TRACKER).unlink()
    report = retention.apply(root, NAMING, retention.KeepLast(1))
    assert report.deleted == [] and len(_on_disk(root)) == 3


def test_adopt_points_the_tracker_at_a_verified_orphan(tmp_path):
    root = _root(tmp_path / "ck")
    (root / TRACKER).write_text("1\n")
    out = CliRunner().invoke(main, ["adopt", str(root), "3"])
    assert out.exit_code == 0, out.output
    assert _layout.read_tracker(root) == 3
    back = CliRunner().invoke(main, ["adopt", str(root), "2"])
    assert back.exit_code == 1 and "back" in back.output and _layout.read_tracker(root) == 3
    (root / "step_00000002" / "rank_00000.pt").write_bytes(b"damaged")
    (root / TRACKER).write_text("1\n")
    bad = CliRunner().invoke(main, ["adopt", str(root), "2"])
    assert bad.exit_code == 1 and "rank_00000.pt" in bad.output and _layout.read_tracker(root) == 1


# ---------------------------------------------------------------- one writer, tracker never
# backwards

RELAUNCH = r"""
import json, sys, time
from pathlib import Path
import torch
import ckptguard as cg
base, me, step, trials = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
out = []
for k in range(trials):
    (base / f"ready{k}.{me}").touch()
    while not (base / f"go{k}").exists():
        pass
    try:
        mgr = cg.CheckpointManager(base / f"t{k}", config=cg.CheckpointConfig(retention=None))
        mgr.save(step, {"w": torch.full((4,), float(step))})
        out.append("committed")
    except cg.LeaseHeldError:
        out.append("refused")
    except cg.CheckpointError as exc:
        out.append(f"{type(exc).__name__}: {exc}")
# Hold every lease until the other relauncher is done too: a process that exits hands its leases
# back, and a save after that is a later writer on a finished root, not a concurrent one.
(base / f"done.{me}").touch()
while len(list(base.glob("done.*"))) < 2:
    time.sleep(0.01)
print(json.dumps(out), flush=True)
"""


def test_two_relaunches_on_a_stale_lease_never_both_commit(tmp_path):
    trials = 20
    template = _root(tmp_path / "template", (1,))
    for k in range(trials):
        shutil.copytree(template, tmp_path / f"t{k}")
        _dead_lease(tmp_path / f"t{k}")  # the crashed run's lease
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-c", RELAUNCH, str(tmp_path), name, str(step), str(trials)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for name, step in (("a", 3), ("b", 2))  # b would move the tracker back if both committed
    }
    for k in range(trials):
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready{k}.{n}").exists() for n in procs):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs.values())
            time.sleep(0.001)
        (tmp_path / f"go{k}").touch()
    results = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr
        results[name] = json.loads(stdout)
    for k in range(trials):
        outcome = {n: results[n][k] for n in procs}
        winners = [n for n, o in outcome.items() if o == "committed"]
        assert len(winners) == 1, f"trial {k}: {outcome}"
        # The loser is refused by the lease, or (when the winner already exited and released it) by
        # the tracker that would move back: both leave one commit and the tracker where it was.
        refused = ("committed", "refused")
        assert all(o in refused or "would move it back" in o for o in outcome.values()), (
            f"trial {k}: {outcome}"
        )
        root = tmp_path / f"t{k}"
        expect = 3 if winners == ["a"] else 2
        assert _layout.read_tracker(root) == expect, f"trial {k}: {outcome}"
        assert _on_disk(root) == ["step_00000001", f"step_0000000{expect}"], f"trial {k}: {outcome}"
    assert not list(tmp_path.glob(f"t*/{LEASE_NAME}.takeover-*")), (
        "a take-over marker was left behind"
    )


DIE_HOLDING_THE_MARKER = """
import os, signal, sys
from pathlib import Path
from ckptguard._disk import lease
lease._write = lambda path, owner: os.kill(os.getpid(), signal.SIGKILL)  # dies inside the take-over
lease.acquire(Path(sys.argv[1]), ttl_s=60)
"""


def test_a_taker_that_died_holding_its_marker_never_wedges_the_root(tmp_path):
    root = _root(tmp_path / "ck", (1,))
    _dead_lease(root)
    killed = subprocess.run([sys.executable, "-c", DIE_HOLDING_THE_MARKER, str(root)])
    assert killed.returncode == -9
    markers = list(root.glob(f"{LEASE_NAME}.takeover-*"))
    assert len(markers) == 1  # the dead taker's marker is left, the dead lease unchanged
    out = CliRunner().invoke(main, ["verify", str(root)])
    assert "takeover-marker" in out.output and markers[0].name in out.output
    cg.CheckpointManager(root, config=cg.CheckpointConfig(retention=None)).save(2, _w(2))
    assert json.loads((root / LEASE_NAME).read_text())["pid"] == os.getpid()
    assert not list(root.glob(f"{LEASE_NAME}.takeover-*")) and _layout.read_tracker(root) == 2


def test_publish_never_moves_the_tracker_backwards(tmp_path):
    root = tmp_path / "ck"
    mgr = cg.CheckpointManager(root, config=cg.CheckpointConfig(retention=None))
    mgr.save(1, _w(1))
    # Another writer commits step 9 while this save of step 5 is between prepare and publish.
    _faults.set_hook("commit.before_manifest", lambda: _layout.write_tracker(root, 9))
    try:
        with pytest.raises(cg.CheckpointWriteError, match="back"):
            mgr.save(5, _w(5))
        assert _layout.read_tracker(root) == 9 and not (root / "step_00000005").exists()
        deliberate = cg.CheckpointManager(root, config=cg.CheckpointConfig(retention=None))
        deliberate.save(
            6, _w(6), overwrite=True
        )  # a rollback asked for with overwrite=True still publishes
        assert _layout.read_tracker(root) == 6
    finally:
        _faults.set_hook("commit.before_manifest", None)


HOLDER = """
import sys, time, torch, ckptguard as cg
cg.CheckpointManager(sys.argv[1]).save(int(sys.argv[2]), {"w": torch.ones(4)})
print("ready", flush=True)
time.sleep(120)
"""


def _holder(root: Path, step: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(root), str(step)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_the_lease_is_checked_at_creation_and_at_restore(tmp_path, caplog):
    root = _root(tmp_path / "ck", (1,))
    early = cg.CheckpointManager(root)  # the root is free now
    holder = _holder(root, 2)
    try:
        caplog.set_level(logging.WARNING, logger="ckptguard")
        late = cg.CheckpointManager(
            root
        )  # warned at creation; a manager that only reads stays usable
        assert f"pid {holder.pid}" in caplog.text and "restore and save will refuse" in caplog.text
        assert 1 in late.committed_steps()
        with pytest.raises(cg.LeaseHeldError, match=f"pid {holder.pid}"):
            late.restore(_w(0))  # a duplicate launch is refused before it trains
        with pytest.raises(cg.LeaseHeldError, match=f"pid {holder.pid}"):
            early.restore(_w(0))
        # Reading another run's root under a manager of one's own root stays possible.
        reader = cg.CheckpointManager(tmp_path / "eval")
        reader.adopt(root / "step_00000001", "evaluate step 1 of the live run")
        assert reader.restore(_w(0), path=root / "step_00000001") == 1
    finally:
        holder.kill()
        holder.wait()
    assert early.restore(_w(0)) == 2  # the owner is dead now: the check passes


# ---------------------------------------------------------------- only roots, only ckptguard's
# entries


def _old(path: Path) -> None:
    past = time.time() - 3 * 24 * 3600
    os.utime(path, (past, past))


@pytest.mark.parametrize("template", ["step_{step:08d}", "{step}"])
def test_gc_refuses_a_directory_that_is_not_a_root(tmp_path, template):
    project = tmp_path / "project"
    (project / ".tmp-build-cache").mkdir(parents=True)
    (project / ".tmp-build-cache" / "obj.o").write_bytes(b"x")
    (project / "2024").mkdir()
    (project / "2024" / "notes.txt").write_text("a year of notes")
    _old(project / ".tmp-build-cache")
    out = _gc(project, "--template", template)
    assert out.exit_code == 2 and "not a checkpoint root" in out.output
    assert (project / ".tmp-build-cache" / "obj.o").exists() and (
        project / "2024" / "notes.txt"
    ).exists()


def test_gc_in_a_root_removes_only_entries_it_created(tmp_path):
    root = _root(tmp_path / "ck", (1,), template="{step}")
    for name in (".tmp-build-cache", "2024"):
        (root / name).mkdir()
        (root / name / "f").write_text("foreign")
        _old(root / name)
    ours = root / ".tmp-5-0123456789ab"
    (ours / "state").mkdir(parents=True)
    (ours / _layout.OWNER_NAME).write_text(json.dumps(_dead_owner()))
    out = _gc(root, "--template", "{step}")
    assert out.exit_code == 0, out.output
    assert (root / ".tmp-build-cache" / "f").exists() and (root / "2024" / "f").exists()
    assert not ours.exists()
    assert "2024" in out.output and "not created by ckptguard" in out.output


# ---------------------------------------------------------------- demo --workdir


def test_demo_refuses_a_non_empty_workdir_it_did_not_create(tmp_path):
    mine = tmp_path / "home"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    out = CliRunner().invoke(main, ["demo", "--workdir", str(mine)])
    assert out.exit_code == 2 and "not created by" in out.output and (mine / "thesis.tex").exists()
    from ckptguard.demo.job import WORKDIR_MARKER, prepare_workdir

    fresh = tmp_path / "demo-run"
    prepare_workdir(fresh)  # created by the demo: a rerun may wipe it
    (fresh / "ckpt").mkdir()
    prepare_workdir(fresh)
    assert list(fresh.iterdir()) == [fresh / WORKDIR_MARKER]
    empty = tmp_path / "empty"
    empty.mkdir()
    prepare_workdir(empty)  # an empty directory holds nothing to lose


# ---------------------------------------------------------------- transfer


KILL_BEFORE_TRACKER = """
import os, signal, sys
from ckptguard import _faults
from ckptguard.ops.transfer import transfer
_faults.set_hook("transfer.before_tracker", lambda: os.kill(os.getpid(), signal.SIGKILL))
transfer(sys.argv[1], sys.argv[2])
"""


def test_transfer_takes_the_lease_and_resumes_after_a_kill_before_the_tracker(tmp_path):
    src = _root(tmp_path / "src", (1, 2))
    dest = tmp_path / "dest"  # the same run chain, continued on another node
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("step_00000002"))
    _layout.write_tracker(dest, 1)
    holder = _holder(dest, 7)  # a live run writes the destination
    try:
        refused = CliRunner().invoke(
            main, ["transfer", str(src / "step_00000002"), str(tmp_path / "dest")]
        )
        assert refused.exit_code == 1 and f"pid {holder.pid}" in refused.output
    finally:
        holder.kill()
        holder.wait()
    assert _layout.read_tracker(dest) == 7 and not (dest / "step_00000002").exists()
    node2 = tmp_path / "node2"
    killed = subprocess.run(
        [sys.executable, "-c", KILL_BEFORE_TRACKER, str(src / "step_00000002"), str(node2)]
    )
    assert killed.returncode == -9 and (node2 / "step_00000002" / _layout.MANIFEST_NAME).exists()
    assert _layout.read_tracker(node2) is None
    again = CliRunner().invoke(main, ["transfer", str(src / "step_00000002"), str(node2)])
    assert again.exit_code == 0, again.output
    assert _layout.read_tracker(node2) == 2 and "resumed" in again.output
    assert CliRunner().invoke(main, ["verify", str(node2), "--deep"]).exit_code == 0
    assert not (node2 / LEASE_NAME).exists()  # handed back when the transfer ended
    assert cg.CheckpointManager(node2).restore(_w(0)) == 2


# ---------------------------------------------------------------- one bad entry is one finding

DEEP = "[" * 100_000 + "]" * 100_000


def test_a_deep_hold_or_lease_and_a_link_loop_never_disable_retention(tmp_path):
    root = tmp_path / "ck"
    mgr = cg.CheckpointManager(root, config=cg.CheckpointConfig(retention=retention.KeepLast(1)))
    mgr.save(1, _w(1))
    mgr.save(2, _w(2))
    (root / "holds").mkdir()
    (root / "holds" / "99.json").write_text(DEEP)
    loop = root / "step_00000002" / "state" / "__0_0.distcp"
    loop.unlink()
    os.symlink(loop.name, loop)  # a link to itself in a step that is not the tracker's
    mgr.save(3, _w(3))
    mgr.save(4, _w(4))
    assert _on_disk(root) == [
        "step_00000002",
        "step_00000004",
    ]  # 3 rotated, the damaged 2 kept and reported
    report = retention.apply(root, NAMING, retention.KeepLast(1))
    assert "step_00000002" in report.not_counted
    # A deep lease is one unreadable lease, never a crash of the save.
    lease = root / LEASE_NAME
    lease.write_text(DEEP)
    cg.CheckpointManager(root, config=cg.CheckpointConfig(retention=retention.KeepLast(1))).save(
        5, _w(5)
    )
    assert json.loads(lease.read_text())["pid"] == os.getpid()


# ---------------------------------------------------------------- holds and crash leftovers


def test_an_unreadable_hold_keeps_its_step(tmp_path):
    root = tmp_path / "ck"
    mgr = cg.CheckpointManager(root, config=cg.CheckpointConfig(retention=retention.KeepLast(1)))
    mgr.save(1, _w(1))
    mgr.hold(1, "evaluation job 7")
    (root / "holds" / "1.json").write_text('{"step": 1, "reason": "evalu')  # torn
    mgr.save(2, _w(2))
    mgr.save(3, _w(3))
    assert _on_disk(root) == ["step_00000001", "step_00000003"]
    assert "1.json" in retention.holds(root)[1]


def test_crash_leftovers_are_reported_and_the_dead_ones_removed(tmp_path):
    root = _root(tmp_path / "ck", (1, 2))
    trash = root / ".trash-step_00000000-0badf00d"
    (trash / "state").mkdir(parents=True)
    for i in range(300):
        (trash / "state" / f"part_{i:04d}").write_bytes(b"x")
    tracker_tmp = root / f"{TRACKER}.tmp-deadbeef"
    tracker_tmp.write_text("7\n")
    live = root / ".tmp-step_00000003-0123456789ab"
    (live / "state").mkdir(parents=True)
    _layout.write_owner(live)  # this process is alive: a save that timed out and left it
    dead = root / ".tmp-step_00000004-ba9876543210"
    dead.mkdir()
    (dead / _layout.OWNER_NAME).write_text(json.dumps(_dead_owner()))
    out = CliRunner().invoke(main, ["verify", str(root), "--json"])
    assert out.exit_code == 0, out.output
    found = {Path(f["path"]).name: f for f in json.loads(out.output)["findings"]}
    for leftover in (trash, tracker_tmp, live, dead):
        assert found[leftover.name]["severity"] == "WARNING", found
    assert "300 files" in found[trash.name]["message"]
    assert (
        f"pid {os.getpid()}" in found[live.name]["message"]
        and "alive" in found[live.name]["message"]
    )
    out = _gc(root)
    assert out.exit_code == 0, out.output
    assert not trash.exists() and not tracker_tmp.exists() and not dead.exists()
    assert live.exists() and _on_disk(root) == ["step_00000001", "step_00000002"]
