"""A manager whose pinned staging pool is dropped without ``close()``, then a save and a restore in
the same process: both must succeed (issue 41: the dropped pool's range stayed registered, the next
pinned read buffer there failed with cudaError 712 and the restore called a sound checkpoint
corrupt).

    python benchmarks/check_dropped_pool.py --out $OUT/dropped_pool.json      # a CUDA machine
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import ckptguard as cg
from ckptguard.storage import _pool

GiB = 1 << 30


def _job(width: int, layers: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).cuda()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)


def _step(model: torch.nn.Module, optim: torch.optim.Optimizer, width: int) -> None:
    model(torch.randn(8, width, device="cuda")).square().mean().backward()
    optim.step()
    optim.zero_grad()


def _registered_count() -> list[int]:
    """Counts every cudaHostRegister/Unregister ckptguard makes (its one seam), to show the pairs
    balance."""
    calls = [0, 0]
    real = _pool._cudart

    class Counting:
        def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
            return getattr(real(), name)

        def cudaHostRegister(self, *a):  # type: ignore[no-untyped-def]
            rc = int(real().cudaHostRegister(*a))
            calls[0] += rc == 0
            return rc

        def cudaHostUnregister(self, *a):  # type: ignore[no-untyped-def]
            rc = int(real().cudaHostUnregister(*a))
            calls[1] += rc == 0
            return rc

    counting = Counting()
    _pool._cudart = lambda: counting  # type: ignore[assignment]
    return calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/ckptguard-dropped-pool"))
    ap.add_argument("--fast-dir", type=Path, default=Path("/dev/shm/ckptguard-dropped-pool"))
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    a = ap.parse_args()
    for d in (a.dir, a.fast_dir):
        shutil.rmtree(d, ignore_errors=True)
    calls = _registered_count()
    out: dict[str, object] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    model, optim = _job(a.width, a.layers)
    state = {"model": model, "optim": optim}
    tiers = cg.TieredCheckpoint(
        a.fast_dir, persistent=a.dir / "persistent", fast_every=1, persistent_every=2
    )
    tiers.restore(state)
    for step in range(1, 5):
        _step(model, optim, a.width)
        tiers.save_async(step, state)
    tiers.wait()
    pools = [
        m._staging.pool for m in (tiers.fast, tiers.persistent) if m is not None and m._staging.pool
    ]
    out["dropped_pool_bytes"] = sum(p.held_bytes for p in pools)
    out["state_bytes"] = sum(
        t.numel() * t.element_size() for t in model.state_dict().values()
    ) + sum(v.numel() * v.element_size() for s in optim.state.values() for v in s.values())
    out["registered_before_drop"] = calls[0] - calls[1]
    del tiers, pools  # no close(): the pools go with the garbage
    gc.collect()
    out["registered_after_drop"] = calls[0] - calls[1]
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    mgr = cg.CheckpointManager(a.dir / "after")
    t = time.perf_counter()
    mgr.save(10, state)
    out["save_after_drop_s"] = round(time.perf_counter() - t, 3)
    fresh_model, fresh_optim = _job(a.width, a.layers)
    _step(fresh_model, fresh_optim, a.width)
    t = time.perf_counter()
    step = cg.CheckpointManager(a.dir / "after").restore(
        {"model": fresh_model, "optim": fresh_optim}
    )
    out["restore_after_drop_s"] = round(time.perf_counter() - t, 3)
    out["restored_step"] = step
    out["restore_bitwise_exact"] = all(
        torch.equal(fresh_model.state_dict()[k], v) for k, v in saved.items()
    )
    mgr.close()
    out["registered_at_end"] = calls[0] - calls[1]
    out["ok"] = (
        step == 10 and bool(out["restore_bitwise_exact"]) and out["registered_after_drop"] == 0
    )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out), flush=True)
    for d in (a.dir, a.fast_dir):
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
