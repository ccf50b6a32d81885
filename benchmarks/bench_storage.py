"""Save/load throughput and host memory: StreamingStorage vs raw I/O, DCP and torch.save.

What it measures, per method, as medians over interleaved repetitions (ours, baseline, ...):

- save: seconds and GiB/s to durable files (every method fsyncs; torch.save's file is
  fsynced after it returns), the peak of extra host memory (RssAnon + RssShmem over the
  value just before the call, sampled at 200 Hz), what of it is still there after the call
  ("left"), and the page-cache growth (/proc/meminfo Cached) reported separately;
- load (cold: caches dropped before each run when root): the same figures, into
  preallocated targets on the state's device;
- repetitions are interleaved and rotated (rep r starts with method r), with a pause
  (``--settle-s``) before each run; the figures are medians;
- the raw baseline writes (reads) the same bytes from (into) host memory with plain
  write+fsync (read) in 32 MiB calls: the disk's own throughput in the same run.

On CUDA the state lives on the GPU (8 GiB of fp32 by default). ``--world 2`` spawns two
ranks (NCCL default group, gloo group for the checkpoint collectives), each holding
``--gib / world`` GiB, and reports the aggregate throughput and per-rank memory.

Writes ``bench_storage.json`` and ``bench_storage.md`` under ``--out``. Needs torch >= 2.5.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from ckptguard.storage.base import StorageContext
from ckptguard.storage.streaming import StreamingConfig, StreamingStorage

GiB = 1 << 30
CHUNK = 32 << 20
warnings.filterwarnings("ignore")


# ---------------------------------------------------------------- memory probes


def _status_bytes(*fields: str) -> int:
    total = 0
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in fields:
                total += int(rest.split()[0]) * 1024
    return total


def host_extra() -> int:
    """Anonymous plus shared (pinned) resident bytes of this process."""
    return _status_bytes("RssAnon", "RssShmem")


def page_cache() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Cached:"):
                return int(line.split()[1]) * 1024
    return 0


class Sampler:
    """Peak of host_extra() while a block runs, sampled every 5 ms on a thread."""

    def __enter__(self) -> Sampler:
        self.base = host_extra()
        self.peak = self.base
        self.cache0 = page_cache()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, host_extra())

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, host_extra())
        gc.collect()
        self.left = host_extra() - self.base
        self.cache_delta = page_cache() - self.cache0


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def sync_device() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---------------------------------------------------------------- the state


def make_state(gib: float, device: str, tensor_mib: int, prefix: str) -> dict[str, torch.Tensor]:
    """fp32 tensors of ``tensor_mib`` MiB plus 64 small ones, ``gib`` GiB in all."""
    total = int(gib * GiB)
    small = [64 << 10] * 64
    big_bytes = total - sum(small)
    n_big = max(1, big_bytes // (tensor_mib << 20))
    sizes = [big_bytes // n_big] * n_big + small
    gen = torch.Generator(device=device).manual_seed(0)
    return {
        f"{prefix}t{i:04d}": torch.rand(nb // 4, generator=gen, device=device)
        for i, nb in enumerate(sizes)
    }


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


# ---------------------------------------------------------------- methods


def raw_write(state: dict[str, torch.Tensor], path: Path, host: torch.Tensor | None) -> None:
    """The disk's own write+fsync of the same number of bytes, from host memory."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in state.values():
            if t.device.type == "cpu":
                mv = memoryview(t.view(torch.uint8).numpy())
            else:  # GPU state: the bytes come from a host buffer, so no D2H is counted
                mv = memoryview(host.numpy())[: t.numel() * t.element_size()]
            for start in range(0, len(mv), CHUNK):
                view = mv[start : start + CHUNK]
                while view:
                    view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_read(path: Path, host: torch.Tensor) -> None:
    mv = memoryview(host.numpy())
    fd = os.open(path, os.O_RDONLY)
    try:
        while os.readv(fd, [mv[:CHUNK]]) > 0:
            pass
    finally:
        os.close(fd)


def torch_save(state: dict[str, torch.Tensor], path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def torch_load_mmap(path: Path, targets: dict[str, torch.Tensor]) -> None:
    loaded = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    for k, t in targets.items():
        t.copy_(loaded[k])
    del loaded


def dcp_save(state: dict[str, torch.Tensor], path: Path, pg: Any) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(path), process_group=pg, no_dist=pg is None)


