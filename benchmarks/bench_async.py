"""How long save_async blocks the caller, and whether that checkpoint commits and verifies.

On CUDA: SIZE GiB of fp32 in 256 MiB tensors on the GPU. A warm-up synchronous save, then
``save_async`` with the snapshot into spare GPU memory (async_gpu_bytes large enough) and,
separately, into host memory (async_gpu_bytes=0); each is waited for, verified with
``verify --deep`` and restored into fresh GPU tensors for a bitwise comparison.

    python benchmarks/bench_async.py --gib 8 --dir /tmp/ckptguard-async --out $OUT
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from ckptguard import AsyncOptions, StateOptions

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import ckptguard as cg
from ckptguard._records.checks import verify_step


def run(root: Path, state: dict, *, gpu_bytes: int, host_bytes: int) -> dict:
    shutil.rmtree(root, ignore_errors=True)
    cfg = cg.CheckpointConfig(
        async_save=AsyncOptions(gpu_bytes=gpu_bytes, host_bytes=host_bytes),
        state=StateOptions(capture_rng=False),
        retention=cg.KeepLast(1),
    )
    mgr = cg.CheckpointManager(root, config=cfg)
    mgr.save(1, state)  # warm-up: file creation paths, pools, imports
    expected = {k: v.clone() for k, v in state["w"].items()}
    t = time.perf_counter()
    pending = mgr.save_async(2, state)
    blocked = time.perf_counter() - t
    for t_ in state["w"].values():
        t_.add_(1.0)  # training goes on and changes the live tensors
    path = pending.wait()
    total = time.perf_counter() - t
    findings = verify_step(path, deep=True)
    fresh = {"w": {k: torch.empty_like(v) for k, v in state["w"].items()}}
    mgr.restore(fresh)
    exact = all(torch.equal(fresh["w"][k], expected[k]) for k in state["w"])
    return {
        "blocked_s": round(blocked, 4),
        "pending_reported_blocked_s": round(pending.blocked_seconds, 4),
        "until_committed_s": round(total, 3),
        "verify_deep_findings": [f.line() for f in findings],
        "restored_bitwise_equal_to_snapshot": exact,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/ckptguard-async"))
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    n = int(a.gib * (1 << 30) / (256 << 20))
    torch.manual_seed(0)
    state = {"w": {f"t{i}": torch.randn((256 << 20) // 4, device="cuda") for i in range(n)}}
    size = n * (256 << 20)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "gib": size / (1 << 30),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "snapshot_in_gpu_memory": run(
            a.dir / "gpu", state, gpu_bytes=size + (1 << 30), host_bytes=0
        ),
        "snapshot_in_host_memory": run(
            a.dir / "host", state, gpu_bytes=0, host_bytes=size + (1 << 30)
        ),
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "async_save.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
