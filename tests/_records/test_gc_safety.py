"""gc and retention never delete what is committed or foreign.

Committed steps survive a missing, zero or older tracker; gc outside a root, or on entries it
did not create, deletes nothing; one bad entry (a deeply nested hold, a link loop) never
disables retention for the root; an unreadable hold still protects its step; crash leftovers
are reported by verify and removed by gc; the retention warning for an incomplete step says
what to do. (tests/_disk/test_root_safety.py has its own cases of the same rules.)
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
import torch

import ckptguard as cg
from ckptguard._disk import layout as _layout
from ckptguard._records import retention
from damage_helper import (
    DEEP,
    MANIFEST,
    TRACKER,
    cli,
    committed_on_disk,
    no_traceback,
    run_py,
    step_dir,
    tiny_root,
)


def _mgr(root: Path, keep: int) -> cg.CheckpointManager:
    return cg.CheckpointManager(root, config=cg.CheckpointConfig(retention=cg.KeepLast(keep)))


def _w(step: int) -> dict:
    return {"w": torch.full((4,), float(step))}


# ---------------------------------------------------------------- gc keeps committed checkpoints


@pytest.mark.parametrize("template", ["step_{step:08d}", "global_step_{step}"])
def test_gc_keeps_committed_steps_when_the_tracker_is_missing(tmp_path, template):
    root = tiny_root(tmp_path / "ck", (1, 2, 3), template=template)
    (root / TRACKER).unlink()  # a root copied by hand without its tracker
    before = committed_on_disk(root)
    result = cli("gc", root, "--template", template)
    no_traceback(result, "gc without a tracker")
    assert committed_on_disk(root) == before, (
        f"gc without a tracker deleted committed steps: before {before}, after "
        f"{committed_on_disk(root)}\n{result.output}"
    )


def test_gc_keeps_committed_steps_when_the_tracker_says_zero(tmp_path):
    root = tiny_root(tmp_path / "ck", (1, 2, 3))
    (root / TRACKER).write_text("0\n")
    result = cli("gc", root)
    no_traceback(result, "gc with tracker 0")
    assert committed_on_disk(root) == ["step_00000001", "step_00000002", "step_00000003"], (
        f"gc with tracker 0 deleted committed steps, left "
        f"{committed_on_disk(root)}\n{result.output}"
    )


def test_gc_keeps_newer_committed_steps_and_says_what_to_do(tmp_path):
    root = tiny_root(tmp_path / "ck", (1, 2, 3))
    (root / TRACKER).write_text("1\n")  # a tracker pointing at an older step
    result = cli("gc", root)
    no_traceback(result, "gc with an older tracker")
    assert committed_on_disk(root) == ["step_00000001", "step_00000002", "step_00000003"], (
        f"gc deleted committed steps newer than the tracker as orphans, left "
        f"{committed_on_disk(root)}\n{result.output}"
    )
    assert "step_00000003" in result.output or " 3" in result.output, (
        f"gc did not report the complete orphan step 3\n{result.output}"
    )
    assert any(hint in result.output for hint in ("restore(path=", "adopt", "--orphans")), (
        f"gc reported no way forward for a complete orphan (restore(path=...), adopt, "
        f"gc --orphans)\n{result.output}"
    )


def test_retention_never_deletes_complete_steps_beyond_the_tracker(tmp_path):
    """Same rule for retention: only committed steps the policy drops are deleted."""
    root = tiny_root(tmp_path / "ck", (1, 2, 3, 4))
    (root / TRACKER).write_text("2\n")
    naming = _layout.StepNaming("step_{step:08d}")
    report = retention.apply(root, naming, cg.KeepLast(1))
    assert committed_on_disk(root) == ["step_00000002", "step_00000003", "step_00000004"], (
        f"retention deleted {report.deleted}, left {committed_on_disk(root)}"
    )
    (root / TRACKER).unlink()
    report = retention.apply(root, naming, cg.KeepLast(1))
    assert committed_on_disk(root) == ["step_00000002", "step_00000003", "step_00000004"], (
        f"retention without a tracker deleted {report.deleted}"
    )


# ---------------------------------------------------------------- gc outside a checkpoint root


def _old(path: Path) -> None:
    past = time.time() - 2 * 24 * 3600
    os.utime(path, (past, past))


KILLED_SAVE = """
import os, signal, sys, torch, ckptguard as cg
from ckptguard import _faults
_faults.set_hook("storage.data_written", lambda: os.kill(os.getpid(), signal.SIGKILL))
cg.CheckpointManager(sys.argv[1]).save(2, {"w": torch.ones(4)})
"""


@pytest.mark.parametrize("template", [None, "{step}"])
def test_gc_leaves_a_directory_that_is_not_a_root_alone(tmp_path, template):
    foreign = tmp_path / "project"
    (foreign / ".tmp-build-cache").mkdir(parents=True)
    (foreign / ".tmp-build-cache" / "obj.o").write_bytes(b"build output")
    (foreign / "2024").mkdir()
    (foreign / "2024" / "report.txt").write_text("a year of notes")
    _old(foreign / ".tmp-build-cache")
    _old(foreign / "2024")
    result = cli("gc", foreign, *(["--template", template] if template else []))
    no_traceback(result, "gc on a directory that is no root")
    gone = [n for n in (".tmp-build-cache/obj.o", "2024/report.txt") if not (foreign / n).exists()]
    assert not gone, f"gc on a directory that is no checkpoint root deleted {gone}\n{result.output}"


def test_gc_in_a_root_removes_only_what_ckptguard_created(tmp_path):
    root = tiny_root(tmp_path / "ck", (1,))
    foreign = root / ".tmp-build-cache"
    foreign.mkdir()
    (foreign / "obj.o").write_bytes(b"x")
    _old(foreign)
    # The temp dir of a save killed mid-write (owner dead): gc's own job, which must keep working.
    killed = run_py(KILLED_SAVE, root)
    assert killed.returncode == -9, killed.stderr
    (ours,) = root.glob(".tmp-step_00000002-*")
    result = cli("gc", root)
    no_traceback(result, "gc in a root with a foreign directory")
    assert (foreign / "obj.o").exists(), f"gc deleted {foreign}, which has no owner record\n" + (
        result.output
    )
    assert not ours.exists(), f"gc no longer removes a dead save's temp dir {ours}"


# ---------------------------------------------------------------- one bad entry never disables
# retention


def test_a_deep_hold_file_does_not_disable_retention(tmp_path, caplog):
    root = tmp_path / "ck"
    mgr = _mgr(root, 1)
    mgr.save(1, _w(1))
    (root / "holds").mkdir()
    (root / "holds" / "99.json").write_text(DEEP)  # holds no existing step
    caplog.set_level(logging.WARNING, logger="ckptguard")
    mgr.save(2, _w(2))
    mgr.save(3, _w(3))
    assert committed_on_disk(root) == ["step_00000003"], (
        f"a deeply nested hold file disabled retention for the root: {committed_on_disk(root)} "
        f"left\n{caplog.text}"
    )


def test_a_symlink_loop_in_one_step_is_one_finding(tmp_path):
    root = tmp_path / "ck"
    mgr = _mgr(root, 1)
    mgr.save(1, _w(1))
    shard = root / "step_00000001" / "state" / "__0_0.distcp"
    shard.unlink()
    os.symlink(shard.name, shard)  # a link to itself
    mgr.save(2, _w(2))
    mgr.save(3, _w(3))
    assert not (root / "step_00000002").exists(), (
        "a symlink loop in step 1 disabled retention for the whole root (step 2 kept)"
    )
    assert (root / "step_00000001").exists(), "the damaged step 1 was deleted by rotation"
    result = cli("verify", root)
    no_traceback(result, "verify with a link loop in step 1")
    assert result.exit_code == 1 and "step_00000001" in result.output, (
        f"verify did not report the looping link in step 1 as a finding\n{result.output}"
    )
    # The same loop in the tracker's step: preflight reports it instead of crashing.
    latest = root / "step_00000003" / "state" / "__0_0.distcp"
    latest.unlink()
    os.symlink(latest.name, latest)
    result = cli("preflight", root)
    no_traceback(result, "preflight with a link loop in the tracker's step")
    assert result.exit_code == 1, f"preflight passed a step with a looping link\n{result.output}"


@pytest.mark.parametrize("where", ["lease.json", "contract/phase_0001.json"])
def test_a_deep_lease_or_phase_file_gives_a_clear_error(tmp_path, where):
    root = tiny_root(tmp_path / "ck", (1,))
    (root / where).write_text(DEEP)
    try:
        for args in (
            ("gc", root, "--dry-run"),
            ("gc", root),
            ("verify", root),
            ("preflight", root),
        ):
            no_traceback(cli(*args), f"{args[0]} with a deep {where}")
        for call in ("save", "restore"):
            mgr = cg.CheckpointManager(root)
            try:
                mgr.save(2, _w(2)) if call == "save" else mgr.restore(_w(0))
            except cg.CheckpointError as exc:  # a refusal must name the file (where) it refuses
                assert Path(where).name in str(exc), f"{call} with a deep {where}: {exc}"
            except RecursionError as exc:
                pytest.fail(f"{call} with a deeply nested {where} raised RecursionError: {exc}")
    finally:
        (root / "lease.json").unlink(missing_ok=True)  # this process's exit handler reads it


# ---------------------------------------------------------------- holds and leftovers


def test_an_unreadable_hold_still_protects_its_step(tmp_path):
    root = tmp_path / "ck"
    mgr = _mgr(root, 1)
    mgr.save(1, _w(1))
    mgr.hold(1, "evaluation job 7")
    (root / "holds" / "1.json").write_text('{"step": 1, "reason": "evaluation')  # torn or damaged
    mgr.save(2, _w(2))
    mgr.save(3, _w(3))
    assert (root / "step_00000001" / MANIFEST).exists(), (
        "held step 1 was deleted by rotation once its hold file became unreadable"
    )


def test_crash_leftovers_are_reported_by_verify_and_removed_by_gc(tmp_path):
    root = tiny_root(tmp_path / "ck", (1, 2))
    trash = root / ".trash-step_00000000-0badf00d"  # a delete that died midway
    (trash / "state").mkdir(parents=True)
    for i in range(1000):
        (trash / "state" / f"part_{i:04d}").write_bytes(b"x")
    tracker_tmp = root / f"{TRACKER}.tmp-deadbeef"  # a tracker write that died before its rename
    tracker_tmp.write_text("7\n")
    for path in (trash / "state", trash, tracker_tmp):
        _old(path)  # crash leftovers from two days ago: dead by any age rule
    live = root / ".tmp-step_00000003-0123456789ab"
    (live / "state").mkdir(parents=True)
    _layout.write_owner(live)  # owned by this (live) process: a save that timed out
    out = cli("verify", root)
    no_traceback(out, "verify with crash leftovers")
    unreported = [p.name for p in (trash, tracker_tmp, live) if p.name not in out.output]
    assert not unreported, f"verify did not report the leftovers {unreported}\n{out.output}"
    out = cli("gc", root)
    no_traceback(out, "gc with crash leftovers")
    left = [p.name for p in (trash, tracker_tmp) if p.exists()]
    assert not left, f"gc left the dead leftovers {left}\n{out.output}"
    assert live.exists(), "gc removed the temp dir of a live owner"
    assert committed_on_disk(root) == ["step_00000001", "step_00000002"]


def test_gc_removing_trash_that_a_background_delete_empties_meanwhile_succeeds(
    tmp_path, monkeypatch
):
    """A job's background trash delete (retention.DELETER) and ``gc`` may empty the same trash
    directory at once: a file the other removed first is what gc wanted, never an error (seen:
    FileNotFoundError out of gc)."""
    from ckptguard.ops import gc as _gc

    root = tiny_root(tmp_path / "ck", (1, 2))
    trash = root / ".trash-step_00000000-0badf00d"
    (trash / "state").mkdir(parents=True)
    for i in range(20):
        (trash / "state" / f"part_{i:02d}").write_bytes(b"x")
    for path in (trash / "state", trash):
        _old(path)
    real_unlink = os.unlink

    def raced(path, *args, **kwargs):  # the other deleter got there first
        real_unlink(path, *args, **kwargs)
        real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", raced)
    report = _gc.gc(root, _layout.StepNaming("step_{step:08d}"))
    monkeypatch.setattr(os, "unlink", real_unlink)
    assert not trash.exists() and any(p == trash for p, _ in report.removed), report
    assert committed_on_disk(root) == ["step_00000001", "step_00000002"]


def test_gc_says_what_carries_a_step_name_without_being_a_step_directory(tmp_path):
    root = tiny_root(tmp_path / "ck", (1, 2))
    (root / "step_00000007").write_text("notes")  # a file with a step's name
    (root / "step_00000008").symlink_to(root / "step_00000007")  # a link to a file
    result = cli("gc", root)
    assert result.exit_code == 0, result.output
    for name in ("step_00000007", "step_00000008"):
        assert f"kept    {root / name}: a step's name on something that is not a directory" in (
            result.output
        )
    assert (root / "step_00000007").read_text() == "notes" and (root / "step_00000008").is_symlink()
    assert committed_on_disk(root) == ["step_00000001", "step_00000002"]


def test_orphans_never_removes_a_step_when_the_tracker_vanishes_after_the_early_check(tmp_path):
    """gc --orphans refuses a root without a tracker up front; a tracker gone between that check
    and the survey (a hand edit, a restore of the root meanwhile) must not turn every committed step
    into an orphan: the survey judges against the tracker it reads itself (cold review)."""
    from ckptguard.errors import ConfigError
    from ckptguard.ops import gc as _gc

    root = tiny_root(tmp_path / "ck", (1, 2, 3))

    class Vanishing(_gc.DirRoot):
        def check_idle(self) -> None:  # runs after check_orphans, before the survey
            super().check_idle()
            (root / TRACKER).unlink()

    target = Vanishing(root, _layout.StepNaming("step_{step:08d}"), max_age_s=3600, ttl_s=3600)
    with pytest.raises(ConfigError, match="has no tracker"):
        _gc.collect(target, orphans=True)
    assert committed_on_disk(root) == ["step_00000001", "step_00000002", "step_00000003"]


# ---------------------------------------------------------------- the retention warning


def test_the_retention_warning_for_an_incomplete_step_is_actionable(tmp_path, caplog):
    root = tmp_path / "ck"
    mgr = _mgr(root, 3)
    mgr.save(1, _w(1))
    mgr.save(2, _w(2))
    (root / "step_00000001" / "rank_00000.pt").unlink()  # incomplete, manifest still there
    caplog.set_level(logging.WARNING, logger="ckptguard")
    mgr.save(3, _w(3))
    warnings = [r.getMessage() for r in caplog.records if "step_00000001" in r.getMessage()]
    assert warnings, f"retention did not report the incomplete step 1\n{caplog.text}"
    if any("gc" in w for w in warnings):
        result = cli("gc", root)
        no_traceback(result, "gc of an incomplete step")
        assert not step_dir(root, 1).exists(), (
            f"retention sends the user to gc for step 1 ({warnings[0]}), but gc keeps it\n"
            f"{result.output}"
        )


def test_list_marks_held_steps_with_their_reason(tmp_path):
    import json

    from click.testing import CliRunner

    from ckptguard.cli import main

    root = tmp_path / "ck"
    mgr = _mgr(root, 1)
    mgr.save(1, _w(1))
    mgr.hold(1, "evaluation job 7")
    mgr.save(2, _w(2))  # KeepLast(1): step 1 stays, held
    text = CliRunner().invoke(main, ["list", str(root)])
    assert text.exit_code == 0, text.output
    lines = {ln.split()[0]: ln for ln in text.output.splitlines()[1:]}
    assert lines["1"].endswith("[held: evaluation job 7]") and "held" not in lines["2"], text.output
    shown = json.loads(CliRunner().invoke(main, ["list", str(root), "--json"]).output)
    assert [(e["step"], e["held"]) for e in shown["entries"]] == [
        (1, "evaluation job 7"),
        (2, None),
    ]
