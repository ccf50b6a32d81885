"""How many ckptguard modules one single-rank ``save`` and one ``restore`` pass through (issue 40).

A newcomer follows a save by reading the modules it enters; this counts them. In a fresh process
(one rank, no process group), the toy job's state is saved once untraced (step 1: the root is created,
the staging decided), then ``sys.setprofile`` and ``threading.setprofile`` record the module of every
Python function entered, in every thread, during ``save(2, state)`` and, on a new manager over the same
root, during ``restore(state)``. A module counts once however often it is entered; ``ckptguard.*``
modules only (torch, DCP and the standard library are not counted, nor ``ckptguard.demo``: the user's job,
whose ``state_dict`` the save calls).

    python benchmarks/modules_touched.py [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ckptguard as cg
from ckptguard.demo.toyjob import build_job, train_step


def touched(call: Callable[[], Any]) -> list[str]:
    """The ckptguard modules whose functions ``call`` entered, in any thread, sorted."""
    seen: set[str] = set()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            name = frame.f_globals.get("__name__", "")
            if (name == "ckptguard" or name.startswith("ckptguard.")) and not name.startswith("ckptguard.demo"):
                seen.add(name)

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return sorted(seen)


def measure(root: Path) -> dict[str, list[str]]:
    job = build_job()
    train_step(job)
    mgr = cg.CheckpointManager(root)
    mgr.save(1, job.state())  # untraced: the first save creates the root
    train_step(job)
    state = job.state()
    save = touched(lambda: mgr.save(2, state))
    fresh = build_job(seed=1).state()
    again = cg.CheckpointManager(root)
    restore = touched(lambda: again.restore(fresh))
    return {"save": save, "restore": restore}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="the module lists as JSON")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        found = measure(Path(tmp) / "ck")
    if a.json:
        print(json.dumps(found, indent=1))
        return
    for what, modules in found.items():
        print(f"{what}: {len(modules)} modules")
        for m in modules:
            print(f"  {m}")


if __name__ == "__main__":
    main()