def dcp_load(path: Path, targets: dict[str, torch.Tensor], pg: Any) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.load(targets, checkpoint_id=str(path), process_group=pg, no_dist=pg is None)


# ---------------------------------------------------------------- one rank's run


class Bench:
    def __init__(self, args: argparse.Namespace, rank: int, world: int, pg: Any) -> None:
        self.args, self.rank, self.world, self.pg = args, rank, world, pg
        self.device = "cuda" if args.device == "cuda" else "cpu"
        self.dir = Path(args.dir) / f"rank{rank}"
        self.shared = Path(args.dir) / "shared"
        self.state = make_state(
            args.gib / world, self.device, args.tensor_mib, f"r{rank}." if world > 1 else ""
        )
        self.nbytes = state_bytes(self.state)
        self.host = torch.empty(max(t.numel() * 4 for t in self.state.values()), dtype=torch.uint8)
        self.host.fill_(1)  # resident before any baseline is taken
        self.storage = StreamingStorage(
            StreamingConfig(pool_bytes=args.pool_mib << 20, buffer_bytes=args.buffer_mib << 20)
        )
        self.ctx = StorageContext(rank=rank, world_size=world, process_group=pg)
        self.t_start = time.monotonic()
        sync_device()

    def barrier(self) -> None:
        if self.pg is not None:
            torch.distributed.barrier(group=self.pg)

    def fresh(self, name: str) -> Path:
        path = (self.shared if name in ("ours", "dcp") else self.dir) / name
        if self.rank == 0 or name not in ("ours", "dcp"):
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True, exist_ok=True)
        self.barrier()
        return path

    def save(self, name: str) -> dict[str, Any]:
        path = self.fresh(name)
        if self.args.cold:
            drop_caches()
        self.barrier()
        with Sampler() as mem:
            t0 = time.perf_counter()
            if name == "raw":
                raw_write(self.state, path / "raw.bin", self.host)
            elif name == "ours":
                self.storage.write(path, self.state, self.ctx)
            elif name == "dcp":
                dcp_save(self.state, path, self.pg)
            elif name == "torch_save":
                torch_save(self.state, path / "state.pt")
            sync_device()
            self.barrier()
            seconds = time.perf_counter() - t0
        out = self._figures(seconds, mem)
        if name == "dcp" and self.rank == 0:
            shutil.rmtree(
                path, ignore_errors=True
            )  # dcp.load reads our (plain DCP) files: save the disk space
        if name == "ours":
            st = self.storage.last_stats
            out["hash_share"] = st.hash_seconds / seconds
            out["stall_seconds"] = st.stall_seconds
            out["pool_bytes"] = st.pool_bytes
        return out

    def load(self, name: str, targets: dict[str, torch.Tensor]) -> dict[str, Any]:
        cold = drop_caches()
        self.barrier()
        with Sampler() as mem:
            t0 = time.perf_counter()
            if name == "raw":
                raw_read(self.dir / "raw" / "raw.bin", self.host)
            elif name == "ours":
                self.storage.read(self.shared / "ours", targets, self.ctx)
            elif name == "dcp":
                dcp_load(self.shared / "ours", targets, self.pg)  # our files are plain DCP
            elif name == "torch_load_mmap":
                torch_load_mmap(self.dir / "torch_save" / "state.pt", targets)
            sync_device()
            self.barrier()
            seconds = time.perf_counter() - t0
        out = self._figures(seconds, mem)
        out["cold"] = cold
        if name != "raw":
            out["bitwise"] = all(torch.equal(targets[k], self.state[k]) for k in self.state)
            for t in targets.values():
                t.zero_()
        return out

    def _figures(self, seconds: float, mem: Sampler) -> dict[str, Any]:
        return {
            "seconds": seconds,
            "gib_per_s": self.nbytes * self.world / GiB / seconds,
            "extra_host_peak_bytes": mem.peak - mem.base,
            "extra_host_left_bytes": mem.left,
            "page_cache_delta_bytes": mem.cache_delta,
        }

    def settle(self) -> None:
        # The disk (or a VM host's cache) may still be flushing the previous run's bytes
        # after its fsync returned; a pause keeps that cost off the next method.
        time.sleep(self.args.settle_s)

    def over_budget(self, fraction: float) -> bool:
        """Past ``fraction`` of --max-seconds (agreed by all ranks): start no new repetition."""
        late = time.monotonic() - self.t_start > fraction * self.args.max_seconds
        flag = torch.tensor([late], dtype=torch.int32)
        if self.pg is not None:
            torch.distributed.all_reduce(flag, group=self.pg)
        return bool(flag.item())

    def warmup(self) -> None:
        """One tiny untimed round of every method: imports and first-call setup are not measured."""
        tiny = {k: torch.ones(1024, device=self.device) for k in ("a", "b")}
        if self.world > 1:
            tiny = {f"r{self.rank}.{k}": v for k, v in tiny.items()}
        path = self.fresh("warmup")
        if self.rank == 0:
            shutil.rmtree(self.shared / "warmup", ignore_errors=True)
        self.barrier()
        self.storage.write(self.shared / "warmup", tiny, self.ctx)
        self.storage.read(
            self.shared / "warmup", {k: torch.zeros_like(v) for k, v in tiny.items()}, self.ctx
        )
        dcp_save(tiny, self.shared / "warmup_dcp", self.pg)
        dcp_load(
            self.shared / "warmup_dcp", {k: torch.zeros_like(v) for k, v in tiny.items()}, self.pg
        )
        torch_save(tiny, path / "tiny.pt")
        torch_load_mmap(path / "tiny.pt", {k: torch.zeros_like(v) for k, v in tiny.items()})
        self.barrier()

    def run(self) -> dict[str, Any]:
        self.warmup()
        save_methods = [m for m in self.args.save_methods.split(",") if m]
        load_methods = [m for m in self.args.load_methods.split(",") if m]
        saves: dict[str, list] = {m: [] for m in save_methods}
        for rep in range(self.args.reps):
            for m in rotated(save_methods, rep):
                self.settle()
                saves[m].append(self.save(m))
            if self.over_budget(0.6):  # leave time for at least one load repetition
                break
        loads: dict[str, list] = {m: [] for m in load_methods}
        if load_methods:
            targets = {k: torch.zeros_like(v) for k, v in self.state.items()}
            for rep in range(self.args.reps):
                for m in rotated(load_methods, rep):
                    self.settle()
                    loads[m].append(self.load(m, targets))
                if self.over_budget(1.0):
                    break
        return {"rank": self.rank, "state_bytes": self.nbytes, "save": saves, "load": loads}


