"""Restore against a cold read of the same files, with and without this session's two changes (issue
41 item 5): the read-ahead of the rank's data file while the restore checks and plans
(``storage._pool.ReadAhead``), and the I/O pool making its buffers on demand. The 556M model of
bench_train_loop.py saved once; then, in rounds, each variant restores through a new manager (as a
new process would), the page cache dropped before it, and a cold sequential read of the same step's
files (64 MiB reads, one stream: bench_train_loop's yardstick) right before it. Variants, alternated
so the disk's drift hits them alike:

- ``committed``: the code as committed;
- ``no read-ahead``: ``_resume.restore._read_ahead`` replaced by a no-op;
- ``before``: no read-ahead, and every pool buffer made (pinned) at the pool's construction, as
  before.

    python benchmarks/results/issue41_h100/restore_ab.py --rounds 4 --out $OUT/restore_ab.json
    python benchmarks/results/issue41_h100/restore_ab.py --rounds 6 --variants committed,before \\
        --out $OUT/ab3.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "src"))

from benchmarks import bench_train_loop as b

import ckptguard as cg
from ckptguard._resume import restore as _restore
from ckptguard.storage import _pool
from ckptguard.storage.streaming import StreamingStorage

VARIANTS = ("committed", "no read-ahead", "before")


def _eager_pool(real_init):
    def init(self, *, count, size, pin, timeout_s):
        real_init(self, count=count, size=size, pin=pin, timeout_s=timeout_s)
        bufs = [self.get("eager") for _ in range(count)]
        for buf in bufs:
            self.put(buf)

    return init


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/cg-restore-ab"))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"a subset of {','.join(VARIANTS)}"
    )
    b.add_model_args(ap)
    a = ap.parse_args()
    variants = [v for v in a.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        ap.error(f"--variants: unknown {unknown}; known: {', '.join(VARIANTS)}")
    device = torch.device("cuda")
    shutil.rmtree(a.dir, ignore_errors=True)
    job = b.Job(a, device, seed=0)
    job.step()
    mgr = cg.CheckpointManager(a.dir, config=cg.CheckpointConfig(retention=None))
    mgr.save(1, job.state())
    mgr.close()
    reference = job.tensors()
    del job
    real_ahead, real_init = _restore._read_ahead, _pool.BufferPool.__init__
    runs = []
    for r in range(a.rounds):
        for variant in variants:
            _restore._read_ahead = (
                real_ahead if variant == "committed" else (lambda *args, **kw: None)
            )
            _pool.BufferPool.__init__ = _eager_pool(real_init) if variant == "before" else real_init
            fresh = b.Job(a, device, seed=7)
            fresh.step()
            same = b.same_files_read(a.dir / "step_00000001")
            b.drop_cache(a.dir)
            torch.cuda.synchronize()
            storage = StreamingStorage()
            m = cg.CheckpointManager(
                a.dir, config=cg.CheckpointConfig(retention=None), storage=storage
            )
            t = time.perf_counter()
            m.restore(fresh.state())
            torch.cuda.synchronize()
            restore_s = time.perf_counter() - t
            m.close()
            got = fresh.tensors()
            exact = all(torch.equal(got[k], reference[k]) for k in reference)
            run = {
                "round": r,
                "variant": variant,
                "restore_s": round(restore_s, 3),
                "read_s": round(storage.last_stats.seconds, 3) if storage.last_stats else None,
                "same_files_read_s": same["seconds"],
                "x_cold_read": round(same["seconds"] / restore_s, 3),
                "bitwise_exact": exact,
            }
            runs.append(run)
            print(json.dumps(run), flush=True)
            del fresh, got
    _restore._read_ahead, _pool.BufferPool.__init__ = real_ahead, real_init
    summary = {
        v: {
            "x_cold_read_median": statistics.median(
                x["x_cold_read"] for x in runs if x["variant"] == v
            ),
            "x_cold_read_min": min(x["x_cold_read"] for x in runs if x["variant"] == v),
            "restore_s_median": statistics.median(
                x["restore_s"] for x in runs if x["variant"] == v
            ),
        }
        for v in variants
    }
    out = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "runs": runs,
        "summary": summary,
    }
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
