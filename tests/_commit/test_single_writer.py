"""One writer per root, and a commit only when a checkpoint exists.

Two relaunches racing on a stale lease never both commit and the tracker never moves back; a
duplicate launch is refused before training; transfer refuses a root a live run writes, and a
transfer killed before the tracker resumes; node-local roots (one root per rank, or one path
over per-rank disks) never commit; on two ranks, malformed extras on one rank fail every rank
at once and an item that is a tensor on one rank and a float on another is refused at save;
the resume lines reach stderr with no logging configured.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ckptguard as cg
from ckptguard import _faults
from ckptguard.demo.toyjob import build_job, train_step
from ckptguard.testing import fake_node, run_ranks
from damage_helper import (
    MANIFEST,
    TRACKER,
    cli,
    committed_on_disk,
    dead_lease,
    no_traceback,
    refresh_entry,
    run_py,
    tiny_root,
)


def _tracker(root: Path) -> int | None:
    path = root / TRACKER
    return int(path.read_text()) if path.is_file() else None


# ---------------------------------------------------------------- one writer: two relaunches on a
# stale lease, transfer

TRIALS = 20
SPACING_S = 0.3
RELAUNCH = """
import json, sys, time
from pathlib import Path
import torch
import ckptguard as cg

who, step, base = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
trials, spacing = int(sys.argv[4]), float(sys.argv[5])
# first-use costs, outside the race
cg.CheckpointManager(base / f"warm-{who}").save(1, {"w": torch.ones(4)})
(base / f"ready-{who}").touch()
while not (base / "go").exists():
    time.sleep(0.001)
t0 = float((base / "go").read_text())
out = {}
for i in range(trials):
    while time.time() < t0 + i * spacing:
        pass  # both relaunches leave this loop within microseconds of each other
    try:
        cg.CheckpointManager(base / f"trial{i:02d}").save(
            step, {"w": torch.full((4,), float(step))}
        )
        out[i] = "committed"
    except cg.CheckpointError as exc:
        out[i] = f"{type(exc).__name__}: {exc}"
(base / f"result-{who}.json").write_text(json.dumps(out))
"""


@pytest.mark.timeout(200)
def test_concurrent_relaunches_on_a_stale_lease_commit_once(tmp_path):
    """20 trials: a crashed run left step 3 and its (dead) lease; two relaunches start at
    once, one saving step 5, one step 4. Never two commits, never a tracker moving back."""
    template = tiny_root(tmp_path / "template", (1, 2, 3))
    for i in range(TRIALS):
        trial = tmp_path / f"trial{i:02d}"
        shutil.copytree(template, trial)
        dead_lease(trial)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {
        who: subprocess.Popen(
            [
                sys.executable,
                "-c",
                RELAUNCH,
                who,
                str(step),
                str(tmp_path),
                str(TRIALS),
                str(SPACING_S),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for who, step in (("a", 5), ("b", 4))
    }
    try:
        deadline = time.monotonic() + 90
        while not all((tmp_path / f"ready-{w}").exists() for w in procs):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs.values()), {
                w: p.poll() for w, p in procs.items()
            }
            time.sleep(0.05)
        # Written whole, then renamed: a relaunch polling for "go" must never read it half-written.
        (tmp_path / "go.tmp").write_text(repr(time.time() + 0.5))
        os.replace(tmp_path / "go.tmp", tmp_path / "go")
        for who, proc in procs.items():
            out, _ = proc.communicate(timeout=60 + TRIALS * SPACING_S)
            assert proc.returncode == 0, f"relaunch {who} failed:\n{out}"
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
    results = {w: json.loads((tmp_path / f"result-{w}.json").read_text()) for w in procs}
    double, backwards, none = [], [], []
    for i in range(TRIALS):
        root = tmp_path / f"trial{i:02d}"
        won = [w for w in procs if results[w][str(i)] == "committed"]
        on_disk = committed_on_disk(root)
        newest = max(int(n.split("_")[1]) for n in on_disk)
        if len(won) == 2:
            double.append(i)
        if not won:
            none.append((i, results["a"][str(i)][:200], results["b"][str(i)][:200]))
        if _tracker(root) != newest:
            backwards.append((i, _tracker(root), on_disk))
    assert not double, f"both relaunches committed in trials {double} of {TRIALS}"
    assert not backwards, f"the tracker is behind the newest committed step: {backwards}"
    assert not none, f"neither relaunch committed: {none}"


def test_publishing_never_moves_the_tracker_backwards(tmp_path):
    """While step 4 is being saved, another writer commits step 6: step 4's publish must not
    set the tracker back to 4 under the committed step 6. (A fix that makes the other writer
    wait or fail instead passes too: the tracker must end at the newest committed step.)"""
    import threading

    root = tmp_path / "ck"
    cg.CheckpointManager(root).save(3, {"w": torch.full((4,), 3.0)})
    other: list[threading.Thread] = []

    def save_six() -> None:
        with contextlib.suppress(cg.CheckpointError):  # a fix may refuse this writer instead
            cg.CheckpointManager(root).save(6, {"w": torch.full((4,), 6.0)})

    def other_writer() -> None:
        if other:
            return  # the other writer's own save passes this point too
        thread = threading.Thread(target=save_six, daemon=True)
        other.append(thread)
        thread.start()
        thread.join(10)  # a fix may make it wait for this save to finish

    _faults.set_hook("commit.before_manifest", other_writer)
    try:
        with contextlib.suppress(cg.CheckpointError):  # refusing to publish step 4 is a fix too
            cg.CheckpointManager(root).save(4, {"w": torch.full((4,), 4.0)})
    finally:
        _faults.set_hook("commit.before_manifest", None)
    assert other, "the other writer never ran"
    other[0].join(30)
    newest = max(int(n.split("_")[1]) for n in committed_on_disk(root))
    assert _tracker(root) == newest, (
        f"the tracker moved back to {_tracker(root)} under a committed step {newest} "
        f"({committed_on_disk(root)})"
    )


HOLDER = """
import sys, time, torch, ckptguard as cg
for spec in sys.argv[1:]:
    root, step = spec.rsplit(":", 1)
    cg.CheckpointManager(root).save(int(step), {"w": torch.ones(4)})