# ---------------------------------------------------------------- reporting


def rotated(methods: list[str], rep: int) -> list[str]:
    """Repetition r starts with method r: no method always runs right after the same one."""
    k = rep % len(methods) if methods else 0
    return methods[k:] + methods[:k]


def median_of(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if key in r]
    return statistics.median(values) if values else None


def summarize(ranks: list[dict[str, Any]], phase: str) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    r0 = ranks[0][phase]
    for method in r0:
        runs = r0[method]
        if not runs:
            continue
        row = {
            k: median_of(runs, k)
            for k in runs[0]
            if isinstance(runs[0][k], (int, float)) and k != "cold"
        }
        row["reps"] = len(runs)
        row["extra_host_peak_bytes_max_rank"] = max(
            median_of(r[phase][method], "extra_host_peak_bytes") for r in ranks
        )
        if "bitwise" in runs[0]:
            row["bitwise"] = all(x["bitwise"] for r in ranks for x in r[phase][method])
        if "cold" in runs[0]:
            row["cold"] = all(x["cold"] for x in runs)
        out[method] = row
    return out


def to_markdown(result: dict[str, Any]) -> str:
    env = result["env"]
    lines = [
        f"# Storage benchmark ({env['device']}, {env['world']} rank(s))",
        "",
        f"- machine: {env['host']}, {env['cpu']}; torch {env['torch']}; python {env['python']}",
        f"- state: {result['state_gib']:.2f} GiB of fp32 in all ({env['state_layout']}); "
        f"pool {env['pool_mib']} MiB of {env['buffer_mib']} MiB buffers; target dir {env['dir']}",
        f"- {env['when']}; medians over interleaved repetitions; extra host = "
        f"RssAnon+RssShmem over the value before the call (per rank, max over ranks); page "
        f"cache (Cached) reported separately",
        "",
    ]
    for phase in ("save", "load"):
        rows = result[phase]
        if not rows:
            continue
        base = rows.get("raw", {}).get("gib_per_s")
        lines += [
            f"## {phase}",
            "",
            "| method | reps | time s | GiB/s | x raw | extra host peak | left "
            "after | page cache + | notes |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for method, r in rows.items():
            ratio = f"{r['gib_per_s'] / base:.2f}" if base else "-"
            notes = []
            if "hash_share" in r:
                notes.append(f"xxh3 {100 * r['hash_share']:.1f}% of save time (overlapped)")
            if "bitwise" in r:
                notes.append("bitwise" if r["bitwise"] else "NOT BITWISE")
            if r.get("cold") is False:
                notes.append("warm cache (not root)")
            lines.append(
                f"| {method} | {r['reps']} | {r['seconds']:.2f} | {r['gib_per_s']:.2f} | {ratio} | "
                f"{_mib(r['extra_host_peak_bytes_max_rank'])} | {_mib(r['extra_host_left_bytes'])} "
                f"| {_mib(r['page_cache_delta_bytes'])} | {'; '.join(notes)} |"
            )
        lines.append("")
    return "\n".join(lines)


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / (1 << 20):.0f} MiB"


