"""End-to-end CheckpointManager.save of GPU state (digests, guard, storage, commit) against
plain DCP save and a raw write+fsync of the same bytes, on one GPU.

    python benchmarks/bench_manager_gpu.py --gib 8 --reps 2 --dir /tmp/ckptguard-mgr --out $OUT
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

import torch

from ckptguard import StateOptions

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import ckptguard as cg
from ckptguard._disk.digest import digest


def raw_write(state: dict, path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "raw.bin", "wb") as f:
        for t in state.values():
            f.write(memoryview(t.cpu().numpy()))
        f.flush()
        os.fsync(f.fileno())


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/ckptguard-mgr"))
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    n = int(a.gib * (1 << 30) / (256 << 20))
    torch.manual_seed(0)
    state = {f"t{i}": torch.randn((256 << 20) // 4, device="cuda") for i in range(n)}
    t = time.perf_counter()
    digest(state)
    digest_s = time.perf_counter() - t
    times: dict[str, list[float]] = {"raw": [], "manager": [], "dcp": []}
    for rep in range(a.reps):
        for method in times:
            shutil.rmtree(a.dir, ignore_errors=True)
            os.sync()
            t = time.perf_counter()
            if method == "raw":
                raw_write(state, a.dir)
            elif method == "manager":
                config = cg.CheckpointConfig(state=StateOptions(capture_rng=False))
                cg.CheckpointManager(a.dir, config=config).save(1, {"w": state})
            else:
                import torch.distributed.checkpoint as dcp

                dcp.save(state, checkpoint_id=str(a.dir))
            times[method].append(time.perf_counter() - t)
            print(method, rep, round(times[method][-1], 2), flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "gib": n / 4,
        "digest_of_state_s": round(digest_s, 3),
        "seconds": times,
        "x_raw": {k: round(med["raw"] / v, 3) for k, v in med.items()},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "manager_save_gpu.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
