"""The ETTR that ``ckptguard goodput`` computes against the one measured from outside the job (CPU).

A toy job (restore, steps of ``--step-s`` seconds, a ``save_async`` every ``--every`` steps) is
killed with SIGKILL at random steps, ``--kills`` times, then runs to ``--steps``. From outside the
benchmark sees each launch's start (before Popen), every step line the job prints (with the job's
wall time) and the step each launch restored. Its ETTR: (sum over launches of the time from the
first step line after the restore to the launch's last step line, less the steps done again at the
median step time) / (first start to the last step line). The same figure from the records:
``goodput(root).ettr``; both printed with the recovery times and lost steps side by side.

    python benchmarks/bench_goodput.py --out benchmarks/results/goodput_cpu.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from ckptguard.ops.goodput import goodput

JOB = r"""
import sys, time
import torch
import ckptguard as cg
root, (last, hang_at, every), step_s = sys.argv[1], map(int, sys.argv[2:5]), float(sys.argv[5])
mgr = cg.CheckpointManager(root, config=cg.CheckpointConfig(retention=cg.KeepLast(2)))
state = {"w": torch.zeros(1 << 16), "step": 0}
start = mgr.restore(state)
mgr.prepare_async(state)
print(f"restored {start} {time.time():.6f}", flush=True)
for step in range(start + 1, last + 1):
    time.sleep(step_s)
    state["w"] += 1.0
    state["step"] = step
    mgr.record_step(step, loss=float(step))
    print(f"step {step} {time.time():.6f}", flush=True)
    if step == hang_at:
        time.sleep(600)
    if step % every == 0:
        mgr.save_async(step, state)
mgr.close()
"""


def launch(job: Path, root: Path, a: argparse.Namespace, hang_at: int) -> dict:
    t0 = time.time()
    proc = subprocess.Popen(
        [
            sys.executable,
            str(job),
            str(root),
            str(a.steps),
            str(hang_at),
            str(a.every),
            str(a.step_s),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "CKPTGUARD_QUIET": "1"},
    )
    seen: dict = {"launched": t0, "steps": []}
    assert proc.stdout is not None
    for line in proc.stdout:
        word, *rest = line.split()
        if word == "restored":
            seen["restored"] = int(rest[0])
        elif word == "step":
            seen["steps"].append((int(rest[0]), float(rest[1])))
            if int(rest[0]) == hang_at:
                proc.send_signal(signal.SIGKILL)
                break
    proc.wait(timeout=120)
    return seen


def outside_ettr(seen: list[dict]) -> dict:
    per = [
        (b[1] - a[1]) / (b[0] - a[0])
        for s in seen
        for a, b in itertools.pairwise(s["steps"])
        if b[0] > a[0]
    ]
    step_s = statistics.median(per)
    lost = [
        before["steps"][-1][0] - after["restored"] for before, after in itertools.pairwise(seen)
    ]
    training = sum(s["steps"][-1][1] - s["steps"][0][1] for s in seen)
    wall = seen[-1]["steps"][-1][1] - seen[0]["launched"]
    return {
        "ettr": (training - sum(lost) * step_s) / wall,
        "lost_steps": lost,
        "step_s": step_s,
        "wall_s": wall,
        "recover_s": [s["steps"][0][1] - s["launched"] for s in seen],
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--step-s", type=float, default=0.05)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    with tempfile.TemporaryDirectory(prefix="cg-goodput-") as tmp:
        job, root = Path(tmp) / "job.py", Path(tmp) / "ck"
        job.write_text(JOB)
        kills = sorted(rng.sample(range(a.every + 1, a.steps), a.kills))
        seen = [launch(job, root, a, k) for k in [*kills, 0]]
        g = goodput(root)
    out = outside_ettr(seen)
    res = {
        "command": " ".join(["python", *sys.argv]),
        "kills_at": kills,
        "outside": out,
        "goodput": {
            "ettr": g.ettr,
            "lost_steps": [x.lost_steps for x in g.launches[1:]],
            "step_s": g.step_s,
            "wall_s": g.wall_s,
            "recover_s": [x.recover_s for x in g.launches],
            "blocked_s": g.blocked_s,
            "skipped_saves": g.skipped_saves,
            "interval_s": g.interval_s,
            "interval_steps": g.interval_steps,
        },
    }
    res["ettr_difference"] = (
        abs(res["goodput"]["ettr"] - out["ettr"]) if g.ettr is not None else None
    )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
