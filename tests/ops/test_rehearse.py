"""``ckptguard rehearse`` on a 2-rank torchrun job: two kills of the whole process tree, two proven
resumes.

torchrun (2.13) starts its workers in their own sessions; a kill of the launcher's process group
would leave them running. Every kill here must leave no process of the killed run alive.
"""

from __future__ import annotations

import json
import subprocess
import sys

from ckptguard.ops._proctree import alive


def test_rehearse_kills_whole_torchrun_trees_and_fails_a_lost_prefetch(tmp_path):
    root = tmp_path / "ck"
    job = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "ckptguard.demo.loops",
        "--root",
        str(root),
        "--steps",
        "100000",
        "--save-every",
        "2",
        "--prefetch",
        "lost",
        "--sleep",
        "0.02",
    ]
    cmd = [
        sys.executable,
        "-m",
        "ckptguard.cli",
        "rehearse",
        "--root",
        str(root),
        "--timeout",
        "120",
        "--json",
        "--",
        *job,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    kills = out["kills"]
    assert "past a committed save" in kills[0]["when"] and kills[1]["when"] == "mid-write of a save"
    assert kills[1]["tracker"] == kills[0]["tracker"]  # the save killed mid-write never committed
    assert kills[2]["tracker"] > kills[0]["tracker"]  # the last run resumed and saved again
    for kill in kills:  # torchrun and both workers each time, and none of them left
        assert len(kill["pids"]) >= 3 and kill["survivors"] == []
        assert not [pid for pid in kill["pids"] if alive(pid)]
    assert out["passed"] is False and len(out["resumes"]) == 2
    for resume in out["resumes"]:
        assert resume["verdict"] == "resume NOT proven: data order identical (FAIL)", resume
        data = next(g for g in resume["gates"] if g["gate"] == "data order identical")
        first = out["step"] + 1
        assert f"step {first} (first replayed step {first})" in data["evidence"], data["evidence"]
        # The hint names the state to add. Which kind it guesses needs two replayed steps to tell a
        # lost prefetch from a replayed stream; under load the killed run may have recorded only
        # one.
        assert "state[" in data["evidence"], data["evidence"]


def _rehearse_shuffled(tmp_path, sampler: str) -> dict:
    root = tmp_path / sampler / "ck"
    job = [
        sys.executable,
        "-m",
        "ckptguard.demo.loops",
        "--root",
        str(root),
        "--steps",
        "100000",
        "--save-every",
        "2",
        "--sampler",
        sampler,
        "--record-epoch",
        "--sleep",
        "0.3",
    ]
    cmd = [
        sys.executable,
        "-m",
        "ckptguard.cli",
        "rehearse",
        "--root",
        str(root),
        "--timeout",
        "120",
        "--json",
        "--",
        *job,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_rehearse_goes_past_an_epoch_boundary_where_a_lost_sampler_generator_shows(tmp_path):
    # 3 steps per epoch, a save every 2: a kill right after the save's replay step would replay a
    # step of the same epoch, where a sampler whose generator is not in the state still draws the
    # right order
    lost = _rehearse_shuffled(tmp_path, "shuffle")
    assert "into the next epoch" in lost["kills"][0]["when"], lost["kills"][0]
    assert lost["passed"] is False, lost["verdict"]
    first = lost["resumes"][0]
    assert first["verdict"] == "resume NOT proven: data order identical (FAIL)", first
    data = next(g for g in first["gates"] if g["gate"] == "data order identical")
    assert "GeneratorState(sampler.generator)" in data["evidence"], data["evidence"]
    # the same job with the generator in the state: the replay crosses the epoch and is proven
    kept = _rehearse_shuffled(tmp_path, "shuffle+generator")
    assert "into the next epoch" in kept["kills"][0]["when"] and kept["passed"] is True, kept[
        "verdict"
    ]
    coverage = next(g for g in kept["resumes"][0]["gates"] if g["gate"] == "replay coverage")
    assert "epoch boundary: crossed" in coverage["evidence"] or "->" in coverage["evidence"], (
        coverage["evidence"]
    )
