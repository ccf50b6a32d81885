"""Helpers of tests/storage/s3/test_objectstore.py: S3 servers on 127.0.0.1, a deterministic state,
and writer processes.

``python tests/objstore_helper.py write ENDPOINT URL STAGING LAST [POINT]`` saves steps 1..LAST to
an object-store root through ``CheckpointManager(URL)`` and, when POINT is given, is SIGKILLed at
that fault point of the last step's publish (``ckptguard.testing.kill_at``).
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import venvs

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
ELEMENTS = 3 * (1 << 19)  # 6 MiB of float32: two parts of a 5 MiB part size, the last one short
LEASE_TRIALS = 20
MINISTACK = Path(__file__).resolve().parent.parent / ".venv-ministack" / "bin" / "ministack"


@contextlib.contextmanager
def moto_endpoint(*, set_endpoint: bool = True) -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 in this process (its objects outlive a writer's restart), with
    the fake credentials set while it runs and, with ``set_endpoint``, boto3's ``AWS_ENDPOINT_URL``
    (the CLI and a bare ``ObjectStoreOptions()`` read it); the environment is put back after."""
    from moto import server as moto_server

    saved = {k: os.environ.get(k) for k in (*CREDENTIALS, "AWS_ENDPOINT_URL")}
    os.environ.update(CREDENTIALS)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    if set_endpoint:
        os.environ["AWS_ENDPOINT_URL"] = endpoint
    try:
        yield endpoint
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def ministack_ready() -> bool:
    """Whether the ministack server is installed (waiting while ``make test`` still builds its
    venv)."""
    venvs.wait_for(MINISTACK, timeout_s=240)
    return venvs.ready(MINISTACK)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


