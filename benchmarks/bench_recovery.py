"""Recovery time from the in-memory tier against the persistent tier, and what the fast tier's saves
cost.

A GPT-style transformer (fp32 parameters, bf16 autocast, fused AdamW; the default config is issue
19's, ~553M parameters, 6.2 GiB of model + optimizer) trains on one GPU under a
``TieredCheckpoint`` with the fast tier in memory (``/dev/shm``, a tmpfs) and the persistent tier
on the local disk. Measured in one run:

- the loop without saves (p50 step time), then the same loop saving the fast tier every
  ``--fast-every`` steps: the blocking time of each fast save and the loop's overhead;
- ``restore`` of the newest step from the fast tier (the manager picks it: both tiers hold it);
- ``restore`` from the persistent tier after the fast tier is gone (the manager falls back to it),
  with a cold page cache: every file of the step is fsynced and dropped from the cache with
  ``posix_fadvise(POSIX_FADV_DONTNEED)`` first (no drop_caches; the figure names the method);
- this disk's own cold sequential read and a tmpfs read of as many bytes, as references;
- that each restore is bitwise exact (every tensor against a host copy taken at the save).

    python benchmarks/bench_recovery.py --out $OUT/recovery.json
    python benchmarks/bench_recovery.py --tiny --out /tmp/recovery.json  # CPU, correctness only
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

# The same model as issue 19's benchmark (this script's folder is on sys.path).
from bench_train_loop import TINY_MODEL, Job, add_model_args

import ckptguard as cg
from ckptguard import ProofPlan

GiB = 1 << 30


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def drop_cache(path: Path) -> int:
    """fsync and POSIX_FADV_DONTNEED every file under ``path``: the next read comes from the
    disk."""
    n = 0
    for f in path.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
    return n


def raw_read(directory: Path, nbytes: int, *, cold: bool) -> float:
    """GiB/s of a sequential read of one ``nbytes`` file written and fsynced under ``directory``."""
    path = directory / "raw-read.bin"
    block = os.urandom(64 << 20)
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            left -= f.write(block[: min(left, len(block))])
        f.flush()
        os.fsync(f.fileno())
    if cold:
        drop_cache(directory)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(64 << 20):
            pass
    seconds = time.perf_counter() - start
    path.unlink()
    return nbytes / GiB / seconds


def exact(job: Job, ref: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(t.cpu(), ref[k]) for k, t in job.tensors().items())


def scramble(job: Job) -> None:
    """Overwrite the live state, so a restore that loaded nothing cannot pass as exact."""
    with torch.no_grad():
        for t in job.tensors().values():
            if t.is_floating_point():
                t.fill_(0.5)


def timed_restore(tiers: cg.TieredCheckpoint, job: Job) -> tuple[float, int]:
    sync(job.device)
    start = time.perf_counter()
    step = tiers.restore(job.state())
    sync(job.device)
    return time.perf_counter() - start, step


def tier_of_last_restore(root: Path) -> str:
    lines = (root / "proof" / "rank_00000.jsonl").read_text().splitlines()
    return next(json.loads(x) for x in reversed(lines) if '"restore"' in x)["tier"]


def plain_restores(job: Job, ref: dict[str, torch.Tensor], directory: Path) -> dict[str, Any]:
    """The same tensors saved and restored without ckptguard, on the same disk, each read with a
    cold cache: plain DCP (``dcp.save``/``dcp.load`` into the live tensors) and
    ``torch.save``/``torch.load`` (to the CPU, then copied into the live tensors, as a user's resume
    does)."""
    import torch.distributed.checkpoint as dcp

    out: dict[str, Any] = {}
    directory.mkdir(parents=True, exist_ok=True)
    tensors = job.tensors()
    t = time.perf_counter()
    dcp.save(tensors, checkpoint_id=str(directory / "dcp"))
    out["dcp_save_s"] = round(time.perf_counter() - t, 3)
    drop_cache(directory)
    scramble(job)
    sync(job.device)
    t = time.perf_counter()
    dcp.load(tensors, checkpoint_id=str(directory / "dcp"))
    sync(job.device)
    out["dcp_restore_s"] = round(time.perf_counter() - t, 3)
    out["dcp_exact"] = exact(job, ref)
    t = time.perf_counter()
    torch.save({k: v.detach().cpu() for k, v in tensors.items()}, directory / "state.pt")
    out["torch_save_s"] = round(time.perf_counter() - t, 3)
    drop_cache(directory)
    scramble(job)
    sync(job.device)
    t = time.perf_counter()
    loaded = torch.load(directory / "state.pt", weights_only=True, mmap=False)
    with torch.no_grad():
        for k, v in tensors.items():
            v.copy_(loaded[k])
    sync(job.device)
    out["torch_load_restore_s"] = round(time.perf_counter() - t, 3)
    out["torch_load_exact"] = exact(job, ref)
    del loaded
    shutil.rmtree(directory, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--fast-dir", type=Path, default=Path("/dev/shm/cg-recovery-fast"))
    ap.add_argument("--persistent-dir", type=Path, default=Path("/tmp/cg-recovery-persistent"))
    add_model_args(ap)
    ap.add_argument("--fast-every", type=int, default=10)
    ap.add_argument("--saves", type=int, default=3, help="fast saves in the measured loop")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="CPU, tiny sizes: correctness only")
    ap.add_argument(
        "--async",
        dest="use_async",
        action="store_true",
        help="the loop saves with TieredCheckpoint.save_async (both tiers' "
        "pools prepared first with "
        "TieredCheckpoint.prepare_async) instead of the synchronous save",
    )
    ap.add_argument(
        "--references",
        action="store_true",
        help="also restore the same tensors with plain DCP (dcp.save/dcp.load) "
        "and torch.save/torch.load "
        "on the same disk, cold cache, in this run",
    )
    a = ap.parse_args()
    if a.tiny:
        vars(a).update(TINY_MODEL)
        a.fast_every, a.saves = 3, 2
        a.fast_dir, a.persistent_dir = (
            Path(str(a.fast_dir) + "-tiny"),
            Path(str(a.persistent_dir) + "-tiny"),
        )
    device = torch.device("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    for d in (a.fast_dir, a.persistent_dir):
        shutil.rmtree(d, ignore_errors=True)
    job = Job(a, device, seed=0)
    for _ in range(a.warmup):
        job.step()
    nbytes = sum(t.numel() * t.element_size() for t in job.tensors().values())
    shm_free = shutil.disk_usage(a.fast_dir.parent).free
    if shm_free < 2.5 * nbytes:
        raise SystemExit(
            f"{a.fast_dir.parent} has {shm_free / GiB:.1f} GiB free; the fast tier needs "
            f"{2.5 * nbytes / GiB:.1f} GiB (two kept steps and a save in flight)"
        )
    steps = a.fast_every * a.saves
    base_steps = []
    for _ in range(steps):
        t = time.perf_counter()
        job.step()
        base_steps.append(time.perf_counter() - t)
    cfg = cg.CheckpointConfig(timeout_s=600, proof=ProofPlan(record=True))
    tiers = cg.TieredCheckpoint(
        a.fast_dir,
        persistent=a.persistent_dir,
        fast_every=a.fast_every,
        persistent_every=steps,
        config=cfg,
    )
    prepared_s = None
    if a.use_async:  # each tier's staging pool mapped and pinned off the loop, before it starts
        t = time.perf_counter()
        tiers.prepare_async(job.state()).result()
        prepared_s = time.perf_counter() - t
    loop_start = time.perf_counter()
    fast_saves, loop_steps = [], []
    persistent_s = None
    for step in range(1, steps + 1):
        t = time.perf_counter()
        job.step()
        loop_steps.append(time.perf_counter() - t)
        t = time.perf_counter()
        if step % a.fast_every == 0 and step != steps:
            if a.use_async:
                tiers.save_async(step, job.state())
            else:
                tiers.save(step, job.state())
            fast_saves.append(time.perf_counter() - t)
    loop_s = time.perf_counter() - loop_start
    ref = {
        k: v.detach().cpu().clone() for k, v in job.tensors().items()
    }  # the state of the last step
    wait_s = None
    if a.use_async:
        t = time.perf_counter()
        tiers.wait()
        wait_s = time.perf_counter() - t
    busy = {"skipped_total": tiers.busy.skipped_total} if a.use_async else None
    # The last step goes to both tiers: timed apart, so the loop figure holds fast saves only.
    t = time.perf_counter()
    tiers.fast.save(steps, job.state())
    fast_saves.append(time.perf_counter() - t)
    t = time.perf_counter()
    tiers.persistent.save(steps, job.state())  # type: ignore[union-attr]
    persistent_s = time.perf_counter() - t
    del tiers
    p50 = statistics.median(base_steps)

    # Recovery: a new manager, as a restarted job builds it; the state scrambled first.
    results: dict[str, Any] = {}
    for tier in ("fast", "persistent"):
        if tier == "persistent":
            shutil.rmtree(a.fast_dir)  # the node's memory is gone: only the persistent tier is left
            files = drop_cache(a.persistent_dir)
        scramble(job)
        mgr = cg.TieredCheckpoint(
            a.fast_dir,
            persistent=a.persistent_dir,
            fast_every=a.fast_every,
            persistent_every=steps,
            config=cfg,
        )
        seconds, step = timed_restore(mgr, job)
        results[tier] = {
            "seconds": round(seconds, 3),
            "gib_s": round(nbytes / GiB / seconds, 3),
            "step": step,
            "tier_recorded": tier_of_last_restore(a.persistent_dir),
            "bitwise_exact": exact(job, ref),
        }
        if tier == "persistent":
            results[tier]["cold_cache"] = (
                f"fsync + posix_fadvise(POSIX_FADV_DONTNEED) on {files} files"
            )
    references = plain_restores(job, ref, a.persistent_dir / "plain") if a.references else None
    disk_cold = raw_read(a.persistent_dir, nbytes, cold=True)
    disk_warm = raw_read(
        a.persistent_dir, nbytes, cold=False
    )  # if close to the cold figure, the drop failed
    shm_read = raw_read(a.fast_dir.parent, nbytes, cold=False)
    out = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "params": sum(p.numel() for p in job.model.parameters()),
        "state_gib": round(nbytes / GiB, 3),
        "fast_dir": str(a.fast_dir),
        "persistent_dir": str(a.persistent_dir),
        "restore": results,
        "restore_speedup_fast_over_persistent": round(
            results["persistent"]["seconds"] / results["fast"]["seconds"], 2
        ),
        "reference_gib_s": {
            "disk_cold_read": round(disk_cold, 3),
            "disk_warm_read": round(disk_warm, 3),
            "tmpfs_read": round(shm_read, 3),
        },
        "restore_vs_reference": {
            "fast_vs_tmpfs_read": round(results["fast"]["gib_s"] / shm_read, 3),
            "persistent_vs_disk_cold_read": round(results["persistent"]["gib_s"] / disk_cold, 3),
        },
        "train": {
            "step_p50_s": round(p50, 4),
            "fast_every": a.fast_every,
            "fast_save_s": [round(x, 3) for x in fast_saves],
            "persistent_save_s": round(persistent_s, 3),
            "loop_s_with_fast_saves": round(loop_s, 3),
            "loop_s_without": round(sum(base_steps), 3),
            "loop_overhead": round(loop_s / sum(base_steps) - 1, 3),
            "step_p50_s_with_saves": round(statistics.median(loop_steps), 4),
            "step_max_s_with_saves": round(max(loop_steps), 4),
            "steps_sum_s_with_saves": round(sum(loop_steps), 3),
            "overhead_per_save_in_steps": round(statistics.median(fast_saves) / p50, 1),
            "mode": "save_async" if a.use_async else "save",
            "pools_prepared_s": None if prepared_s is None else round(prepared_s, 3),
            "wait_after_loop_s": None if wait_s is None else round(wait_s, 3),
            "busy": busy,
        },
        "references": references,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    for d in (a.fast_dir, a.persistent_dir):
        shutil.rmtree(d, ignore_errors=True)
    if not all(r["bitwise_exact"] and r["step"] == steps for r in results.values()):
        raise SystemExit("a restore was not bitwise exact or not the newest step")
    if [results[t]["tier_recorded"] for t in ("fast", "persistent")] != ["fast", "persistent"]:
        raise SystemExit(f"restores used the wrong tiers: {results}")


if __name__ == "__main__":
    main()
