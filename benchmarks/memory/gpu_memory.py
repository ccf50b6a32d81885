"""GPU memory figures for issue 6, measured on a CUDA machine; skips cleanly without CUDA.

    python benchmarks/memory/gpu_memory.py --out DIR        (or OUT=DIR python ...)

Writes to DIR:
  gpu_memory.json    summary: per request size, the host footprint of a pinned buffer from the
                     caching host allocator (torch.empty(pin_memory=True)) and from
                     ckptguard's pinned_empty (cudaHostRegister, exact size), as footprint /
                     request; host_memory_stats before/after; read_gpu() around allocations;
                     the phase records' failure fields around a real CUDA OOM and the
                     classification (expected: cuda_allocation_failure)
  phases_oom.jsonl   the phase records themselves (load, update, then a wake that OOMs)
  report_gpu.html    ckptguard's report of those records

Footprint = growth of this process's VmRSS (RssAnon + RssFile + RssShmem) across the allocation,
with /proc/meminfo Shmem alongside (cudaHostAlloc memory is counted as shmem). Acceptance:
pinned_empty footprint / request <= 1.01; the caching allocator's is expected near the
next power of two (2.0 / 1.1 = 1.82 for a 1.1 GiB request). Runtime: under a minute on one
H200; it allocates at most 4 GiB of pinned host memory at once and fills the GPU once (OOM).
Without CUDA it writes {"skipped": reason} and exits 0.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import sys
import time
import types
from pathlib import Path
from typing import Any

GiB, MiB = 1 << 30, 1 << 20
SIZES = (256 * MiB, int(1.1 * GiB), 3 * GiB)


def _import_memory() -> types.ModuleType:
    """ckptguard.memory without ckptguard/__init__ (which needs the checkpoint deps, not used
    here)."""
    src = Path(__file__).resolve().parents[2] / "src"
    if "ckptguard" not in sys.modules:
        spec = importlib.util.find_spec("ckptguard") if str(src) in sys.path else None
        if spec is None:
            sys.path.insert(0, str(src))
            spec = importlib.util.find_spec("ckptguard")
        pkg = types.ModuleType("ckptguard")
        pkg.__path__ = list(spec.submodule_search_locations)  # type: ignore[union-attr]
        sys.modules["ckptguard"] = pkg
    import ckptguard.memory as mem

    return mem


def status_bytes(proc_root: Path = Path("/proc")) -> dict[str, int]:
    """VmRSS, RssAnon, RssFile, RssShmem of this process and node Shmem, in bytes."""
    out: dict[str, int] = {}
    for line in (proc_root / "self" / "status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(rest.split()[0]) * 1024
    for line in (proc_root / "meminfo").read_text().splitlines():
        if line.startswith("Shmem:"):
            out["node_Shmem"] = int(line.split()[1]) * 1024
    return out


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in before if k in after}


def footprint_ratio(d: dict[str, int], request: int) -> float:
    return d.get("VmRSS", 0) / request


def _empty_host_cache(torch: Any) -> str:
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "empty_host_cache"):
        acc.empty_host_cache()
        return "torch.accelerator.empty_host_cache"
    if hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()
        return "torch._C._host_emptyCache"
    return "none available"


def measure_pinned(torch: Any, mem: types.ModuleType) -> list[dict[str, Any]]:
    rows = []
    for n in SIZES:
        row: dict[str, Any] = {"request_bytes": n, "pow2_ceil": mem.pow2_ceil(n)}
        gc.collect()
        s0 = status_bytes()
        t = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        t.fill_(1)  # touched like the pinned_empty buffer below, so both footprints are resident
        s1 = status_bytes()
        row["caching_allocator"] = {
            "delta": delta(s0, s1),
            "ratio": footprint_ratio(delta(s0, s1), n),
            "is_pinned": bool(t.is_pinned()),
            "host_memory_stats": _host_stats(torch, mem),
        }
        del t
        row["caching_allocator"]["freed_with"] = _empty_host_cache(torch)
        gc.collect()
        s0 = status_bytes()
        t0 = time.perf_counter()
        buf = mem.pinned_empty(n)
        alloc_s = time.perf_counter() - t0
        buf.tensor.fill_(1)
        s1 = status_bytes()
        dev = buf.tensor[: 64 * MiB].to("cuda", non_blocking=True)
        back = torch.empty(64 * MiB, dtype=torch.uint8)
        back.copy_(dev)
        torch.cuda.synchronize()
        row["pinned_empty"] = {
            "delta": delta(s0, s1),
            "ratio": footprint_ratio(delta(s0, s1), n),
            "is_pinned": bool(buf.tensor.is_pinned()),
            "alloc_s": alloc_s,
            "host_memory_stats": _host_stats(torch, mem),
        }
        del dev
        buf.close()
        s2 = status_bytes()
        row["pinned_empty"]["released_after_close"] = delta(s1, s2)
        rows.append(row)
    return rows


def _host_stats(torch: Any, mem: types.ModuleType) -> dict[str, Any] | str:
    fn = getattr(torch.cuda, "host_memory_stats", None)
    return mem.pinned_figures(fn()) if fn else "torch.cuda.host_memory_stats not in this torch"


def oom_records(torch: Any, mem: types.ModuleType, out: Path) -> dict[str, Any]:
    path = out / "phases_oom.jsonl"
    path.unlink(missing_ok=True)
    rec = mem.PhaseRecorder(mem.RecorderConfig(path=path, node=os.uname().nodename, pss_every_s=0))
    keep = []
    with rec.phase(mem.PhaseKind.LOAD, step=0):
        keep.append(torch.empty(8 * GiB, dtype=torch.uint8, device="cuda"))
        time.sleep(0.6)  # let the 4 Hz sampler see it
    with rec.phase(mem.PhaseKind.UPDATE, step=1):
        tmp = torch.empty(4 * GiB, dtype=torch.uint8, device="cuda")
        del tmp
    total = torch.cuda.mem_get_info()[1]
    error = None
    try:
        with rec.phase(mem.PhaseKind.WAKE, step=2):
            keep.append(
                torch.empty(total, dtype=torch.uint8, device="cuda")
            )  # more than the device has
    except torch.cuda.OutOfMemoryError as exc:
        error = str(exc).splitlines()[0][:300]
    rec.close()
    records = mem.read_records([path])
    verdict = mem.classify_failure(records)
    (out / "report_gpu.html").write_text(mem.render_html(records), encoding="utf-8")
    failure = next((r for r in records if r["kind"] == "phase_failure"), None)
    keys = (
        "requested_bytes",
        "allocated",
        "reserved",
        "device_free",
        "error",
        "last_completed",
        "load_peak",
        "cuda_oom",
        "not_obtained",
    )
    del keep
    torch.cuda.empty_cache()
    return {
        "error": error,
        "failure_record": {k: failure.get(k) for k in keys} if failure else None,
        "verdict": verdict.to_json(),
        "gpu_at_load_end": records[1].get("gpu"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    )
    args = ap.parse_args(argv)
    if args.out is None:
        ap.error("give --out DIR or set $OUT")
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"script": "benchmarks/memory/gpu_memory.py"}
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        result["skipped"] = (
            "torch is not installed" if torch is None else "CUDA is not available on this machine"
        )
        (args.out / "gpu_memory.json").write_text(json.dumps(result, indent=2) + "\n")
        print(result["skipped"])
        return 0
    mem = _import_memory()
    torch.cuda.init()
    result["torch"] = torch.__version__
    result["device"] = torch.cuda.get_device_name()
    result["read_gpu_idle"] = mem.read_gpu().to_json()
    result["pinned"] = measure_pinned(torch, mem)
    x = torch.empty(3 * GiB + 12345, dtype=torch.uint8, device="cuda")
    result["read_gpu_with_3GiB"] = mem.read_gpu().to_json()
    del x
    result["oom"] = oom_records(torch, mem, args.out)
    result["acceptance"] = {
        "pinned_empty_max_ratio": max(r["pinned_empty"]["ratio"] for r in result["pinned"]),
        "caching_allocator_ratio_1_1GiB": next(
            r["caching_allocator"]["ratio"]
            for r in result["pinned"]
            if r["request_bytes"] == int(1.1 * GiB)
        ),
        "oom_classified_as": result["oom"]["verdict"]["killer"],
    }
    (args.out / "gpu_memory.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(json.dumps(result["acceptance"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
