"""Growth: Theil-Sen, floors, and the leak test (known leak per step found within 10%, flat process
not flagged)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptguard.errors import ConfigError
from ckptguard.memory import GrowthConfig, analyze_growth, read_records, theil_sen
from ckptguard.memory.cli import mem

FIX = Path(__file__).parents[1] / "fixtures" / "memory"
LEAK = 4 << 20
STEPS = 25
PERIOD = 0.04


def test_theil_sen_is_robust_and_its_interval_covers_the_truth():
    x = list(range(30))
    y = [1000 + 50 * i for i in x]
    y[7] += 10**6  # one wild outlier (a transient peak that slipped into a floor)
    y[20] -= 10**6
    s = theil_sen(x, y)
    assert s.value == pytest.approx(50, rel=1e-9)
    assert s.low <= 50 <= s.high and s.points == 30
    flat = theil_sen(x, [5, 6] * 15)
    assert flat.low <= 0 <= flat.high
    assert theil_sen([1, 1, 1], [1, 2, 3]) is None


def test_growth_config_validation():
    with pytest.raises(ConfigError, match="confidence"):
        GrowthConfig(confidence=1.0)
    with pytest.raises(ConfigError, match="min_points"):
        GrowthConfig(min_points=2)


def _synthetic(pid_slopes, n=12, dt=1.0, with_steps=False):
    recs = []
    for i in range(n):
        t = int(i * dt * 1e9)
        procs = [
            {"pid": pid, "comm": f"p{pid}", "argv0": "python", "pss": 10**8 + int(slope * i)}
            for pid, slope in pid_slopes.items()
        ]
        recs.append(
            {
                "v": 1,
                "kind": "sample",
                "mono_ns": t + 1,
                "node": "n",
                "pid": 9,
                "procs": procs,
                "ray": {"used": 10**9 + i * 10**7, "threshold_bytes": 2 * 10**9},
            }
        )
        if with_steps:
            recs.append(
                {
                    "v": 1,
                    "kind": "phase_start",
                    "mono_ns": t,
                    "node": "n",
                    "pid": 9,
                    "step": i,
                    "phase": "update",
                }
            )
    return sorted(recs, key=lambda r: r["mono_ns"])


def test_per_interval_verdict_and_node_hint_without_steps():
    rep = analyze_growth(_synthetic({1: 100_000, 2: 0}), GrowthConfig(interval_s=1.0))
    by = {p.pid: p for p in rep.processes}
    assert by[1].basis == "per_second" and by[1].rising
    assert by[1].slope_bytes_per_s == pytest.approx(100_000)
    assert not by[2].rising and by[2].slope_bytes_per_s == 0
    # Node: 1e7 B/s towards a 2e9 threshold from 1.11e9: a HINT of about 89 s, labelled as such.
    assert rep.node.hint_seconds_to_limit == pytest.approx(89, abs=1.5)
    assert "HINT ONLY" in rep.node.hint_label


def test_slow_rise_below_the_noise_floor_is_not_rising():
    rep = analyze_growth(_synthetic({1: 1000}), GrowthConfig(interval_s=1.0))
    assert not rep.processes[0].rising and "noise floor" in rep.processes[0].reason


def test_a_steep_slope_of_a_few_kib_over_a_short_watch_is_not_rising():
    # 30 KiB/s, well above the 4 KiB/s floor, for 1.1 s: 33 KiB in all, PSS jitter (a process
    # sharing its libraries exits), as a flat process showed on a loaded CI runner.
    short = analyze_growth(_synthetic({1: 3_000}, dt=0.1), GrowthConfig(interval_s=0.1))
    assert not short.processes[0].rising and "over the span judged" in short.processes[0].reason
    # The same slope kept up for a minute adds up to 1.8 MB: rising.
    long = analyze_growth(_synthetic({1: 30_000}, n=60), GrowthConfig(interval_s=1.0))
    assert long.processes[0].rising
    assert (
        analyze_growth(
            _synthetic({1: 30_000}, n=60), GrowthConfig(interval_s=1.0, min_rise_bytes=2 << 20)
        )
        .processes[0]
        .rising
        is False
    )
    with pytest.raises(ConfigError, match="min_rise_bytes"):
        GrowthConfig(min_rise_bytes=-1)


def test_too_few_points_gives_no_verdict():
    rep = analyze_growth(_synthetic({1: 10**7}, n=3), GrowthConfig(interval_s=1.0))
    assert not rep.processes[0].rising and "fewer than" in rep.processes[0].reason


def test_leak_found_within_10_percent_per_step_and_per_second_flat_not_flagged(tmp_path):
    watch_file, phase_file = tmp_path / "watch.jsonl", tmp_path / "phases.jsonl"
    cmd = [
        sys.executable,
        str(FIX / "leak_workload.py"),
        str(phase_file),
        str(LEAK),
        str(STEPS),
        str(PERIOD),
        str(watch_file),  # each step lasts until the watcher sampled it
    ]
    result = CliRunner().invoke(
        mem, ["watch", "--interval", "0.02", "--out", str(watch_file), "--", *cmd]
    )
    assert result.exit_code == 0, result.output

    recs = read_records([watch_file, phase_file])
    starts = sorted(r["mono_ns"] for r in recs if r["kind"] == "phase_start")
    assert len(starts) == STEPS
    # The rate the job actually ran at, by the estimator the verdict uses (Theil-Sen, a median):
    # the mean from first to last step would move with one step a loaded runner stretched.
    fit = theil_sen([t / 1e9 for t in starts], [k * LEAK for k in range(STEPS)])
    assert fit is not None
    true_per_s = fit.value

    result = CliRunner().invoke(mem, ["growth", "--json", str(watch_file), str(phase_file)])
    assert result.exit_code == 1, result.output  # exit 1: something is rising
    procs = json.loads(result.output)["processes"]
    assert len(procs) == 2 and all(
        {"pid", "comm", "slope_bytes_per_s", "rising"} <= set(p) for p in procs
    )
    leaker = next(p for p in procs if p["rising"])
    flat = next(p for p in procs if not p["rising"])
    assert leaker["pid"] == next(r["root_pid"] for r in recs if r["kind"] == "watch_start")
    assert leaker["slope_bytes_per_step"] == pytest.approx(LEAK, rel=0.10)
    assert leaker["slope_bytes_per_s"] == pytest.approx(true_per_s, rel=0.10)
    assert leaker["basis"] == "per_step" and len(leaker["floors_per_step"]) >= STEPS - 1
    assert (
        abs(flat["slope_bytes_per_step"]) < LEAK / 20
        and abs(flat["slope_bytes_per_s"]) < true_per_s / 20
    )

    text = CliRunner().invoke(mem, ["growth", str(watch_file), str(phase_file)])
    assert (
        "RISING" in text.output and "flat" in text.output and f"{STEPS} steps seen" in text.output
    )

    # The watch file alone (no steps): per-interval floors still find the same leak.
    only = {
        p.pid: p
        for p in analyze_growth(read_records([watch_file]), GrowthConfig(skip_s=0.3)).processes
    }
    assert only[leaker["pid"]].basis == "per_second" and only[leaker["pid"]].rising
    assert not only[flat["pid"]].rising
    watch_end = recs[-1]
    assert watch_end["kind"] == "watch_end" and watch_end["exit_code"] == 0


def test_watch_reports_the_commands_exit_and_signal(tmp_path):
    out = tmp_path / "w.jsonl"
    r = CliRunner().invoke(
        mem,
        [
            "watch",
            "--interval",
            "0.05",
            "--out",
            str(out),
            "--",
            sys.executable,
            "-c",
            "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
        ],
    )
    assert r.exit_code == 128 + 9
    end = read_records([out])[-1]
    assert end["kind"] == "watch_end" and end["signal"] == 9
    sample = next(x for x in read_records([out]) if x["kind"] == "sample")
    assert sample["host"]["mem_total"] > 0 and "ray" in sample
    r = CliRunner().invoke(mem, ["watch", "--out", str(out), "--", "/nonexistent/cmd"])
    assert r.exit_code == 2 and "could not start" in r.output
