"""``ckptguard verify ROOT --deep --restore`` of a root of STEPS small steps: wall and CPU time.

The issue's case: three steps of about 161 KiB took 188 s on a loaded node, one fresh restore
process (a torch import) per step. Each run is a new ``python -m ckptguard.cli`` process; CPU is
its own and its children's (getrusage). ``--pythonpath`` runs it against another checkout's
``src`` (the code before a change) with this interpreter and its torch.

    python benchmarks/bench_verify_restore.py --steps 3 --reps 3 \\
        --out benchmarks/results/verify_restore.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def build(root: Path, steps: int) -> int:
    import torch

    import ckptguard as cg

    mgr = cg.CheckpointManager(root, config=cg.CheckpointConfig(retention=None))
    model = torch.nn.Sequential(
        torch.nn.Linear(128, 128), torch.nn.Linear(128, 128)
    )  # ~130 KiB of weights
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, steps + 1):
        with torch.no_grad():
            model[0].weight.add_(1.0)
        mgr.save(step, {"model": model, "optim": opt})
    return sum(f.stat().st_size for f in root.rglob("step_*/**/*") if f.is_file()) // steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--pythonpath", default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if args.pythonpath:
        env["PYTHONPATH"] = args.pythonpath
    load_before = os.getloadavg()
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-verify-restore-") as tmp:
        per_step = build(Path(tmp) / "ck", args.steps)
        cmd = [
            sys.executable,
            "-m",
            "ckptguard.cli",
            "verify",
            str(Path(tmp) / "ck"),
            "--deep",
            "--restore",
        ]
        for _ in range(args.reps):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
            wall = time.perf_counter() - t0
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
            runs.append((wall, cpu))
    result = {
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "src": args.pythonpath or "this checkout",
        "steps": args.steps,
        "bytes_per_step": per_step,
        "reps": args.reps,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "wall_s": [round(w, 3) for w, _ in runs],
        "cpu_s": [round(c, 3) for _, c in runs],
        "wall_s_median": statistics.median(w for w, _ in runs),
        "cpu_s_median": statistics.median(c for _, c in runs),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
