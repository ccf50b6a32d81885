"""Where a synchronous commit's time goes: write, fsync, the publish check, the JSON records
(manifest, tracker, trust), retention on the commit's path, and the old step's delete.

A state of SIZE GiB (fp32 tensors of 256 MiB, on the GPU when there is one) is saved SAVES times
with ``KeepLast(1)``, so every save after the first drops one whole step. Each phase is timed by
wrapping the function that does it; "on the caller" sums the calls made on the saving thread (the
commit's critical path), "background" the calls on other threads. Two modes in the same run:

- ``background`` (the code as it is): retention renames the dropped step into the trash and a
  background thread deletes it;
- ``sync`` (what a commit did before): the same, then the commit waits for the delete.

    python benchmarks/bench_commit_phases.py --gib 6 --saves 4 --dir /tmp/cg-commit \\
        --out $OUT/commit_phases.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import ckptguard as cg
from ckptguard._commit import publish
from ckptguard._disk import layout
from ckptguard._records import retention
from ckptguard.storage import streaming

GiB = 1 << 30


class Phases:
    """Wraps module attributes with timers; seconds per phase, split by thread."""

    def __init__(self) -> None:
        self.caller = threading.get_ident()
        self.on_caller: dict[str, float] = defaultdict(float)
        self.background: dict[str, float] = defaultdict(float)
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, attr: str, phase: str) -> None:
        real = getattr(owner, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                took = time.perf_counter() - began
                side = self.on_caller if threading.get_ident() == self.caller else self.background
                side[phase] += took

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, real))

    def reset(self) -> None:
        self.on_caller.clear()
        self.background.clear()

    def undo(self) -> None:
        for owner, attr, real in reversed(self._undo):
            setattr(owner, attr, real)


def make_state(gib: float, device: str) -> dict[str, torch.Tensor]:
    n = 64 << 20  # 256 MiB of fp32 per tensor
    count = max(1, round(gib * GiB / (n * 4)))
    gen = torch.Generator(device=device).manual_seed(0)
    return {f"t{i:03d}": torch.randn(n, generator=gen, device=device) for i in range(count)}


def run(root: Path, state: dict, saves: int, mode: str) -> dict[str, Any]:
    shutil.rmtree(root, ignore_errors=True)
    phases = Phases()
    phases.wrap(streaming.StreamingStorage, "write_items", "write (stream, xxh3, data file fsync)")
    phases.wrap(os, "fsync", "fsync (all files and directories)")
    phases.wrap(publish, "_unseen_files", "publish check (sizes)")
    phases.wrap(publish, "build_manifest", "manifest build")
    phases.wrap(layout, "atomic_write_json", "JSON records (manifest, tracker, trust)")
    phases.wrap(layout, "uncommit_to_trash", "retention: rename into the trash")
    phases.wrap(retention, "_delete", "retention: delete the trash")
    real_apply = retention.apply

    def apply_then_wait(*args: Any, **kwargs: Any) -> Any:
        report = real_apply(*args, **kwargs)
        retention.DELETER.wait()  # the delete on the commit's path, as before issue 41
        return report

    retention.apply = apply_then_wait if mode == "sync" else real_apply  # type: ignore[assignment]
    phases.wrap(
        retention, "apply", "retention (decision, rename" + (", delete)" if mode == "sync" else ")")
    )
    mgr = cg.CheckpointManager(root, config=cg.CheckpointConfig(retention=cg.KeepLast(1)))
    rows = []
    try:
        for step in range(1, saves + 1):
            retention.DELETER.wait()
            phases.reset()
            began = time.perf_counter()
            mgr.save(step, state)
            total = time.perf_counter() - began
            retention.DELETER.wait()  # the background side of this save, for the table
            rows.append(
                {
                    "step": step,
                    "save_s": round(total, 3),
                    "on_caller_s": {k: round(v, 3) for k, v in phases.on_caller.items()},
                    "background_s": {k: round(v, 3) for k, v in phases.background.items()},
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    finally:
        mgr.close()
        phases.undo()
        retention.apply = real_apply  # type: ignore[assignment]
        shutil.rmtree(root, ignore_errors=True)
    later = [r["save_s"] for r in rows[1:]]  # the first drops nothing
    return {
        "mode": mode,
        "saves": rows,
        "median_save_with_a_drop_s": statistics.median(later) if later else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=6.0)
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/ckptguard-commit-phases"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--modes", default="sync,background")
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    state = make_state(a.gib, device)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "state_bytes": nbytes,
        "torch": torch.__version__,
        "runs": [],
    }
    for mode in a.modes.split(","):
        res["runs"].append(run(a.dir, state, a.saves, mode))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    for r in res["runs"]:
        print(f"{r['mode']}: median save that drops a step {r['median_save_with_a_drop_s']} s")


if __name__ == "__main__":
    main()
