"""Where a restore's time goes besides the read (issue 41 item 5): the 556M model of
bench_train_loop.py saved once, the page cache dropped, then the restore as the bench times it (a
new manager, restore, close) under cProfile, with the read's own seconds, the restore call and the
close timed apart.

    python benchmarks/results/issue41_h100/profile_restore.py --out $OUT/profile_restore.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "src"))

from benchmarks import bench_train_loop as b

import ckptguard as cg
from ckptguard.storage.streaming import StreamingStorage


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/cg-profile-restore"))
    ap.add_argument(
        "--ab",
        type=int,
        default=0,
        help="pairs of restores: staging prepared at once / after the load",
    )
    b.add_model_args(ap)
    a = ap.parse_args()
    device = torch.device("cuda")
    shutil.rmtree(a.dir, ignore_errors=True)
    job = b.Job(a, device, seed=0)
    job.step()
    mgr = cg.CheckpointManager(a.dir, config=cg.CheckpointConfig(retention=None))
    mgr.save(1, job.state())
    mgr.close()
    lines = []
    variants = ["profiled"] + ["staging at once", "staging after the load"] * a.ab
    for run, variant in enumerate(variants):
        fresh = b.Job(a, device, seed=7)
        fresh.step()
        same = b.same_files_read(a.dir / "step_00000001")
        b.drop_cache(a.dir)
        torch.cuda.synchronize()
        storage = StreamingStorage()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        if variant == "profiled":
            prof.enable()
        m = cg.CheckpointManager(a.dir, config=cg.CheckpointConfig(retention=None), storage=storage)
        known = m.queue.known
        if (
            variant == "staging after the load"
        ):  # what restore would do with the staging prepared after its read
            m.queue.known = lambda *args, **kw: None  # type: ignore[method-assign]
        t1 = time.perf_counter()
        m.restore(fresh.state())
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if variant == "staging after the load":
            known(fresh.state(), m._ctx)
        m.close()
        t3 = time.perf_counter()
        prof.disable()
        read = storage.last_stats.seconds if storage.last_stats else float("nan")
        lines.append(
            f"run {run} ({variant}): construct {t1 - t0:.3f} s, restore {t2 - t1:.3f} s (read "
            f"{read:.3f} s), close {t3 - t2:.3f} s; a cold read of the same files just before: "
            f"{same['seconds']:.3f} s (restore {same['seconds'] / (t2 - t1):.3f}x)"
        )
        print(lines[-1], flush=True)
        if variant == "profiled":
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(45)
            lines.append(s.getvalue())
        del fresh
    a.out.write_text("\n".join(lines))
    print("\n".join(line for line in lines if line.startswith("run")))


if __name__ == "__main__":
    main()