print("ready", flush=True)
time.sleep(300)
"""


@pytest.fixture(scope="module")
def live_writer(tmp_path_factory):
    """One live process holding the lease of two roots: a fresh run, and a run that
    continues a checkpoint transferred to it (same chain as ``src``)."""
    base = tmp_path_factory.mktemp("live")
    src = tiny_root(base / "src", (1, 2, 3))
    dest = base / "dest"
    result = cli("transfer", src / "step_00000001", dest)
    assert result.exit_code == 0, result.output
    run = base / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, f"{run}:1", f"{dest}:2"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "ready"
        yield {"pid": holder.pid, "run": run, "src": src, "dest": dest}
    finally:
        holder.kill()
        holder.wait()


def test_a_duplicate_launch_is_refused_before_training(live_writer):
    """The lease is checked when the manager is created or at restore, not at the first save."""
    with pytest.raises(cg.LeaseHeldError, match=f"pid {live_writer['pid']}"):
        mgr = cg.CheckpointManager(live_writer["run"])
        mgr.restore({"w": torch.zeros(4)})
        pytest.fail(
            "a duplicate launch restored (and would train) while a live run holds the lease"
        )


def test_transfer_refuses_a_destination_a_live_run_writes(live_writer):
    dest = live_writer["dest"]
    result = cli("transfer", live_writer["src"] / "step_00000003", dest)
    no_traceback(result, "transfer into a root a live run writes")
    assert result.exit_code == 1 and f"pid {live_writer['pid']}" in result.output, (
        f"transfer into a root whose lease a live run holds was not refused naming it\n"
        f"{result.output}"
    )
    assert _tracker(dest) == 2, f"transfer moved a live run's tracker to {_tracker(dest)}"


KILL_BEFORE_TRACKER = """
import os, signal, sys
from pathlib import Path
from ckptguard._disk import layout as _layout
from ckptguard.ops.transfer import transfer

real = _layout.write_tracker
step_name = Path(sys.argv[1]).name


def die_once_published(root, step):
    if (Path(root) / step_name).exists():  # between the rename and the destination's tracker
        os.kill(os.getpid(), signal.SIGKILL)
    real(root, step)


