"""Lower the CPU and I/O priority of a background thread, so a pending save does not slow training.

Contract: ``lower_this_thread()`` raises the calling thread's nice value by ``NICE_STEP`` (per
thread on Linux, where every thread is its own task) and sets its I/O priority to best-effort
level 7 with ``ioprio_set``; threads it starts afterwards inherit both. Only the background save
thread calls it: an unprivileged process can lower a priority but never raise it back, so the
training thread's is never touched. Returns what it changed; on other systems, or where a call
is refused, it changes nothing and says so (never an error: priority is an optimisation).
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading

NICE_STEP = 10
_IOPRIO_WHO_PROCESS = 1
_IOPRIO_CLASS_BE = 2
_IOPRIO_CLASS_SHIFT = 13
_SYS_IOPRIO_SET = {"x86_64": 251, "aarch64": 30, "ppc64le": 273}


def lower_this_thread() -> list[str]:
    changed: list[str] = []
    tid = threading.get_native_id()
    if hasattr(os, "setpriority"):
        try:
            now = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, min(19, now + NICE_STEP))
            changed.append(f"nice {now} -> {min(19, now + NICE_STEP)}")
        except OSError:
            pass
    number = _SYS_IOPRIO_SET.get(platform.machine())
    if number is not None and platform.system() == "Linux":
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            value = (_IOPRIO_CLASS_BE << _IOPRIO_CLASS_SHIFT) | 7
            if libc.syscall(number, _IOPRIO_WHO_PROCESS, tid, value) == 0:
                changed.append("ioprio best-effort/7")
        except (OSError, AttributeError):
            pass
    return changed