class Ministack:
    """A ministack server (its own venv: it pins botocore) in a subprocess on 127.0.0.1."""

    def __init__(self) -> None:
        self.port = free_port()
        env = dict(
            os.environ, BIND_HOST="127.0.0.1", GATEWAY_PORT=str(self.port), LOG_LEVEL="ERROR"
        )
        self.proc = subprocess.Popen(
            [str(MINISTACK)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_port(self.port)
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


class Proxy:
    """An HTTP proxy in front of a store: ``strip`` drops If-None-Match/If-Match (a store without
    conditional writes; ``strip_only``: only on request paths containing that text, a store that
    honours ckptguard's probe but not the markers), ``stall_s`` holds every answer that long (a slow
    store)."""

    def __init__(
        self,
        upstream_port: int,
        *,
        strip: bool = False,
        strip_only: str | None = None,
        stall_s: float = 0.0,
    ) -> None:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                strip = proxy.strip and (proxy.strip_only is None or proxy.strip_only in self.path)
                headers = {
                    k: v
                    for k, v in self.headers.items()
                    if not (strip and k.lower() in ("if-none-match", "if-match"))
                }
                if proxy.stall_s:
                    time.sleep(proxy.stall_s)
                conn = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=30)
                conn.request(self.command, self.path, body=body, headers=headers)
                answer = conn.getresponse()
                data = answer.read()
                self.send_response(answer.status)
                for k, v in answer.getheaders():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.strip, self.strip_only, self.stall_s = (
            strip or strip_only is not None,
            strip_only,
            stall_s,
        )
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Blob(torch.nn.Module):
    """One parameter whose bytes are a function of the step: a restore is checked bit for bit."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(ELEMENTS))


def values_at(step: int) -> torch.Tensor:
    return torch.randn(ELEMENTS, generator=torch.Generator().manual_seed(1000 + step))


def state_at(step: int) -> dict[str, Any]:
    blob = Blob()
    with torch.no_grad():
        blob.w.copy_(values_at(step))
    return {"model": blob, "counter": {"step": step}}


def blank() -> dict[str, Any]:
    return {"model": Blob(), "counter": {"step": -1}}


def options(endpoint: str, **kw: Any) -> Any:
    from ckptguard import ObjectStoreOptions

    return ObjectStoreOptions(
        endpoint_url=endpoint,
        path_style=True,
        part_bytes=5 << 20,
        threads=4,
        **{"attempts": 2, "connect_timeout_s": 2.0, "read_timeout_s": 10.0, **kw},
    )


def config(
    endpoint: str | None = None,
    staging: str | os.PathLike[str] | None = None,
    *,
    base: Any = None,
    **kw: Any,
) -> Any:
    """The tests' config (``base``: another one to start from): ``endpoint``'s store options (``kw``
    over ``options``'s; None: boto3's defaults) and ``staging`` as the s3:// root's staging root."""
    import dataclasses

    import ckptguard as cg

    base = base or cg.CheckpointConfig(timeout_s=60.0, retention=None)
    store = options(endpoint, **kw) if endpoint is not None else None
    return dataclasses.replace(
        base,
        storage=dataclasses.replace(
            base.storage,
            object_store=store,
            object_staging=Path(staging) if staging is not None else None,
        ),
    )


def root(url: str, staging: str | os.PathLike[str], endpoint: str | None = None, **kw: Any) -> Any:
    """A ``CheckpointManager`` on the object-store root ``url`` (its staging root ``staging``)."""
    import ckptguard as cg

    return cg.CheckpointManager(url, config=config(endpoint, staging, **kw))


def store(url: str, endpoint: str) -> Any:
    """A reader of the store at ``url`` of its own (the tracker, markers, steps), beside a
    manager's."""
    from ckptguard.storage.s3 import ObjectStore

    return ObjectStore(url, options(endpoint))


def rewrite_owner(endpoint: str, url: str, step: int, attempt: str, *, host: str, pid: int) -> None:
    """The owner record of ``attempt`` rewritten to name another writer (``host``, ``pid``): what a
    save that died, or one on another host, leaves (the object store's gc judges the writer by
    it)."""
    import boto3

    from ckptguard.storage.s3 import _objrecords as rec

    bucket, _, prefix = url[len("s3://") :].partition("/")
    key = f"{prefix}/step_{step:08d}/{attempt}/{rec.OWNER}"
    writer = rec.Writer(host, pid, None, "1")
    body = rec.Owner(step, attempt, writer, time.time()).to_bytes()
    boto3.client("s3", endpoint_url=endpoint).put_object(Bucket=bucket, Key=key, Body=body)


def dead_pid() -> int:
    """The PID of a process of this host that has exited."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def write(endpoint: str, url: str, staging: str, last: int, point: str | None) -> None:
    from ckptguard.testing import kill_at

    ckpt = root(url, staging, endpoint)
    start = ckpt.restore(blank()) + 1
    for step in range(start, last + 1):
        if step == last and point:
            kill_at(point)
        ckpt.save(step, state_at(step))
    ckpt.close()


if __name__ == "__main__":
    os.environ.update(CREDENTIALS)
    if sys.argv[1] == "write":
        write(
            sys.argv[2],
            sys.argv[3],
            sys.argv[4],
            int(sys.argv[5]),
            sys.argv[6] if len(sys.argv) > 6 else None,
        )


def race_worker(
    races: list[tuple[str, str, str]],
    role: int,
    trials: int,
    barrier: Any,
    out: Any,
    data_path: str,
) -> None:
    """One of two writer processes racing on ``trials`` fresh roots per race ``(endpoint, bucket,
    kind)``: kind "step" (both commit step 1), "tracker" (steps 5 and 7: both markers commit, the
    tracker must end at 7) or "lease" (both take the write lease)."""
    os.environ.update(CREDENTIALS)
    for endpoint, bucket, kind in races:
        for trial in range(trials if kind != "lease" else LEASE_TRIALS):
            out.put(
                (
                    endpoint,
                    kind,
                    trial,
                    role,
                    *_race_once(endpoint, bucket, kind, role, trial, barrier, data_path),
                )
            )


def _race_once(
    endpoint: str, bucket: str, kind: str, role: int, trial: int, barrier: Any, data_path: str
) -> tuple[int, str | None, str]:
    from ckptguard._commit import storelease, storepublish
    from ckptguard.errors import CommitConflictError, LeaseHeldError
    from ckptguard.storage.s3 import ObjectStore, StoredObject

    size = os.path.getsize(data_path)
    store = ObjectStore(f"s3://{bucket}/{kind}-{trial:03d}", options(endpoint))
    step = 1 if kind == "step" else (5, 7)[(role + trial) % 2]
    barrier.wait(60)
    result, attempt = "lost", None
    try:
        store.ensure_root()  # both create the root record and tracker 0 at once, too
        barrier.wait(60)
        if kind == "lease":
            storelease.acquire(store, f"writer-{role}")
            return step, None, "won"
        attempt = storepublish.begin(store, step)
        etags = store.upload(step, attempt, [("state/data.bin", Path(data_path), size)])
    except (CommitConflictError, LeaseHeldError) as exc:
        result = f"lost: {exc}"
        if kind == "lease":
            return step, None, result
    barrier.wait(60)
    if attempt is not None:
        try:
            storepublish.commit(
                store,
                step,
                attempt,
                {"state/data.bin": StoredObject(size, "0", etags["state/data.bin"])},
                {"role": role},
            )
            result = "won"
        except CommitConflictError as exc:
            result = f"lost: {exc}"
    return step, attempt, result


# ---------------------------------------------------------------- a training job killed inside the
# upload window


def _train_state(rank: int) -> dict[str, Any]:
    """w and its SGD momentum: 12 MiB of DCP data (three 5 MiB parts, on rank 0), a counter per
    rank."""
    model = Blob()
    with torch.no_grad():
        model.w.copy_(values_at(0))
    optim = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return {"model": model, "optim": optim, "counter": {"step": 0, "rank": rank}}


def _train_step(state: dict[str, Any], step: int) -> None:
    """One deterministic optimizer step (the same on every rank: the tensors are replicated)."""
    target = torch.randn(ELEMENTS, generator=torch.Generator().manual_seed(7000 + step))
    state["optim"].zero_grad()
    loss = ((state["model"].w - target) ** 2).mean()
    loss.backward()
    state["optim"].step()
    state["counter"]["step"] = step


def _fingerprint(state: dict[str, Any]) -> dict[str, Any]:
    import hashlib

    w = state["model"].w.detach()
    buf = state["optim"].state[state["model"].w]["momentum_buffer"]
    return {
        "w": hashlib.sha256(w.numpy().tobytes()).hexdigest(),
        "momentum": hashlib.sha256(buf.numpy().tobytes()).hexdigest(),
        "counter": dict(state["counter"]),
    }


def _kill_everyone(pids: str) -> None:
    """SIGKILL every rank of the job (the peers first, then this one): a node dying takes the job
    down."""
    import signal

    me = os.getpid()
    for path in Path(pids).iterdir():
        pid = int(path.read_text())
        if pid != me:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    os.kill(me, signal.SIGKILL)


def _arm(rank: int, pids: str, kill: tuple[int, int, int, float]) -> None:
    """Kill the job inside the upload window of the step being saved: when rank ``killer`` has
    uploaded its ``k``-th part or file, ``delay_s`` later (other parts still in flight); rank 0's
    fallback is the moment every rank's upload is in and the marker is not written yet."""
    from ckptguard.testing import set_fault_hook

    _, killer, k, delay_s = kill
    count = [0]

    def on_part() -> None:
        count[0] += 1
        if count[0] == k:
            time.sleep(delay_s)
            _kill_everyone(pids)

    if rank == killer:
        set_fault_hook("store.part_uploaded", on_part)
    if rank == 0:
        set_fault_hook("store.before_marker", lambda: (time.sleep(delay_s), _kill_everyone(pids)))


def train_job(
    rank: int,
    world: int,
    endpoint: str,
    url: str,
    staging: str,
    pids: str,
    last: int,
    kill: tuple[int, int, int, float] | None,
) -> dict[str, Any]:
    """One launch of a 2-rank training job: restore from the store, train and save every step up to
    ``last``; ``kill = (step, killer rank, k, delay_s)`` kills the whole job inside that step's
    upload."""
    os.environ.update(CREDENTIALS)
    Path(pids, f"rank{rank}").write_text(str(os.getpid()))
    ckpt = root(url, staging, endpoint)
    state = _train_state(rank)
    start = ckpt.restore(state)
    for step in range(start + 1, last + 1):
        _train_step(state, step)
        if kill is not None and step == kill[0]:
            _arm(rank, pids, kill)
        ckpt.save(step, state)
    ckpt.close()
    return {"restored": start, **_fingerprint(state)}


def restore_job(rank: int, world: int, endpoint: str, url: str, staging: str) -> dict[str, Any]:
    """Restore the store's tracker step into a fresh state; its fingerprint."""
    os.environ.update(CREDENTIALS)
    ckpt = root(url, staging, endpoint)
    state = _train_state(rank)
    step = ckpt.restore(state)
    ckpt.close()
    return {"restored": step, **_fingerprint(state)}


def trained_to(step: int, rank: int) -> dict[str, Any]:
    """The fingerprint of an uninterrupted run after ``step`` steps, computed here on one thread, as
    the ranks do."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        state = _train_state(rank)
        for s in range(1, step + 1):
            _train_step(state, s)
        return _fingerprint(state)
    finally:
        torch.set_num_threads(threads)


def gc(store: Any, *, min_age_s: float = 0.0, dry_run: bool = False) -> Any:
    """gc of an object store's root: the one procedure (``ops.gc.collect``) over its survey
    (``ops.storegc.StoreRoot``)."""
    from ckptguard.ops.gc import collect
    from ckptguard.ops.storegc import StoreRoot

    return collect(StoreRoot(store, min_age_s=min_age_s), dry_run=dry_run)


def attempts(store: Any, entries: list[tuple[Any, str]]) -> list[str]:
    """The attempts among gc's entries (a report's ``removed`` or ``kept``), as ``step/attempt``
    under the store's root; ``s3://...`` entries only (an upload's entry names its upload too)."""
    head = store.where("")
    found = [str(w)[len(head) :] for w, _ in entries if str(w).startswith(head)]
    return [f for f in found if f.count("/") == 1 and " " not in f]


def foreign(report: Any) -> list[str]:
    """The bucket keys gc left alone as not ckptguard's."""
    from ckptguard.ops.storegc import FOREIGN

    return [str(w).split("/", 3)[3] for w, why in report.kept if why == FOREIGN]
