"""Cost of ``CheckpointManager.record_step`` per call: a 64 x 2048 int64 token batch, its sample
ids, loss, grad_norm and one extra, appended to the proof log under an existing root.

CALLS calls after WARMUP; the per-call times' median, p90, p99 and mean. The batch lives on
``--device`` (cpu: hashed in place; cuda: through the overlapped pinned chunks).

    python benchmarks/bench_record_step.py --calls 2000 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import ckptguard as cg


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="where the checkpoint root goes (default: a temp dir)",
    )
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    a = ap.parse_args()
    base = Path(tempfile.mkdtemp(dir=a.dir, prefix="bench-record-step-"))
    root = base / "ck"
    root.mkdir()
    mgr = cg.CheckpointManager(root)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 50257, (64, 2048), generator=gen).to(a.device) for _ in range(8)]
    ids = [torch.arange(64) + 64 * i for i in range(8)]
    times = []
    for step in range(1, a.warmup + a.calls + 1):
        batch = batches[step % 8]
        t = time.perf_counter()
        mgr.record_step(
            step,
            sample_ids=ids[step % 8],
            batch=batch,
            loss=2.5 + 1e-3 * step,
            grad_norm=0.75,
            lr=3e-4,
        )
        times.append(time.perf_counter() - t)
    times = sorted(times[a.warmup :])
    q = lambda f: times[min(len(times) - 1, int(f * len(times)))]  # noqa: E731
    lines = (root / "proof" / "rank_00000.jsonl").read_text().splitlines()
    result = {
        "what": "CheckpointManager.record_step per call: 64 x 2048 int64 batch + 64 sample "
        "ids + loss, grad_norm, lr",
        "device": a.device,
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "filesystem_dir": str(base),
        "calls": a.calls,
        "median_ms": 1e3 * statistics.median(times),
        "p90_ms": 1e3 * q(0.90),
        "p99_ms": 1e3 * q(0.99),
        "mean_ms": 1e3 * statistics.fmean(times),
        "record_bytes": len(lines[-1]) + 1,
        "records": len(lines),
    }
    shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(result, indent=1))
    a.out.mkdir(parents=True, exist_ok=True)
    name = f"record_step_{'cpu' if a.device == 'cpu' else 'gpu'}.json"
    (a.out / name).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