def environment(args: argparse.Namespace, world: int) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    dev = (
        torch.cuda.get_device_name(0) if args.device == "cuda" else f"CPU ({os.cpu_count()} cores)"
    )
    fs = (
        subprocess.run(["df", "-hT", args.dir], capture_output=True, text=True)
        .stdout.strip()
        .splitlines()[-1:]
    )
    return {
        "device": dev,
        "world": world,
        "host": socket.gethostname(),
        "cpu": cpu,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "pool_mib": args.pool_mib,
        "buffer_mib": args.buffer_mib,
        "dir": f"{args.dir} ({' '.join(fs[0].split()[:2]) if fs else '?'})",
        "state_layout": f"{args.tensor_mib} MiB tensors + 64 x 64 KiB",
        "when": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "root": os.geteuid() == 0,
    }


# ---------------------------------------------------------------- entry points


def _rank_main(rank: int, world: int, args: argparse.Namespace, port: int, results: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    torch.cuda.set_device(rank)
    torch.distributed.init_process_group(
        "nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank)
    )
    gloo = torch.distributed.new_group(backend="gloo")
    try:
        results[rank] = Bench(args, rank, world, gloo).run()
    finally:
        torch.distributed.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument(
        "--gib",
        type=float,
        default=None,
        help="state size in GiB, all ranks together (cpu 2, cuda 8)",
    )
    p.add_argument(
        "--world", type=int, default=1, help="ranks (cuda only: one GPU each, NCCL + gloo)"
    )
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tensor-mib", type=int, default=256)
    p.add_argument("--pool-mib", type=int, default=256)
    p.add_argument("--buffer-mib", type=int, default=32)
    p.add_argument(
        "--dir", default="/tmp/ckptguard-bench", help="where the checkpoints are written (the disk)"
    )
    p.add_argument(
        "--out", required=True, help="directory for bench_storage.json and bench_storage.md"
    )
    p.add_argument("--save-methods", default="raw,ours,dcp,torch_save")
    p.add_argument("--load-methods", default="raw,ours,dcp,torch_load_mmap")
    p.add_argument("--cold", action="store_true", help="also drop caches before each save")
    p.add_argument("--settle-s", type=float, default=1.0, help="pause before each timed run")
    p.add_argument(
        "--max-seconds", type=float, default=300.0, help="stop starting new repetitions after this"
    )
    args = p.parse_args()
    if args.gib is None:
        args.gib = 8.0 if args.device == "cuda" else 2.0
    if args.world > 1 and args.device != "cuda":
        p.error("--world > 1 needs --device cuda (one GPU per rank)")
    if "torch_load_mmap" in args.load_methods and "torch_save" not in args.save_methods:
        args.load_methods = ",".join(
            m for m in args.load_methods.split(",") if m != "torch_load_mmap"
        )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.world == 1:
        ranks = [Bench(args, 0, 1, None).run()]
    else:
        import torch.multiprocessing as mp

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
        manager = mp.Manager()
        shared = manager.dict()
        mp.spawn(_rank_main, args=(args.world, args, port, shared), nprocs=args.world, join=True)
        ranks = [shared[r] for r in range(args.world)]
    result = {
        "env": environment(args, args.world),
        "args": vars(args),
        "state_gib": sum(r["state_bytes"] for r in ranks) / GiB,
        "save": summarize(ranks, "save"),
        "load": summarize(ranks, "load"),
        "raw_runs": ranks,
    }
    out = Path(args.out)
    (out / "bench_storage.json").write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    (out / "bench_storage.md").write_text(to_markdown(result) + "\n")
    print(to_markdown(result))
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
