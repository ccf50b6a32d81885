"""Cost of ``PreemptionGuard.step_boundary`` per call without a signal: the collective flag check
(one store exchange) that every rank pays every step, on ``--world`` gloo ranks on this host.

CALLS calls after WARMUP per rank; rank 0's median, p90, p99 and mean.

    python benchmarks/bench_preempt_boundary.py --world 2 --calls 500 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

import ckptguard as cg
from ckptguard.testing import run_ranks, values


def _rank(rank: int, world: int, root: str, calls: int, warmup: int) -> list[float]:
    mgr = cg.CheckpointManager(root)
    state = {"w": torch.zeros(4)}
    times = []
    with cg.PreemptionGuard(mgr, grace_s=60) as guard:
        for step in range(1, warmup + calls + 1):
            t = time.perf_counter()
            guard.step_boundary(step, state)
            times.append(time.perf_counter() - t)
    return times[warmup:]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-preempt-") as tmp:
        per_rank = values(
            run_ranks(_rank, a.world, str(Path(tmp) / "ck"), a.calls, a.warmup, timeout=600)
        )
    times = sorted(per_rank[0])
    q = lambda f: times[min(len(times) - 1, int(f * len(times)))]  # noqa: E731
    result = {
        "what": "PreemptionGuard.step_boundary without a signal (rank 0), seconds per call",
        "world": a.world,
        "calls": len(times),
        "median_s": q(0.5),
        "p90_s": q(0.9),
        "p99_s": q(0.99),
        "mean_s": sum(times) / len(times),
        "host": platform.node(),
        "cpus": __import__("os").cpu_count(),
        "torch": torch.__version__,
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"preempt_boundary_cpu_w{a.world}.json").write_text(
        json.dumps(result, indent=1) + "\n"
    )
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
