"""Helpers of tests/test_objectstore.py: S3 servers on 127.0.0.1, a deterministic state, and writer processes.

``python tests/objstore_helper.py write ENDPOINT URL STAGING LAST [POINT]`` saves steps 1..LAST to an
object-store root through ``ObjectStoreCheckpoint`` and, when POINT is given, is SIGKILLed at that
fault point of the last step's publish (``ckptguard.testing.kill_at``).
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import os
import socket
import subprocess
import sys
import threading
import time
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


def ministack_ready() -> bool:
    """Whether the ministack server is installed (waiting while ``make test`` still builds its venv)."""
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
        env = dict(os.environ, BIND_HOST="127.0.0.1", GATEWAY_PORT=str(self.port), LOG_LEVEL="ERROR")
        self.proc = subprocess.Popen([str(MINISTACK)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port)
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


class Proxy:
    """An HTTP proxy in front of a store: ``strip`` drops If-None-Match/If-Match (a store without
    conditional writes), ``stall_s`` holds every answer that long (a slow store)."""

    def __init__(self, upstream_port: int, *, strip: bool = False, stall_s: float = 0.0) -> None:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {k: v for k, v in self.headers.items()
                           if not (proxy.strip and k.lower() in ("if-none-match", "if-match"))}
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

        self.strip, self.stall_s = strip, stall_s
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
    from ckptguard.objectstore import ObjectStoreOptions

    return ObjectStoreOptions(endpoint_url=endpoint, path_style=True, part_bytes=5 << 20, threads=4,
                              **{"attempts": 2, "connect_timeout_s": 2.0, "read_timeout_s": 10.0, **kw})


def config() -> Any:
    import ckptguard as cg

    return cg.CheckpointConfig(timeout_s=60.0, retention=None)


def write(endpoint: str, url: str, staging: str, last: int, point: str | None) -> None:
    from ckptguard.objectstore import ObjectStoreCheckpoint
    from ckptguard.testing import kill_at

    ckpt = ObjectStoreCheckpoint(url, staging=staging, options=options(endpoint), config=config())
    start = ckpt.restore(blank()) + 1
    for step in range(start, last + 1):
        if step == last and point:
            kill_at(point)
        ckpt.save(step, state_at(step))
    ckpt.close()


if __name__ == "__main__":
    os.environ.update(CREDENTIALS)
    if sys.argv[1] == "write":
        write(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6] if len(sys.argv) > 6 else None)


def race_worker(races: list[tuple[str, str, str]], role: int, trials: int, barrier: Any, out: Any,
                data_path: str) -> None:
    """One of two writer processes racing on ``trials`` fresh roots per race ``(endpoint, bucket, kind)``:
    kind "step" (both commit step 1), "tracker" (steps 5 and 7: both markers commit, the tracker must
    end at 7) or "lease" (both take the write lease)."""
    os.environ.update(CREDENTIALS)
    for endpoint, bucket, kind in races:
        for trial in range(trials if kind != "lease" else LEASE_TRIALS):
            out.put((endpoint, kind, trial, role, *_race_once(endpoint, bucket, kind, role, trial, barrier, data_path)))


def _race_once(endpoint: str, bucket: str, kind: str, role: int, trial: int, barrier: Any,
               data_path: str) -> tuple[int, str | None, str]:
    from ckptguard.errors import CommitConflictError, LeaseHeldError
    from ckptguard.storage.objectstore import ObjectStore, StoredObject

    size = os.path.getsize(data_path)
    store = ObjectStore(f"s3://{bucket}/{kind}-{trial:03d}", options(endpoint))
    step = 1 if kind == "step" else (5, 7)[(role + trial) % 2]
    barrier.wait(60)
    result, attempt = "lost", None
    try:
        store.ensure_root()  # both create the root record and tracker 0 at once, too
        barrier.wait(60)
        if kind == "lease":
            store.acquire_lease(f"writer-{role}")
            return step, None, "won"
        attempt = store.begin(step)
        etags = store.upload(step, attempt, [("state/data.bin", Path(data_path), size)])
    except (CommitConflictError, LeaseHeldError) as exc:
        result = f"lost: {exc}"
        if kind == "lease":
            return step, None, result
    barrier.wait(60)
    if attempt is not None:
        try:
            store.commit(step, attempt, {"state/data.bin": StoredObject(size, "0", etags["state/data.bin"])},
                         {"role": role})
            result = "won"
        except CommitConflictError as exc:
            result = f"lost: {exc}"
    return step, attempt, result
