"""StreamingStorage.write of GPU tensors with and without early writeback (sync_file_range),
against this disk's own write+fsync of as many bytes; alternated to see the noise.

    python3 benchmarks/bench_writeback.py --gib 6 --dir /tmp/cg-wb --out $OUT/writeback.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_train_loop import disk_figures

from ckptguard.storage import _writer
from ckptguard.storage.base import StorageContext
from ckptguard.storage.streaming import StreamingStorage


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=6.0)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/cg-wb"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    n = max(1, int(a.gib * 4))
    state = {f"t{i}": torch.full(((256 << 20) // 4,), float(i), device=dev) for i in range(n)}
    nbytes = n * (256 << 20)
    ctx = StorageContext(rank=0, world_size=1, process_group=None)
    kick = _writer.start_writeback
    res: dict = {
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        "bytes": nbytes,
        "runs": [],
    }
    res["disk"] = disk_figures(a.dir, nbytes)
    for _ in range(a.rounds):
        for mode in ("off", "on"):
            _writer.start_writeback = kick if mode == "on" else (lambda fd, o, n: None)
            shutil.rmtree(a.dir / "s", ignore_errors=True)
            (a.dir / "s").mkdir(parents=True)
            t = time.perf_counter()
            StreamingStorage().write(a.dir / "s", state, ctx)
            gib_s = nbytes / (1 << 30) / (time.perf_counter() - t)
            res["runs"].append(
                {
                    "writeback": mode,
                    "gib_s": round(gib_s, 3),
                    "vs_disk": round(gib_s / res["disk"]["write_fsync_gib_s"], 3),
                }
            )
            print(res["runs"][-1], flush=True)
    shutil.rmtree(a.dir, ignore_errors=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res["disk"]))


if __name__ == "__main__":
    main()
