"""Builders and checks for the tests of damaged and hostile roots (test_gc_safety.py,
test_confinement.py, test_single_writer.py, test_cli_honest_answers.py).

Each such test builds a small real checkpoint through the public API, damages it (a lost
tracker, a symlink, a FIFO, a malformed file...), and runs a public entry point on it:
``ckptguard.cli.main`` in-process (CliRunner) when a failure can only be a wrong answer or a
traceback, a subprocess with a timeout when it can be a hang.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from click.testing import CliRunner, Result

import ckptguard as cg
from ckptguard import StorageOptions
from ckptguard.cli import main

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"
DEEP = (
    "[" * 100_000 + "]" * 100_000
)  # one JSON value nested 100k deep: RecursionError in json.loads


def tiny_root(
    root: Path, steps=(1, 2), *, template: str = "step_{step:08d}", mib: float = 0.0
) -> Path:
    """A root with ``steps`` committed (a 4-float tensor each, plus ``mib`` MiB if asked), no
    retention, and no lease: the test process must not look like a live writer of it. It is
    built under another name and renamed, so this process's exit handler, which releases
    the lease of the path it saved to, never reads a lease file a test turned into a FIFO."""
    cfg = cg.CheckpointConfig(storage=StorageOptions(dir_template=template), retention=None)
    build = root.with_name(root.name + ".build")
    mgr = cg.CheckpointManager(build, config=cfg)
    for step in steps:
        state = {"w": torch.full((4,), float(step))}
        if mib:
            state["big"] = torch.randn(int(mib * (1 << 20)) // 4)
        mgr.save(step, state)
    (build / "lease.json").unlink(missing_ok=True)
    os.rename(build, root)
    return root


def step_dir(root: Path, step: int, template: str = "step_{step:08d}") -> Path:
    return root / template.format(step=step)


def committed_on_disk(root: Path) -> list[str]:
    """Names of the directories under root that hold a manifest (whatever the tracker says)."""
    return sorted(
        p.name
        for p in root.iterdir()
        if p.is_dir() and not p.is_symlink() and (p / MANIFEST).is_file()
    )


def cli(*args: object) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args])


def no_traceback(result: Result, what: str) -> None:
    """The CLI's rule: a clear message, never an exception escaping the command (``what``: the
    case, for the failure message)."""
    exc = result.exception
    assert exc is None or isinstance(exc, SystemExit), (
        f"{what}: the command raised {type(exc).__name__}: {exc} instead of a clear "
        f"message\n{result.output}"
    )
    assert "Traceback" not in result.output, f"{what}: a traceback in the output\n{result.output}"


def refused(result: Result, what: str) -> None:
    """Exit 1 (failed check) or 2 (bad usage), with a message, never a traceback."""
    no_traceback(result, what)
    assert result.exit_code in (1, 2), (
        f"{what}: exit {result.exit_code}, expected 1 or 2\n{result.output}"
    )


def run_py(
    code: str, *args: object, timeout: float = 60.0, env: dict | None = None
) -> subprocess.CompletedProcess:
    """``python -c code args...`` with this test run's interpreter and sources; killed on
    timeout."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )


def dead_pid() -> int:
    """The PID of a process that has exited and been reaped."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def dead_lease(root: Path, host: str | None = None) -> None:
    """A lease whose owner (on this host) is dead: what a crashed run leaves behind."""
    import socket
    import time

    lease = {
        "host": host or socket.gethostname(),
        "pid": dead_pid(),
        "start": "1",
        "acquired_unix": time.time() - 60,
        "renewed_unix": time.time() - 30,
    }
    (root / "lease.json").write_text(json.dumps(lease))


def rewrite_manifest(step: Path, edit) -> dict:
    """Load the manifest, let ``edit`` change it in place, write it back."""
    manifest = json.loads((step / MANIFEST).read_text())
    edit(manifest)
    (step / MANIFEST).write_text(json.dumps(manifest))
    return manifest


def refresh_entry(step: Path, rel: str) -> None:
    """Make the manifest's size and xxh3 of ``rel`` match the file again (what a careful
    attacker does, so that only the check under test can notice)."""
    import xxhash

    data = (step / rel).read_bytes()
    size, xxh = len(data), xxhash.xxh3_64(data).hexdigest()

    def edit(m: dict) -> None:
        for f in m["files"]:
            if f["path"] == rel:
                f["size"], f["xxh3"] = size, xxh

    rewrite_manifest(step, edit)
