"""Peak host memory of `ckptguard export` against its declared budget, and a naive consolidation.

Writes a step of SIZE GiB (one model item: TENSORS fp32 parameters) with CheckpointManager, then
runs each method in a fresh process that samples its own RSS every 2 ms (and reads ru_maxrss at
the end): ``export`` (``export_hf`` with ``--max-host-bytes BUDGET``, fp32 and with a bf16 cast) and
``naive`` (DCP-load the whole model into memory, then ``safetensors.save_file`` of it, what a
hand-written consolidation does). The figure that counts is the peak RSS above the process's RSS
just before the call (imports done), compared with the budget.

    python benchmarks/bench_export.py --dir /tmp/bench-export --size 1 --budget-mib 256 \\
        --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from ckptguard import StateOptions

_MiB = 1 << 20


def _rss() -> tuple[int, int]:
    """(VmRSS, RssAnon) of this process in bytes."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon"):
                fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["RssAnon"]


def child(method: str, step_dir: Path, out: Path, budget: int) -> None:
    from ckptguard.ops import export as ex

    base = _rss()
    peak = list(base)
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            now = _rss()
            peak[0], peak[1] = max(peak[0], now[0]), max(peak[1], now[1])
            time.sleep(0.002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    t0 = time.perf_counter()
    extra = {}
    if method == "naive":
        import torch.distributed.checkpoint as dcp
        from safetensors.torch import save_file

        from ckptguard.storage import read_dcp_metadata

        md = read_dcp_metadata(step_dir / "state")
        state = {
            k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
            for k, m in md.state_dict_metadata.items()
            if k.startswith("model.")
        }
        dcp.load(state, checkpoint_id=str(step_dir / "state"), no_dist=True)
        out.mkdir()
        save_file({k[len("model.") :]: v for k, v in state.items()}, str(out / "model.safetensors"))
        del state
    else:
        dtype = torch.bfloat16 if method == "export-bf16" else None
        result = ex.export_hf(step_dir, out, dtype=dtype, max_host_bytes=budget)
        extra = {
            "files": len(result.files),
            "peak_tensor_bytes": result.peak_tensor_bytes,
            "budget_parts": result.budget,
        }
    seconds = time.perf_counter() - t0
    stop.set()
    thread.join()
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(
        json.dumps(
            {
                "method": method,
                "seconds": seconds,
                "base_rss": base[0],
                "peak_rss": peak[0],
                "peak_rss_above_base": peak[0] - base[0],
                "peak_anon_above_base": peak[1] - base[1],
                "ru_maxrss_above_base": maxrss - base[0],
                **extra,
            }
        )
    )


def make(directory: Path, size: float, tensors: int) -> None:
    import ckptguard as cg

    n = int(size * (1 << 30) // 4 // tensors)
    model = torch.nn.Module()
    torch.manual_seed(0)
    for i in range(tensors):
        model.register_parameter(f"w{i:03d}", torch.nn.Parameter(torch.randn(n // 1024, 1024)))
    config = cg.CheckpointConfig(state=StateOptions(capture_rng=False))
    cg.CheckpointManager(directory / "ck", config=config).save(1, {"model": model})


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dir", type=Path, default=Path("/tmp/bench-export"))
    ap.add_argument("--size", type=float, default=1.0, help="GiB of model parameters (fp32)")
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--budget-mib", type=int, default=256)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--make", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    budget = a.budget_mib * _MiB
    if a.child:
        child(a.child[0], Path(a.child[1]), Path(a.child[2]), budget)
        return
    if a.make:
        make(a.dir, a.size, a.tensors)
        return
    shutil.rmtree(a.dir, ignore_errors=True)
    # The step is written by another process: ru_maxrss survives fork and exec, so a parent that
    # held the model would lend its peak to every child's figure.
    subprocess.run(
        [
            sys.executable,
            __file__,
            "--make",
            "--dir",
            str(a.dir),
            "--size",
            str(a.size),
            "--tensors",
            str(a.tensors),
        ],
        check=True,
    )
    step_dir = a.dir / "ck" / "step_00000001"
    n = int(a.size * (1 << 30) // 4 // a.tensors)
    rows = []
    for method in ("export", "export-bf16", "naive"):
        cmd = [
            sys.executable,
            __file__,
            "--budget-mib",
            str(a.budget_mib),
            "--child",
            method,
            str(step_dir),
            str(a.dir / method),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        shutil.rmtree(a.dir / method, ignore_errors=True)
    model_bytes = a.tensors * (n // 1024) * 1024 * 4
    report = {
        "command": " ".join(["python", "benchmarks/bench_export.py", *sys.argv[1:]]),
        "model_bytes": model_bytes,
        "budget_bytes": budget,
        "machine": f"{platform.node()} {os.cpu_count()} cores",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "rows": rows,
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "export_memory.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [
        f"# export peak host memory vs its budget ({model_bytes / (1 << 30):.2f} GiB fp32 model, "
        f"budget {a.budget_mib} MiB)",
        "",
        f"`{report['command']}`",
        "",
        "| method | s | peak RSS above base (sampled 2 ms) | ru_maxrss above base | anon "
        "above base | within budget |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        within = "yes" if r["ru_maxrss_above_base"] <= budget else "no"
        lines.append(
            f"| {r['method']} | {r['seconds']:.2f} | {r['peak_rss_above_base'] / _MiB:.0f} MiB | "
            f"{r['ru_maxrss_above_base'] / _MiB:.0f} MiB | {r['peak_anon_above_base'] / _MiB:.0f} "
            f"MiB | {within if r['method'] != 'naive' else '(no budget)'} |"
        )
    lines += [
        "",
        f"{report['machine']}, torch {report['torch']}, {report['date']}; base RSS (imports done) "
        f"{rows[0]['base_rss'] / _MiB:.0f} MiB",
    ]
    (a.out / "export_memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
