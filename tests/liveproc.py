"""A live process on this host besides the test's own, for the tests of whether a writer is gone."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator

from ckptguard._disk.tempfiles import proc_start


@contextlib.contextmanager
def live_process() -> Iterator[tuple[int, str | None]]:
    """(pid, start time) of a process that sleeps until the block ends."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        for _ in range(100):
            if proc_start(proc.pid) is not None:
                break
            time.sleep(0.01)
        yield proc.pid, proc_start(proc.pid)
    finally:
        proc.kill()
        proc.wait()
