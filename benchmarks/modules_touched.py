"""How many ckptguard modules one single-rank ``save`` and one ``restore`` pass through (issue 40).

A newcomer follows a save by reading the modules it enters; this counts them. In a fresh process
(one rank, no process group), the toy job's state is saved once untraced (step 1: the root is
created, the staging decided), then ``sys.setprofile`` and ``threading.setprofile`` record the
module of every Python function entered, in every thread, during ``save(2, state)`` and, on a new
manager over the same root, during ``restore(state)``. A module counts once however often it is
entered; ``ckptguard.*`` modules only (torch, DCP and the standard library are not counted, nor
``ckptguard.demo``: the user's job, whose ``state_dict`` the save calls). Threads the call started
and left running when it returned (the save_async staging a restore prepares in the background) are
followed to their end, so the figure does not depend on how far they got; the modules only they
entered are listed apart (``*``, ``*_background``).

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


def touched(call: Callable[[], Any]) -> tuple[list[str], list[str]]:
    """The ckptguard modules whose functions ``call`` entered, in any thread, sorted; and those of
    them that only the background work it left running entered (threads it started that were still
    alive when it returned, followed to their end, so the figure does not depend on how far they got
    by then)."""
    seen: dict[str, set[int]] = {}
    before = set(threading.enumerate())

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            name = frame.f_globals.get("__name__", "")
            if (name == "ckptguard" or name.startswith("ckptguard.")) and not name.startswith(
                "ckptguard.demo"
            ):
                seen.setdefault(name, set()).add(threading.get_ident())

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        call()
        left = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    for t in left:  # their own profile stays set until they end
        t.join(timeout=120)
    background = {t.ident for t in left}
    return sorted(seen), sorted(m for m, idents in seen.items() if idents <= background)


def measure(root: Path) -> dict[str, list[str]]:
    job = build_job()
    train_step(job)
    mgr = cg.CheckpointManager(root)
    mgr.save(1, job.state())  # untraced: the first save creates the root
    train_step(job)
    state = job.state()
    save, save_bg = touched(lambda: mgr.save(2, state))
    fresh = build_job(seed=1).state()
    again = cg.CheckpointManager(root)
    restore, restore_bg = touched(lambda: again.restore(fresh))
    return {
        "save": save,
        "save_background": save_bg,
        "restore": restore,
        "restore_background": restore_bg,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="the module lists as JSON")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        found = measure(Path(tmp) / "ck")
    if a.json:
        print(json.dumps(found, indent=1))
        return
    for what in ("save", "restore"):
        modules, background = found[what], set(found[f"{what}_background"])
        print(
            f"{what}: {len(modules)} modules ({len(background)} only in background "
            f"work it left running, marked *)"
        )
        for m in modules:
            print(f"  {m}{' *' if m in background else ''}")


if __name__ == "__main__":
    main()
