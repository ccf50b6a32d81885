"""Overhead of the memory records: a phase boundary (< 2 ms) and the sampler (< 1% of one core).

    python benchmarks/memory/overhead.py [--out benchmarks/results/memory_overhead.json] \\
        [--seconds 10]

Phase boundary: the wall time of an empty ``with rec.phase(...)`` is two boundaries (start and
end record: host probe, Ray figure, /proc/self/status, GPU probe, one JSON line written);
reported per boundary as median / p99 / max over many phases: with the defaults (PSS from
smaps_rollup at most every 10 s), with PSS at every boundary (the page-table walk, for
comparison), and without the per-process probe. The process has torch imported, as a trainer
has. Sampler: the process's CPU time (user + system) while it is otherwise idle
with the sampler running, divided by wall time, at 4 Hz (the default) and at 20 Hz; the idle
baseline without a sampler is subtracted. Results are written as JSON; nothing is asserted here.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from ckptguard.memory import HostProbe, PhaseKind, PhaseRecorder, RecorderConfig
from ckptguard.memory.sampler import Sampler, SamplerConfig, self_rss


def boundary_ms(n: int, **config: object) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        rec = PhaseRecorder(RecorderConfig(path=Path(tmp) / "m.jsonl", **config))
        for _ in range(20):  # warm the page cache and the code paths
            with rec.phase(PhaseKind.UPDATE, step=0):
                pass
        per = []
        for i in range(n):
            t0 = time.perf_counter()
            with rec.phase(PhaseKind.UPDATE, step=i):
                pass
            per.append((time.perf_counter() - t0) * 1e3 / 2)
        rec.close()
    per.sort()
    return {
        "median_ms": statistics.median(per),
        "p99_ms": per[int(0.99 * (n - 1))],
        "max_ms": per[-1],
        "n": n,
    }


def cpu_fraction(seconds: float, hz: float | None) -> float:
    probe = HostProbe()
    sampler = None
    if hz is not None:
        sampler = Sampler(
            {"host_current": probe.read_current, "process_rss": self_rss}, SamplerConfig(hz=hz)
        )
        sampler.start()
        sampler.open_window()
    t = os.times()
    w0 = time.monotonic()
    time.sleep(seconds)
    t2 = os.times()
    wall = time.monotonic() - w0
    if sampler is not None:
        sampler.stop()
    return ((t2.user - t.user) + (t2.system - t.system)) / wall


def per_sample_us(n: int = 2000) -> float:
    probe = HostProbe()
    s = Sampler({"host_current": probe.read_current, "process_rss": self_rss})
    t0 = time.perf_counter()
    for _ in range(n):
        s.read_all()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/memory_overhead.json"))
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--phases", type=int, default=1000)
    args = ap.parse_args()
    probe = HostProbe()
    idle = cpu_fraction(args.seconds, None)
    result = {
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "host_source": probe.version.value,
        },
        "boundary_default": boundary_ms(args.phases),
        "boundary_pss_every_boundary": boundary_ms(args.phases // 4, pss_every_s=0.0),
        "boundary_without_process_probe": boundary_ms(args.phases, probe_process=False),
        "sampler_read_us": per_sample_us(),
        "idle_cpu_fraction": idle,
        "sampler_4hz_cpu_fraction_of_one_core": cpu_fraction(args.seconds, 4.0) - idle,
        "sampler_20hz_cpu_fraction_of_one_core": cpu_fraction(args.seconds, 20.0) - idle,
        "limits": {"boundary_ms": 2.0, "sampler_cpu_fraction": 0.01},
    }
    result["sampler_4hz_from_read_cost"] = result["sampler_read_us"] * 4 / 1e6
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
