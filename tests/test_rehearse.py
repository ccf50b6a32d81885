"""``ckptguard rehearse`` on a 2-rank torchrun job: two kills of the whole process tree, two proven resumes.

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
    job = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "ckptguard.demo.loops", "--root", str(root), "--steps", "100000", "--save-every", "2",
           "--prefetch", "lost", "--sleep", "0.02"]
    cmd = [sys.executable, "-m", "ckptguard.cli", "rehearse", "--root", str(root), "--timeout", "120", "--json", "--",
           *job]
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
        # The hint names the state to add. Which kind it guesses needs two replayed steps to tell a lost
        # prefetch from a replayed stream; under load the killed run may have recorded only one.
        assert "state[" in data["evidence"], data["evidence"]
