"""Object-store save and restore against raw PUT/GET of the same bytes on the same server, same run.

Starts an S3 server on 127.0.0.1 in its own process (moto's ``moto_server``, or ministack from
``.venv-ministack``), commits a state of SIZE MiB once locally, then REPS times, interleaved:

- raw PUT: boto3's own ``upload_file`` of the step's files (the same part size and concurrency,
  its default CRC32 checksums), into a scratch prefix;
- publish: the store stage's publish (``_core.storestage.StoreStage.published``, what
  ``CheckpointManager("s3://...").save`` runs after its staging commit) of a newly committed local
  step (parts with CRC32, owner record, marker by conditional create, tracker by If-Match), then
  rotation (KeepLast(1)) timed on its own;
- raw GET: boto3's ``download_file`` of the same objects;
- fetch: ``ObjectStore.fetch`` of the committed step (ranged GETs with If-Match, xxh3 check, fsync);
- restore: ``CheckpointManager("s3://...").restore`` end to end into an empty staging root (resolve,
  fetch, then the local restore with its digest checks).

Reports medians, MiB/s and the ratios publish/PUT and fetch/GET (target >= 0.9).

    python benchmarks/bench_objectstore.py --server moto --size 256 --reps 3 \\
        --out benchmarks/results
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import boto3
import boto3.s3.transfer
import torch

import ckptguard as cg
from ckptguard import ObjectStoreOptions, StateOptions, StorageOptions
from ckptguard._commit import storepublish
from ckptguard._core.storestage import StoreStage
from ckptguard._resume.storefetch import resolve

MIB = 1 << 20
MINISTACK = Path(__file__).resolve().parent.parent / ".venv-ministack" / "bin" / "ministack"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(kind: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    if kind == "moto":
        cmd = [
            str(Path(sys.executable).with_name("moto_server")),
            "-H",
            "127.0.0.1",
            "-p",
            str(port),
        ]
        env = dict(os.environ)
    else:
        cmd = [str(MINISTACK)]
        env = dict(os.environ, BIND_HOST="127.0.0.1", GATEWAY_PORT=str(port), LOG_LEVEL="ERROR")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"the {kind} server did not listen on 127.0.0.1:{port} within 60 s")


def files_of(step_dir: Path) -> list[tuple[str, Path]]:
    manifest = json.loads((step_dir / "manifest.json").read_text())
    return [(f["path"], step_dir / f["path"]) for f in manifest["files"]]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--server", choices=("moto", "ministack"), default="moto")
    ap.add_argument("--size", type=int, default=256, help="MiB of tensor state")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--part-mib", type=int, default=16)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/bench-objectstore"))
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    a = ap.parse_args()
    for k, v in {
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }.items():
        os.environ.setdefault(k, v)
    shutil.rmtree(a.dir, ignore_errors=True)
    proc, endpoint = start_server(a.server)
    try:
        result = run(a, endpoint)
    finally:
        proc.terminate()
        proc.wait(30)
    write(a, result)


def run(a: argparse.Namespace, endpoint: str) -> dict[str, object]:
    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket="bench")
    part = a.part_mib * MIB
    options = ObjectStoreOptions(
        endpoint_url=endpoint,
        path_style=True,
        part_bytes=part,
        threads=a.threads,
        max_inflight_bytes=a.threads * part,
    )
    transfer = boto3.s3.transfer.TransferConfig(
        multipart_threshold=part,
        multipart_chunksize=part,
        max_concurrency=a.threads,
        use_threads=True,
    )
    n = a.size * MIB // 4 // 4
    state = {f"t{i}": torch.randn(n) for i in range(4)}
    # rotation is timed on its own (after publish): a listing, marker reads and deletes, no data
    # transfer
    config = cg.CheckpointConfig(
        state=StateOptions(capture_rng=False),
        retention=None,
        storage=StorageOptions(object_store=options, object_staging=a.dir / "stage"),
    )
    keep = cg.KeepLast(1)
    # The two halves of CheckpointManager("s3://bench/run").save, timed apart: the staging commit,
    # the publish.
    stage = StoreStage(
        "s3://bench/run", a.dir / "stage", config, process_group=None, namespace="bench"
    )
    local = cg.CheckpointManager(a.dir / "stage", config=stage.local_config)
    times: dict[str, list[float]] = {
        k: []
        for k in ("local_commit", "raw_put", "publish", "rotate", "raw_get", "fetch", "restore")
    }
    nbytes = 0
    for rep in range(1, a.reps + 1):
        t = time.perf_counter()
        step_dir = local.save(rep, state)
        times["local_commit"].append(time.perf_counter() - t)
        assert step_dir is not None
        files = files_of(step_dir)
        nbytes = sum(p.stat().st_size for _, p in files)
        t = time.perf_counter()
        for rel, path in files:
            client.upload_file(str(path), "bench", f"raw/{rep}/{rel}", Config=transfer)
        times["raw_put"].append(time.perf_counter() - t)
        t = time.perf_counter()
        stage.published(rep, step_dir)
        times["publish"].append(time.perf_counter() - t)
        t = time.perf_counter()
        storepublish.rotate(stage.store, keep, {rep})
        times["rotate"].append(time.perf_counter() - t)
        got = a.dir / f"raw-get-{rep}"
        t = time.perf_counter()
        for rel, _ in files:
            (got / rel).parent.mkdir(parents=True, exist_ok=True)
            client.download_file("bench", f"raw/{rep}/{rel}", str(got / rel), Config=transfer)
        times["raw_get"].append(time.perf_counter() - t)
        marker = resolve(stage.store).marker
        assert marker is not None and marker.step == rep
        t = time.perf_counter()
        stage.store.fetch(marker, a.dir / f"fetch-{rep}")
        times["fetch"].append(time.perf_counter() - t)
        # the writer above still holds the write lease (as a live job would): the reader says it may
        # read anyway
        fresh = cg.CheckpointManager(
            "s3://bench/run",
            config=dataclasses.replace(
                config,
                storage=dataclasses.replace(
                    config.storage, object_staging=a.dir / f"restore-{rep}"
                ),
            ),
        )
        into = {k: torch.empty_like(v) for k, v in state.items()}
        t = time.perf_counter()
        assert fresh.restore(into, break_lease=True) == rep
        times["restore"].append(time.perf_counter() - t)
        assert all(torch.equal(into[k], state[k]) for k in state)
        fresh.close()  # releases no lease: the lease is the writer's
        for d in (got, a.dir / f"fetch-{rep}", a.dir / f"restore-{rep}"):
            shutil.rmtree(d, ignore_errors=True)
        print(
            f"rep {rep}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()), flush=True
        )
    local.close()
    stage.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "server": a.server,
        "endpoint": "127.0.0.1 (own process)",
        "bytes": nbytes,
        "reps": a.reps,
        "part_bytes": part,
        "threads": a.threads,
        "times_s": times,
        "median_s": med,
        "mib_s": {k: nbytes / MIB / v for k, v in med.items()},
        "publish_vs_put": med["raw_put"] / med["publish"],
        "fetch_vs_get": med["raw_get"] / med["fetch"],
        "restore_vs_get": med["raw_get"] / med["restore"],
        "machine": f"{platform.node()} {os.cpu_count()} cores (load average "
        f"{os.getloadavg()[0]:.1f} at the end: "
        f"a shared machine), torch {torch.__version__}, boto3 {boto3.__version__}",
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(sys.argv),
    }


def write(a: argparse.Namespace, r: dict[str, object]) -> None:
    a.out.mkdir(parents=True, exist_ok=True)
    stem = f"objectstore_{a.server}"
    (a.out / f"{stem}.json").write_text(json.dumps(r, indent=1) + "\n")
    med, mib = r["median_s"], r["mib_s"]
    assert isinstance(med, dict) and isinstance(mib, dict)
    rows = "\n".join(f"| {k} | {med[k]:.2f} | {mib[k]:.0f} |" for k in med)
    (a.out / f"{stem}.md").write_text(
        f"# Object store ({r['server']}) vs raw PUT/GET of the same bytes "
        f"({int(r['bytes']) / MIB:.0f} MiB, "  # type: ignore[call-overload]
        f"median of {r['reps']}, part {a.part_mib} MiB, {a.threads} threads)\n\n"
        "| phase | median s | MiB/s |\n|---|---|---|\n" + rows + "\n\n"
        f"publish / raw PUT throughput: **{r['publish_vs_put']:.3f}**; fetch / raw GET: "
        f"**{r['fetch_vs_get']:.3f}** "
        f"(target >= 0.9); restore end to end / raw GET: {r['restore_vs_get']:.3f}\n\n"
        f"{r['machine']}, {r['date']}\n\n`{r['command']}`\n"
    )
    print((a.out / f"{stem}.md").read_text())


if __name__ == "__main__":
    main()
