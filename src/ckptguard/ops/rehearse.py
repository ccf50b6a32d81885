"""Rehearse a long run's resume before the long run (the guide, 3.2 and 6).

Contract: run the user's training command (which uses ckptguard on ``root``) until its
first save commits (the tracker moves), SIGKILL its whole process group, relaunch the
same command, wait for its restore record and its first update record, stop it, and
evaluate the proof gates. Every wait is bounded by ``timeout_s``. The command must be
the one the long run will use: same save path, same layout.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._commit import layout as _layout
from .._resume.prooflog import read_records
from ..errors import CheckpointError, RehearsalError
from .prove import Gate, evaluate


@dataclass
class Rehearsal:
    gates: list[Gate]
    step: int
    cost: dict[str, Any] | None
    log: Path


def _wait(what: str, ready: Callable[[], bool], proc: subprocess.Popen[bytes], timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if proc.poll() is not None:
            raise RehearsalError(f"rehearse: the command exited ({proc.returncode}) before {what}; see {log}")
        if time.monotonic() > deadline:
            _kill(proc)
            raise RehearsalError(f"rehearse: no {what} within {timeout_s:.0f} s; see {log} (raise --timeout if slow)")
        time.sleep(0.2)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _committed_step(root: Path, after: int) -> int | None:
    try:
        step = _layout.read_tracker(root)
    except CheckpointError:
        return None
    return step if step is not None and step > after else None


def _exported(root: Path, step: int) -> bool:
    """The saving run recorded the export of ``step`` on every rank (the export gate's reference)."""
    per_rank = read_records(root)
    return bool(per_rank) and all(
        any(r["event"] == "export" and r.get("step") == step for r in records) for records in per_rank.values()
    )


def _resumed(root: Path, step: int, since: float) -> bool:
    """A restore of ``step`` after ``since``, followed by an update in the same process, on every rank."""
    per_rank = read_records(root)
    if not per_rank:
        return False
    for records in per_rank.values():
        restores = [i for i, r in enumerate(records) if r["event"] == "restore" and r.get("step") == step
                    and r["time"] >= since]
        if not restores or not any(r["event"] == "update" and r["pid"] == records[restores[-1]]["pid"]
                                   for r in records[restores[-1] + 1:]):
            return False
    return True


def rehearse(cmd: Sequence[str], root: Path, *, timeout_s: float = 600.0, workdir: Path | None = None,
             echo: Callable[[str], None] = lambda s: None) -> Rehearsal:
    root = Path(root).absolute()
    start_step = _layout.read_tracker(root) or 0 if root.exists() else 0
    log = Path(workdir or root.parent) / f"rehearse-{int(time.time())}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        echo(f"[1/3] running until the first save commits under {root}")
        first = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        _wait("first committed save", lambda: _committed_step(root, start_step) is not None, first, timeout_s, log)
        step = _committed_step(root, start_step) or 0
        # The export gate compares with the saving run's export of this step: give it a moment
        # to record it (a run that records no exports simply times out here and is killed).
        with contextlib.suppress(RehearsalError):
            _wait(f"export of step {step}", lambda: _exported(root, step), first, min(30.0, timeout_s), log)
        _kill(first)
        step = _layout.read_tracker(root) or 0  # read after the kill: a later save may have committed
        echo(f"      step {step} committed; SIGKILLed the whole process group (pid {first.pid})")
        echo("[2/3] relaunching the same command; waiting for its restore and first update")
        since = time.time()
        second = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        _wait(f"restore of step {step} and a first update", lambda: _resumed(root, step, since), second,
              timeout_s, log)
        _kill(second)
    echo("[3/3] evaluating the proof gates")
    manifest = json.loads((root / _layout.StepNaming(_template(root, step)).name(step) / "manifest.json").read_text())
    return Rehearsal(evaluate(root), step, manifest.get("cost"), log)


def _template(root: Path, step: int) -> str:
    """The step directory template the run used, read back from its newest manifest."""
    for path in sorted(root.iterdir(), reverse=True):
        manifest = path / _layout.MANIFEST_NAME
        if path.is_dir() and manifest.exists():
            return json.loads(manifest.read_text()).get("dir_template") or "step_{step:08d}"
    return "step_{step:08d}"
