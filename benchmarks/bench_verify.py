"""verify --deep against a plain cold read of the same files.

Writes a checkpoint of SIZE GiB (CPU tensors) with CheckpointManager, then, REPS times
and interleaved: drop the page cache, read every file plainly (8 MiB reads, discarded);
drop the page cache, run verify_step(deep=True) (which reads and xxh3-hashes every file).
Reports the medians and their ratio. Needs root (for /proc/sys/vm/drop_caches).

    python benchmarks/bench_verify.py --dir /tmp/bench-verify --size 4 --reps 5 \\
        --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import time
from pathlib import Path

import torch

import ckptguard as cg
from ckptguard import StateOptions
from ckptguard._records.checks import verify_step


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def plain_read(step_dir: Path) -> int:
    total = 0
    for path in sorted(p for p in step_dir.rglob("*") if p.is_file()):
        with open(path, "rb", buffering=0) as f:
            while block := f.read(8 << 20):
                total += len(block)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dir", type=Path, default=Path("/tmp/bench-verify"))
    ap.add_argument("--size", type=float, default=4.0, help="GiB of tensor state")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    a = ap.parse_args()
    shutil.rmtree(a.dir, ignore_errors=True)
    n = int(a.size * (1 << 30) // 4 // 8)
    state = {f"t{i}": torch.randn(n) for i in range(8)}
    mgr = cg.CheckpointManager(
        a.dir, config=cg.CheckpointConfig(state=StateOptions(capture_rng=False))
    )
    step_dir = mgr.save(1, state)
    del state
    nbytes = sum(p.stat().st_size for p in step_dir.rglob("*") if p.is_file())
    plain, deep = [], []
    for _ in range(a.reps):
        drop_caches()
        t = time.perf_counter()
        plain_read(step_dir)
        plain.append(time.perf_counter() - t)
        drop_caches()
        t = time.perf_counter()
        findings = verify_step(step_dir, deep=True)
        deep.append(time.perf_counter() - t)
        assert findings == [], findings
    gib = nbytes / (1 << 30)
    result = {
        "bytes": nbytes,
        "reps": a.reps,
        "plain_read_s": plain,
        "verify_deep_s": deep,
        "plain_read_gib_s_median": gib / statistics.median(plain),
        "verify_deep_gib_s_median": gib / statistics.median(deep),
        "ratio_verify_over_plain": statistics.median(plain) / statistics.median(deep),
        "machine": f"{platform.node()} {os.cpu_count()} cores",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "verify_deep.json").write_text(json.dumps(result, indent=1) + "\n")
    (a.out / "verify_deep.md").write_text(
        f"# verify --deep vs plain cold read ({gib:.2f} GiB, median of {a.reps}, page cache "
        f"dropped before each)\n\n| method | median s | GiB/s |\n|---|---|---|\n| plain read | "
        f"{statistics.median(plain):.2f} | {result['plain_read_gib_s_median']:.2f} |\n| verify "
        f"--deep | {statistics.median(deep):.2f} | {result['verify_deep_gib_s_median']:.2f} "
        f"|\n\nratio verify/plain throughput: **{result['ratio_verify_over_plain']:.3f}** (target "
        f">= 0.9)\n\n{result['machine']}, torch {result['torch']}, {result['date']}\n"
    )
    shutil.rmtree(a.dir, ignore_errors=True)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
