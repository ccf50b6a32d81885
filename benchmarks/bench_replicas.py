"""What the "replicas equal after load" check adds to a restore (issue 29, item 3).

The check reuses the layout-free partials every restore already gathers on rank 0 (one per tensor
chunk and rank); what it adds is ``replica_report`` over them on rank 0 and a larger decision
broadcast. Two measurements:

1. A DDP job on ``--world`` gloo CPU ranks (``--tensors`` tensors of ``--mib`` MiB in all, Adam):
   saved once, restored ``--reps`` times in new processes; each restore's own time (its proof
   record's ``seconds``) against ``replica_report`` timed on the same partials (each rank's
   ``layout_free_partials`` of its restored state, gathered here).
2. ``replica_report`` alone on synthetic partials of a larger job (``--big-ranks`` ranks holding
   ``--big-chunks`` replicated chunks each, e.g. a 7B Llama's 291 parameters, two Adam moments and
   a step each under DDP), where it is the whole cost.

    OMP_NUM_THREADS=1 python benchmarks/bench_replicas.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

import ckptguard as cg
from ckptguard._disk.boxsum import layout_free_partials
from ckptguard._resume.layoutcheck import replica_report
from ckptguard._state import state as _state
from ckptguard.testing import run_ranks, values


def _job(root: str, tensors: int, mib: float):
    torch.manual_seed(0)
    per = max(1, int(mib * 2**20 / 4 / tensors))
    net = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(per)) for _ in range(tensors)])
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    mgr = cg.CheckpointManager(root, config=cg.CheckpointConfig(timeout_s=300))
    return net, model, opt, mgr


def _save(rank: int, world: int, root: str, tensors: int, mib: float) -> None:
    net, model, opt, mgr = _job(root, tensors, mib)
    sum(p.square().sum() for p in model.module).backward()
    opt.step()
    mgr.save(1, {"model": net, "optim": opt})


def _restore(rank: int, world: int, root: str, tensors: int, mib: float) -> dict:
    net, _ddp, opt, mgr = _job(root, tensors, mib)
    state = {"model": net, "optim": opt}
    mgr.restore(state)
    flat: dict[str, dict] = {}
    for name, kind in (("model", _state.ItemKind.MODULE), ("optim", _state.ItemKind.OPTIMIZER)):
        tensors_of: dict = {}
        _state.flatten(_state.current_state(name, state[name], kind, state), name, tensors_of)
        flat[name] = tensors_of
    return layout_free_partials(flat)


def _restore_seconds(root: Path, rank: int) -> list[float]:
    lines = (root / "proof" / f"rank_{rank:05d}.jsonl").read_text().splitlines()
    return [
        r["seconds"] for r in map(json.loads, lines) if r.get("event") == "restore" and r.get("ok")
    ]


def _timed(views: list, reps: int = 20) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        replica_report(views)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--tensors", type=int, default=200)
    ap.add_argument("--mib", type=float, default=64.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--big-ranks", type=int, default=64)
    ap.add_argument("--big-chunks", type=int, default=291 * 4)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-replicas-") as tmp:
        root = Path(tmp) / "ck"
        values(run_ranks(_save, a.world, str(root), a.tensors, a.mib, timeout=900))
        report_s, views = [], []
        for _ in range(a.reps):
            views = values(run_ranks(_restore, a.world, str(root), a.tensors, a.mib, timeout=900))
            report_s.append(_timed(views))
        restore_s = _restore_seconds(root, 0)
    report = replica_report(views)
    big = [
        {
            f"k{i}@(0,)": ["m", f"k{i}", "torch.float32|(4096, 4096)", f"{i:016x}"]
            for i in range(a.big_chunks)
        }
        for _ in range(a.big_ranks)
    ]
    big_s = _timed(big, reps=5)
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "load_1min": os.getloadavg()[0],
        "job": {
            "world": a.world,
            "tensors": a.tensors,
            "mib": a.mib,
            "chunks_checked": report["checked"],
        },
        "restore_s": restore_s,
        "replica_report_s": report_s,
        "share_of_restore": statistics.median(report_s) / statistics.median(restore_s),
        "synthetic": {
            "ranks": a.big_ranks,
            "chunks_per_rank": a.big_chunks,
            "replica_report_s": big_s,
        },
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "replicas_cpu.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
