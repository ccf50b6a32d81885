"""The layout-free digest against today's per-rank digest pass, over the same state.

A transformer-shaped model (LAYERS blocks: a d x 3d and a d x d attention projection, a
d x 4d and a 4d x d MLP, norms and biases; embeddings) with Adam's state after one step,
captured as a save captures it. Three passes over the same captured tensors, REPS
interleaved repetitions, medians and their ratios to today's:

- today's: ``Captured.digest()`` of every item (xxh3 of every tensor, single-threaded), what
  the commit computed for the manifest before;
- the layout-free pass alone (``layout_free_partials``): what a restore adds to compare; the
  caller and a pool of up to 4 threads (``--threads``, cores - 1 by default) sum its pieces;
- the save's pass now (``digests_and_layout_free``, format 3): the layout-free pass plus, per
  tensor item, an xxh3 of its structure only (keys, dtypes, shapes, non-tensor values); no
  tensor byte is hashed with xxh3 any more;
- the save's pass before format 3 (``Captured.digest_and_layout_free`` of every item): both
  digests, xxh3 of every byte in the caller's thread while the pool sums the same bytes
  layout-free one chunk ahead.

Besides the wall times: the CPU seconds of each pass (all threads) and the share of the cores
other processes took during the run; on a shared machine only runs with that share near 0
measure the passes.

``--device cuda`` puts the state on the GPU: today's digest then stages through pinned chunks,
the layout-free sums run on the device, and the script checks that the GPU gives the same
layout-free digests as the CPU for the same bytes.

    python benchmarks/bench_layout_digest.py --dim 1024 --layers 8 --reps 9 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from ckptguard._disk import digest as digest_mod
from ckptguard._disk.boxsum import combine_layout_free, layout_free_partials
from ckptguard._state.state import capture, digests_and_layout_free


def build(dim: int, layers: int, device: str) -> dict:
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [
            torch.nn.LayerNorm(dim),
            torch.nn.Linear(dim, 3 * dim),
            torch.nn.Linear(dim, dim),
            torch.nn.LayerNorm(dim),
            torch.nn.Linear(dim, 4 * dim),
            torch.nn.Linear(4 * dim, dim),
        ]
    model = torch.nn.Sequential(torch.nn.Embedding(8192, dim), *blocks).to(device)
    optim = torch.optim.Adam(model.parameters())
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optim.step()
    return {"model": model, "optim": optim}


CPU_S: list[float] = []  # the process's CPU seconds (all threads) of each timed call, in call order


def timed(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    c, t = time.process_time(), time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    CPU_S.append(time.process_time() - c)
    return time.perf_counter() - t


def cpu_times() -> tuple[float, float] | None:
    """(seconds all cores were busy with other processes, seconds of all cores) since boot (Linux):
    how much of the machine others took while this benchmark ran."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    own = sum(os.times()[:2])  # this process's user + system seconds, all threads
    return (sum(fields[:8]) - fields[3] - fields[4]) / tick - own, sum(fields[:8]) / tick


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--threads", type=int, default=None, help="layout-free pool threads (default: up to 4)"
    )
    ap.add_argument(
        "--fused-chunk-mib", type=int, default=None, help="bytes per pool task in the save's pass"
    )
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--tag", default="", help="appended to the result file's name")
    a = ap.parse_args()
    state = build(a.dim, a.layers, a.device)
    items = capture(state)
    tensors = {n: c.tensors for n, c in items.items()}
    nbytes = sum(t.numel() * t.element_size() for c in items.values() for t in c.tensors.values())
    count = sum(len(c.tensors) for c in items.values())
    if a.threads is not None:
        digest_mod._THREADS = a.threads
    if a.fused_chunk_mib is not None:
        digest_mod._FUSED_CHUNK = a.fused_chunk_mib << 20
    today, free, both, old = [], [], [], []
    before = cpu_times()
    for _ in range(a.reps + 1):  # the first repetition warms up and is dropped
        today.append(timed(lambda: {n: c.digest() for n, c in items.items()}))
        free.append(timed(lambda: combine_layout_free([layout_free_partials(tensors)])))
        both.append(timed(lambda: digests_and_layout_free(items)))
        old.append(timed(lambda: {n: c.digest_and_layout_free() for n, c in items.items()}))
    today, free, both, old = today[1:], free[1:], both[1:], old[1:]
    cpu_today, cpu_free, cpu_both, cpu_old = CPU_S[4::4], CPU_S[5::4], CPU_S[6::4], CPU_S[7::4]
    after = cpu_times()
    result = {
        "what": "per-item digest pass of a save: today's xxh3 digests vs the "
        "layout-free digest, same tensors",
        "device": a.device if a.device == "cpu" else torch.cuda.get_device_name(),
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "state_bytes": nbytes,
        "tensors": count,
        "reps": a.reps,
        "today_s_median": statistics.median(today),
        "layout_free_s_median": statistics.median(free),
        "ratio_layout_free_to_today": statistics.median(free) / statistics.median(today),
        "save_pass_s_median": statistics.median(both),
        "ratio_save_pass_to_today": statistics.median(both) / statistics.median(today),
        "save_pass_before_s_median": statistics.median(old),
        "ratio_save_pass_before_to_today": statistics.median(old) / statistics.median(today),
        "save_pass": "format 3: layout-free sums + xxh3 of each tensor item's "
        "structure (no tensor bytes)",
        "layout_free_threads": digest_mod._THREADS,
        "fused_chunk_bytes": digest_mod._FUSED_CHUNK,
        "today_s": today,
        "layout_free_s": free,
        "save_pass_s": both,
        "save_pass_before_s": old,
        "ratio_layout_free_to_today_best": min(free) / min(today),
        # CPU seconds of all threads: the work, which a busy machine changes less than the wall time
        "cpu_s_median": {
            "today": statistics.median(cpu_today),
            "layout_free": statistics.median(cpu_free),
            "save_pass": statistics.median(cpu_both),
            "save_pass_before": statistics.median(cpu_old),
        },
        "ratio_save_pass_to_today_best": min(both) / min(today),
        # the share of all cores other processes took during the run: on a shared machine that was
        # busy elsewhere the ratios say little about the passes (the 2-thread passes lose most)
        "others_busy_pct": 100 * (after[0] - before[0]) / max(1e-9, after[1] - before[1])
        if before and after
        else None,
        "cores": os.cpu_count(),
        "today_gb_per_s": nbytes / statistics.median(today) / 1e9,
        "layout_free_gb_per_s": nbytes / statistics.median(free) / 1e9,
    }
    if a.device != "cpu":
        host = {n: {k: t.cpu() for k, t in ts.items()} for n, ts in tensors.items()}
        same = combine_layout_free([layout_free_partials(host)])
        result["gpu_equals_cpu"] = same == combine_layout_free([layout_free_partials(tensors)])
        assert result["gpu_equals_cpu"], "the GPU's layout-free digests differ from the CPU's"
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, list)}, indent=1))
    a.out.mkdir(parents=True, exist_ok=True)
    tag = "" if a.threads is None else f"_t{a.threads}"
    tag += "" if a.fused_chunk_mib is None else f"_c{a.fused_chunk_mib}"
    tag += a.tag
    name = f"layout_digest_{'cpu' if a.device == 'cpu' else 'gpu'}{tag}.json"
    (a.out / name).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
