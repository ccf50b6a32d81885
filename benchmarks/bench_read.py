"""How fast can a checkpoint's own files be read cold, and how close does ckptguard's restore come?

Saves the bench_train_loop state (the 556M-param GPT + AdamW by default) once with ckptguard, then,
with the page cache dropped before every run, reads the checkpoint's data files:

- ``probe``: bench_train_loop's disk probe (one thread, 64 MiB buffered reads) over these files;
- ``buffered:T:C``: T threads pread interleaved C MiB spans (the pattern of ckptguard's reader);
- ``regions:T:C``: T threads, each through its own descriptor, read one contiguous stretch each;
- ``direct:T:C``: the same with ``O_DIRECT`` into page-aligned buffers (no page cache, no
  readahead);
- ``direct_h2d:T:C``: ``O_DIRECT`` into pinned buffers, each span copied to one GPU tensor (a load's
  whole pipeline without the planning);

and restores the checkpoint with ckptguard (``restore:threads``), each into a fresh model and
optimizer, checked bitwise against the saved state. Figures in GiB/s and as x the probe.

    python3 benchmarks/bench_read.py --out results.json --dir /tmp/cgread
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import bench_train_loop as tl

import ckptguard as cg

GiB = 1 << 30
MiB = 1 << 20


def data_files(step_dir: Path) -> list[Path]:
    return sorted(p for p in step_dir.rglob("*.distcp") if p.is_file())


def probe(files: list[Path]) -> int:
    buf = bytearray(64 * MiB)
    total = 0
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return total


def spans(files: list[Path], chunk: int) -> list[tuple[Path, int, int]]:
    out = []
    for path in files:
        size = path.stat().st_size
        out += [(path, off, min(chunk, size - off)) for off in range(0, size, chunk)]
    return out


def threaded(
    files: list[Path],
    threads: int,
    chunk: int,
    *,
    direct: bool,
    gpu: torch.Tensor | None,
    regions: bool = False,
) -> int:
    work = spans(files, chunk)
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    fds = {p: os.open(p, flags) for p in files}
    if (
        regions
    ):  # thread i: the i-th contiguous stretch of spans, through its own descriptor (own readahead)
        per = -(-len(work) // threads)
        parts = [work[i * per : (i + 1) * per] for i in range(threads)]
    else:
        parts = [work[i::threads] for i in range(threads)]
    done = [0] * threads
    lock = threading.Lock()
    stream = torch.cuda.Stream() if gpu is not None else None
    pos = {"gpu": 0}

    def worker(i: int) -> None:
        m = mmap.mmap(-1, chunk, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        t = torch.frombuffer(m, dtype=torch.uint8, count=chunk)
        if gpu is not None:
            torch.cuda.cudart().cudaHostRegister(t.data_ptr(), chunk, 0)
        view = memoryview(m)
        ev = None
        own = {p: os.open(p, flags) for p in files} if regions else fds
        for path, off, n in parts[i]:
            if ev is not None:
                ev.synchronize()
            want = (n + 4095) // 4096 * 4096 if direct else n
            got = 0
            while got < n:
                r = os.preadv(own[path], [view[got:want]], off + got)
                if r <= 0:
                    raise OSError(f"short read {path} at {off + got}")
                got += r
            done[i] += n
            if gpu is not None and stream is not None:
                with lock:
                    at = pos["gpu"] % max(1, gpu.numel() - n)
                    pos["gpu"] += n
                with torch.cuda.stream(stream):
                    gpu[at : at + n].copy_(t[:n], non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(stream)
        if ev is not None:
            ev.synchronize()
        if regions:
            for fd in own.values():
                os.close(fd)
        if gpu is not None:
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
        del t
        view.release()
        m.close()

    ths = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    for fd in fds.values():
        os.close(fd)
    return sum(done)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/cgread"))
    ap.add_argument(
        "--raw",
        default="probe,buffered:1:32,buffered:4:32,direct:4:32,direct_h2d:4:32,direct_h2d:4:64",
        help="raw read variants, comma-separated",
    )
    ap.add_argument(
        "--restores", default="1,2,4", help="ckptguard restores, by StreamingConfig.read_threads"
    )
    ap.add_argument(
        "--rounds", type=int, default=3, help="repetitions of every variant, order rotated"
    )
    tl.add_model_args(ap)
    ap.add_argument("--tiny", action="store_true", help="CPU, tiny sizes: correctness only")
    a = ap.parse_args()
    if a.tiny:
        vars(a).update(tl.TINY_MODEL)

    os.environ.setdefault("CKPTGUARD_QUIET", "1")
    cuda = torch.cuda.is_available() and not a.tiny
    device = torch.device("cuda") if cuda else torch.device("cpu")
    job = tl.Job(a, device, seed=0)
    job.step()
    reference = {k: v.detach().clone() for k, v in job.tensors().items()}
    root = a.dir / "root"
    mgr = cg.CheckpointManager(root, config=cg.CheckpointConfig(retention=None))
    step_dir = mgr.save(1, job.state())
    mgr.close()
    files = data_files(step_dir)
    nbytes = sum(p.stat().st_size for p in files)
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "files": len(files),
        "data_bytes": nbytes,
        "state_bytes": job.nbytes(),
        "raw": [],
    }
    gpu = torch.empty(256 * MiB, dtype=torch.uint8, device=device) if cuda else None
    del job
    fresh = tl.Job(a, device, seed=7)
    fresh.step()  # restored over and over: every restore must overwrite all of it
    variants = [v for v in a.raw.split(",") if v] + [
        f"restore:{t}" for t in a.restores.split(",") if t
    ]
    for r in range(a.rounds):
        # Rotated each round: the disk's speed drifts (a virtual disk), so every variant sees each
        # phase.
        k = r % len(variants)
        for v in variants[k:] + variants[:k]:
            kind, *rest = v.split(":")
            if kind.startswith("direct_h2d") and gpu is None:
                continue
            if kind == "restore":
                with torch.no_grad():
                    for t in fresh.tensors().values():
                        t.zero_()
            tl.drop_cache(step_dir)
            if cuda:
                torch.cuda.synchronize()
            row: dict[str, Any] = {"variant": v, "round": r}
            t = time.perf_counter()
            try:
                if kind == "probe":
                    got = probe(files)
                elif kind == "restore":
                    row["read"] = tl.cg_restore(root, fresh, int(rest[0]))
                    if cuda:
                        torch.cuda.synchronize()
                    got = nbytes
                else:
                    threads, chunk = int(rest[0]), int(rest[1]) * MiB
                    got = threaded(
                        files,
                        threads,
                        chunk,
                        direct=kind.startswith("direct"),
                        gpu=gpu if kind == "direct_h2d" else None,
                        regions=kind == "regions",
                    )
            except OSError as exc:  # O_DIRECT refused by this filesystem (tmpfs): say so, go on
                res["raw"].append({**row, "error": str(exc)})
                continue
            s = time.perf_counter() - t
            row.update(bytes=got, seconds=round(s, 3), gib_s=round(got / GiB / s, 3))
            if kind == "restore":
                now = fresh.tensors()
                row["bitwise_exact"] = set(now) == set(reference) and all(
                    torch.equal(now[n], reference[n]) for n in reference
                )
            res["raw"].append(row)
            print(json.dumps({k2: v2 for k2, v2 in row.items() if k2 != "read"}), flush=True)
    by: dict[str, list[float]] = {}
    for row in res["raw"]:
        if "gib_s" in row:
            by.setdefault(row["variant"], []).append(row["gib_s"])
    med = {v: sorted(xs)[len(xs) // 2] for v, xs in by.items()}
    ref = med.get("probe")
    res["median_gib_s"] = med
    res["median_x_probe"] = {v: round(x / ref, 3) for v, x in med.items()} if ref else {}
    res["all_restores_exact"] = all(r.get("bitwise_exact", True) for r in res["raw"])
    print(json.dumps({"median_x_probe": res["median_x_probe"], "median_gib_s": med}), flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
