"""The framework venvs (.venv-hf, .venv-vllm, .venv-verl, .venv-ministack) as the tests see them.

``make test`` builds them in the background while the suite starts (their builds are downloads and
unpacking; the suite is CPU). A test that needs one carries ``needs_venv(path, reason=...)``: before
its timeout starts, it waits while that build still runs (``BUILDING`` names the build's process),
then runs if the venv was built (its ``.installed`` stamp, written last), else skips with the
reason."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from ckptguard.ops._proctree import alive

REPO = Path(__file__).resolve().parents[1]
BUILDING = REPO / ".venv-builds.pid"
"""Written by ``make test`` with the pid of the background build, removed when it ends."""
WAIT_S = 1800.0


def _stamp(path: Path) -> Path | None:
    venv = next((p for p in Path(path).parents if p.name.startswith(".venv")), None)
    return None if venv is None else venv / ".installed"


def building() -> bool:
    """Whether ``make test``'s background build of the framework venvs is still running."""
    try:
        pid = int(BUILDING.read_text().strip())
    except (OSError, ValueError):
        return False
    return alive(pid)


def wait_for(path: Path, timeout_s: float = WAIT_S) -> None:
    """Wait while the background build runs and the venv holding ``path`` has no stamp yet."""
    stamp = _stamp(path)
    deadline = time.monotonic() + timeout_s
    while stamp is not None and not stamp.exists() and building() and time.monotonic() < deadline:
        time.sleep(1.0)


def ready(path: Path) -> bool:
    """Whether ``path`` (a venv's python or tool) is there in a venv that finished building."""
    stamp = _stamp(path)
    return Path(path).exists() and (stamp is None or stamp.exists())


def needs_venv(path: Path, reason: str) -> pytest.MarkDecorator:
    return pytest.mark.needs_venv(Path(path), reason=reason)


def vllm_env() -> dict[str, str]:
    """The environment of a job run in the vLLM venv: this repository's source first, one thread,
    offline, a small KV cache, and none of the launcher's rank variables or a caller's VLLM_*
    settings."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "VLLM_"))
    }
    env.update(
        {
            "PYTHONPATH": str(REPO / "src"),
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
        }
    )
    return env


_FIND_SPEC = (
    "import importlib.util, sys; missing = [m for m in sys.argv[1:] if importlib.util.find_spec(m) "
    "is None]; print(' and '.join(missing)); sys.exit(bool(missing))"
)


def missing_packages(python: Path, *packages: str) -> str | None:
    """Why ``python`` cannot run a job needing ``packages`` (None: it can). Installed, not imported
    (importing vllm costs a process 10 s of CPU): a package that is installed and fails to import
    fails the job itself, with its traceback."""
    probe = subprocess.run(
        [str(python), "-c", _FIND_SPEC, *packages],
        capture_output=True,
        text=True,
        env=vllm_env(),
        timeout=300,
    )
    return None if probe.returncode == 0 else f"{python} has no {probe.stdout.strip()} installed"