_layout.write_tracker = die_once_published
transfer(sys.argv[1], sys.argv[2])
"""


def test_a_transfer_killed_before_the_tracker_is_resumable(tmp_path):
    src = tiny_root(tmp_path / "src", (1, 2))
    dest = tmp_path / "dest"
    killed = run_py(KILL_BEFORE_TRACKER, src / "step_00000002", dest)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    published = (dest / "step_00000002" / MANIFEST).exists()
    gc = cli("gc", dest)
    no_traceback(gc, "gc after a killed transfer")
    if published:  # complete before the kill, so gc must never delete it
        assert (dest / "step_00000002" / MANIFEST).exists(), (
            f"gc emptied the complete step a killed transfer published\n{gc.output}"
        )
    again = cli("transfer", src / "step_00000002", dest)
    assert again.exit_code == 0, f"the retry of a killed transfer was refused\n{again.output}"
    assert cg.CheckpointManager(dest).restore({"w": torch.zeros(4)}) == 2, (
        "the destination does not resume from the transferred step"
    )


# ---------------------------------------------------------------- two ranks: node-local roots,
# mixed items, bad extras


def _own_disk(disk: str, shared: str) -> str | None:
    """This rank sees ``disk`` at ``shared`` (``fake_node``, the node identity unchanged): a node
    with its own local disk, while the other rank keeps its own view. Returns why not, if it
    cannot."""
    try:
        fake_node(disks={shared: disk})
    except OSError as exc:
        return str(exc)
    return None


def _attempt(fn) -> dict:
    start = time.monotonic()
    try:
        value = fn()
        return {"outcome": "ok", "value": value, "elapsed": time.monotonic() - start}
    except BaseException as exc:  # every outcome, a hang's timeout included, is data for the test
        return {
            "outcome": "raised",
            "type": type(exc).__name__,
            "clear": isinstance(exc, cg.CheckpointError),
            "message": str(exc)[:3000],
            "elapsed": time.monotonic() - start,
        }


def _two_rank_scenes(rank: int, world: int, base: str) -> dict:
    import torch.distributed as dist

    base_path = Path(base)
    out: dict = {}

    # A tensor on rank 0, a float on rank 1, under one item name.
    def mixed():
        mgr = cg.CheckpointManager(base_path / "mixed", config=cg.CheckpointConfig(timeout_s=20))
        mgr.save(1, {"count": torch.tensor(1.0) if rank == 0 else 1.0, "w": torch.ones(3)})

    out["mixed"] = _attempt(mixed)
    dist.barrier()

    # Malformed extras on rank 1 only; rank 0 must not wait for the whole timeout.
    extras_root = base_path / "extras"
    job = build_job(rank=rank, world=world)
    train_step(job)
    cg.CheckpointManager(extras_root, config=cg.CheckpointConfig(timeout_s=20)).save(1, job.state())
    dist.barrier()
    if rank == 0:
        step = extras_root / "step_00000001"
        torch.save(
            {"format_version": 1, "step": 1, "rank": 1, "kinds": {}, "rng": None},
            step / "rank_00001.pt",
        )
        refresh_entry(step, "rank_00001.pt")
    dist.barrier()
    out["extras"] = _attempt(
        lambda: cg.CheckpointManager(extras_root, config=cg.CheckpointConfig(timeout_s=20)).restore(
            build_job(rank=rank, world=world, seed=3).state()
        )
    )
    dist.barrier()

    # Node-local roots: two root directories standing in for two nodes' local disks.
    def per_rank_root():
        mgr = cg.CheckpointManager(
            base_path / f"node{rank}" / "ck", config=cg.CheckpointConfig(timeout_s=20)
        )
        j = build_job(rank=rank, world=world)
        train_step(j)
        mgr.save(1, j.state())

    out["roots"] = _attempt(per_rank_root)
    dist.barrier()

    # Node-local roots: one path, two disks; each rank sees its own disk at the shared path.
    why = _own_disk(str(base_path / f"disk{rank}"), str(base_path / "shared"))
    views = [None] * world
    dist.all_gather_object(views, why)
    if any(views):
        out["disks"] = {"outcome": "unavailable", "why": [v for v in views if v]}
        return out

    def own_disks():
        mgr = cg.CheckpointManager(
            base_path / "shared" / "ck", config=cg.CheckpointConfig(timeout_s=20)
        )
        j = build_job(rank=rank, world=world)
        train_step(j)
        mgr.save(1, j.state())

    out["disks"] = _attempt(own_disks)
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("ranks")
    for name in ("shared", "disk0", "disk1"):
        (base / name).mkdir()
    results = run_ranks(_two_rank_scenes, 2, str(base), timeout=200)
    for r in results:
        assert r.ok, f"rank {r.rank} exit {r.exitcode}: {r.error_type}: {r.error}"
    return {"base": base, "ranks": [r.value for r in results]}


def test_a_tensor_on_one_rank_and_a_float_on_another_is_refused_at_save(two_ranks):
    outcomes = [r["mixed"] for r in two_ranks["ranks"]]
    for rank, o in enumerate(outcomes):
        assert o["outcome"] == "raised" and o["clear"], (
            f"rank {rank} committed an item that is a tensor on rank 0 and a float on rank 1: {o}"
        )
        msg = o["message"]
        assert "count" in msg and "rank" in msg and "0" in msg and "1" in msg, (
            f"rank {rank}'s refusal does not name the item and the ranks: {msg}"
        )
    assert _tracker(two_ranks["base"] / "mixed") in (None, 0), "the mixed item was committed"


def test_malformed_extras_on_one_rank_fail_every_rank_at_once(two_ranks):
    for rank, r in enumerate(two_ranks["ranks"]):
        o = r["extras"]
        assert o["outcome"] == "raised" and o["clear"], (
            f"rank {rank} did not raise a ckptguard error for rank 1's malformed extras: {o}"
        )
        assert o["elapsed"] < 10, (
            f"rank {rank} raised after {o['elapsed']:.1f} s (timeout 20 s): the error was not "
            f"shipped to all ranks at once: {o['message'][:300]}"
        )
        assert "rank_00001.pt" in o["message"] or "rank 1" in o["message"], (
            f"rank {rank}'s error does not name rank 1's extras: {o['message'][:500]}"
        )


@pytest.mark.parametrize("scene", ["roots", "disks"])
def test_node_local_roots_never_commit(two_ranks, scene):
    """``roots``: each rank has its own root directory; ``disks``: one path, and each rank
    sees its own disk there (private mount namespaces). No node holds the whole checkpoint."""
    outcomes = [r[scene] for r in two_ranks["ranks"]]
    if outcomes[0]["outcome"] == "unavailable":
        pytest.skip(f"per-rank mounts are not available here: {outcomes[0]['why']}")
    for rank, o in enumerate(outcomes):
        assert o["outcome"] == "raised" and o["clear"], (
            f"{scene}: rank {rank} logged a commit although no node holds every rank's files: {o}"
        )
        assert "node-local" in o["message"].lower(), (
            f"{scene}: rank {rank}'s error does not name node-local storage: {o['message'][:500]}"
        )
    base = two_ranks["base"]
    rank0_root = base / ("node0/ck" if scene == "roots" else "disk0/ck")
    assert _tracker(rank0_root) in (None, 0), (
        f"{scene}: rank 0 published step {_tracker(rank0_root)} listing files it does not hold"
    )


# ---------------------------------------------------------------- the resume line without logging
# configured

RESUME_LINES = """
import logging, sys, torch, ckptguard as cg

root = sys.argv[1]
cg.CheckpointManager(root).restore({"w": torch.zeros(4)})
cg.CheckpointManager(root).save(1, {"w": torch.ones(4)})
cg.CheckpointManager(root).restore({"w": torch.zeros(4)})
root_logger = logging.getLogger()
print(
    "root logger:", len(root_logger.handlers), logging.getLevelName(root_logger.level), flush=True
)
logging.getLogger("ckptguard").setLevel(logging.CRITICAL)
print("--- silenced ---", file=sys.stderr, flush=True)
cg.CheckpointManager(root).restore({"w": torch.zeros(4)})
"""


def test_the_resume_lines_reach_stderr_without_logging_configured(tmp_path):
    proc = run_py(RESUME_LINES, tmp_path / "ck")
    assert proc.returncode == 0, proc.stderr
    loud, _, quiet = proc.stderr.partition("--- silenced ---")
    for line in ("FRESH START", "committed step 1", "resume from step 1"):
        assert line in loud, f"{line!r} did not reach stderr without logging configured:\n{loud}"
    assert "root logger: 0 WARNING" in proc.stdout, f"the root logger was touched: {proc.stdout}"
    assert "resume from" not in quiet, f"the lines cannot be silenced:\n{quiet}"
