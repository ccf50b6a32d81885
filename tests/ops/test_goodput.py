"""ckptguard goodput: recovery times and lost steps of a run killed three times, against what the
test measured from outside the job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptguard.cli import main
from ckptguard.ops.goodput import goodput, young_daly

JOB = Path(__file__).parents[1] / "goodput_job.py"


def _launch(root: Path, last: int, hang_at: int) -> dict:
    """Run the job until it hangs at ``hang_at`` (then SIGKILL) or ends; what the test saw from
    outside."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.time()
    proc = subprocess.Popen(
        [sys.executable, str(JOB), str(root), str(last), str(hang_at)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    t1 = time.time()  # the process started (forked) between t0 and t1
    seen: dict = {"launched": (t0, t1), "steps": []}
    assert proc.stdout is not None
    for line in proc.stdout:
        word, *rest = line.split()
        if word == "restored":
            seen["restored"] = int(rest[0])
        elif word == "step":  # step, time printed, just before and just after record_step
            seen["steps"].append((int(rest[0]), *map(float, rest[1:4])))
            if int(rest[0]) == hang_at:
                proc.send_signal(signal.SIGKILL)
                break
    proc.wait(timeout=60)
    return seen


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("goodput") / "ck"
    seen = [_launch(root, 22, hang) for hang in (7, 13, 19, 0)]
    return root, seen


# Four job launches (each imports torch): a few seconds each on a quiet machine, a minute on a
# loaded one.
@pytest.mark.timeout(900)
def test_goodput_of_a_run_killed_three_times_matches_the_outside_view(killed_run):
    root, seen = killed_run
    g = goodput(root)
    assert len(g.launches) == 4 and g.failures == 3
    for before, after, launch in zip(seen, seen[1:], g.launches[1:], strict=False):
        assert launch.restored_step == after["restored"]
        assert (
            launch.lost_steps == before["steps"][-1][0] - after["restored"]
        )  # killed at its last printed step
    # recover_s: the process start (from /proc, whole clock ticks, rounded down) to the first step
    # record's time. The start lies between the times around Popen, the record's time between the
    # job's times around record_step; a tick either side for the /proc rounding.
    tick = 1.0 / os.sysconf("SC_CLK_TCK")
    for outside, launch in zip(seen, g.launches, strict=True):
        t0, t1 = outside["launched"]
        _, _, t_before, t_after = outside["steps"][0]
        assert t_before - t1 - tick <= launch.recover_s <= t_after - t0 + tick, (launch, outside)
        assert launch.startup_s + launch.restore_s + launch.to_first_step_s == pytest.approx(
            launch.recover_s
        )
    assert g.lost_steps == sum(x.lost_steps for x in g.launches[1:]) and g.lost_steps > 0
    assert 0 < g.ettr < 1 and g.step_s == pytest.approx(0.05, abs=0.04)
    assert g.interval_s == pytest.approx(max(young_daly(g.save_cost_s, g.mtbf_s), g.commit_s))


@pytest.mark.timeout(900)
def test_goodput_command(killed_run, tmp_path):
    root, _ = killed_run
    runner = CliRunner()
    out = runner.invoke(main, ["goodput", str(root), "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert data["failures"] == 3 and len(data["launches"]) == 4 and data["ettr"] > 0
    text = runner.invoke(main, ["goodput", str(root), "--mtbf", "3600"])
    assert (
        text.exit_code == 0 and "ETTR" in text.output and "MTBF 3600.0 s, declared" in text.output
    )
    (tmp_path / "empty").mkdir()
    none = runner.invoke(main, ["goodput", str(tmp_path / "empty")])
    assert (
        none.exit_code == 1 and "no proof records" in none.output and "Traceback" not in none.output
    )


def test_saves_coalesced_or_sent_to_the_fast_tier_are_counted_and_said(tmp_path):
    """Records as ``OnBusy.COALESCE`` and ``OnBusy.FAST_TIER`` write them: counted apart from the
    skipped ones."""
    proof = tmp_path / "proof"
    proof.mkdir()
    recs = [{"event": "step", "pid": 7, "time": 100.0 + s, "step": s} for s in range(1, 6)]
    recs += [
        {"event": "save", "pid": 7, "time": 101.5, "step": 1, "blocked_s": 0.01, "commit_s": 0.5},
        {"event": "busy_skip", "pid": 7, "time": 102.1, "step": 2},
        {"event": "busy_coalesced", "pid": 7, "time": 103.1, "step": 3, "by": 4},
        {"event": "busy_redirect", "pid": 7, "time": 104.1, "step": 4},
    ]
    (proof / "rank_00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    g = goodput(tmp_path)
    assert (g.skipped_saves, g.coalesced_saves, g.redirected_saves) == (1, 1, 1)
    out = CliRunner().invoke(main, ["goodput", str(tmp_path)])
    assert out.exit_code == 0, out.output
    assert (
        "1 save(s) skipped (1 coalesced (replaced in the queue), 1 to the fast tier only)"
        in out.output
    )
    data = json.loads(CliRunner().invoke(main, ["goodput", str(tmp_path), "--json"]).output)
    assert data["coalesced_saves"] == 1 and data["redirected_saves"] == 1
