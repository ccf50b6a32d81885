"""Cost of the divergence guard on an MoE-like state, as a share of the save.

Two gloo ranks on the CPU. Each rank holds replicated dense weights and its own experts
(EP = 2, EP-aware keys), SIZE GiB per rank in all, plus Adam state. The guard is timed
inside real saves (a wrapper around ckptguard._commit.snapshot.check_replicated), so the share is
guard time over the whole save of the same state, median of REPS saves.

    python benchmarks/bench_guard.py --size 1 --reps 3 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from ckptguard import StateOptions

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def _worker(rank: int, world: int, root: str, size_gib: float, reps: int) -> dict:
    import torch
    import torch.distributed as dist

    import ckptguard as cg
    from ckptguard._commit import snapshot as _commit

    n = int(size_gib * (1 << 30) / 4 / 8)
    torch.manual_seed(0)
    dense = {f"dense.{i}": torch.randn(n) for i in range(4)}
    torch.manual_seed(100 + rank)
    experts = {f"experts.{i}": torch.randn(n) for i in range(4)}
    state = {"model": {**dense, **experts}}
    timings: list[float] = []
    real = _commit.check_replicated

    def timed(*a, **kw):
        t = time.perf_counter()
        real(*a, **kw)
        timings.append(time.perf_counter() - t)

    _commit.check_replicated = timed
    group = dist.new_group([0, 1])
    mgr = cg.CheckpointManager(
        root,
        config=cg.CheckpointConfig(state=StateOptions(capture_rng=False), retention=cg.KeepLast(1)),
        expert_parallel=cg.ExpertParallel(group=group, patterns=(r"^model\.experts\.",)),
    )
    saves = []
    for step in range(1, reps + 1):
        t = time.perf_counter()
        mgr.save(step, state)
        saves.append(time.perf_counter() - t)
    return {"save_s": saves, "guard_s": timings, "bytes": 8 * n * 4}


def main() -> None:
    from ckptguard.testing import run_ranks, values

    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size", type=float, default=1.0, help="GiB of state per rank")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    a = ap.parse_args()
    root = tempfile.mkdtemp(prefix="bench-guard-", dir="/tmp")
    try:
        out = values(run_ranks(_worker, 2, root, a.size, a.reps, timeout=1800, pg_timeout_s=1800))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    save = statistics.median(out[0]["save_s"])
    guard = statistics.median(out[0]["guard_s"])
    gib = out[0]["bytes"] / (1 << 30)
    result = {
        "per_rank_gib": gib,
        "ranks": 2,
        "save_s_median": save,
        "guard_s_median": guard,
        "guard_s_per_gib": guard / gib,
        "guard_share_of_save": guard / save,
        "raw": out,
        "machine": f"{os.uname().nodename} {os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d"),
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "guard_cost.json").write_text(json.dumps(result, indent=1) + "\n")
    (a.out / "guard_cost.md").write_text(
        f"# Divergence guard cost ({gib:.2f} GiB per rank, 2 gloo ranks, EP=2, median of {a.reps} "
        f"saves)\n\n| save (s) | guard (s) | guard s/GiB | guard share of save "
        f"|\n|---|---|---|---|\n| {save:.2f} | {guard:.3f} | {guard / gib:.3f} | "
        f"{100 * guard / save:.1f}% |\n\n{result['machine']}, {result['date']}\n"
    )
    print(json.dumps({k: v for k, v in result.items() if k != "raw"}, indent=1))


if __name__ == "__main__":
    main()
