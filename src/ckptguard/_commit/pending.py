"""Async save: the caller blocks only for the snapshot; writing and commit run in the background.

Contract: ``stage`` replaces every tensor of a snapshot by a private copy, into spare GPU
memory when the GPU copies fit ``gpu_bytes``, otherwise into host memory within
``host_bytes``; if they fit neither, it returns False and the caller saves synchronously.
``PendingSave`` runs the commit protocol in a thread. The tracker moves only when that
commit completes; an error there is kept and raised by ``wait()``, which the manager
calls before its next collective call, so it is never lost.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import SaveStillRunningError
from .protocol import Snapshot

log = logging.getLogger("ckptguard")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(t: torch.Tensor) -> int:
    local = _local(t)
    return local.numel() * local.element_size()


def _copy(t: torch.Tensor, device: str | None) -> torch.Tensor:
    """A private copy; ``device=None`` keeps the device (spare GPU memory)."""
    if device is None:
        return t.detach().clone()
    if hasattr(t, "to_local"):
        from torch.distributed.tensor import DTensor

        local = t.to_local().detach().to(device, copy=True)
        # t is a DTensor (it has to_local); the stub types it as a plain Tensor.
        return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False,  # type: ignore[attr-defined]
                                  shape=t.shape, stride=t.stride())
    return t.detach().to(device, copy=True)


def stage(snap: Snapshot, *, gpu_bytes: int, host_bytes: int) -> bool:
    """Make the snapshot independent of the live tensors, within the byte budgets."""
    tensors = [(c, k, t) for c in snap.items.values() for k, t in c.tensors.items()]
    on_gpu = sum(_nbytes(t) for _, _, t in tensors if _local(t).is_cuda)
    on_cpu = sum(_nbytes(t) for _, _, t in tensors if not _local(t).is_cuda)
    gpu_fits = on_gpu == 0 or (on_gpu <= gpu_bytes and torch.cuda.mem_get_info()[0] > on_gpu)
    host_needed = on_cpu + (0 if gpu_fits else on_gpu)
    if host_needed > host_bytes:
        return False
    for item, key, t in tensors:
        item.tensors[key] = _copy(t, None if (_local(t).is_cuda and gpu_fits) else "cpu")
    for item in snap.items.values():
        # Plain values, PerRank values and stateful state are live objects too: a counter the
        # trainer bumps while the commit runs must not change what is saved.
        item.skeleton = copy.deepcopy(item.skeleton)
    if on_gpu:
        torch.cuda.synchronize()  # the copies are complete before another thread reads them
    snap.staged_bytes = on_gpu + on_cpu
    return True


class PendingSave:
    """A save whose commit runs in the background; ``wait()`` returns its step directory."""

    def __init__(self, step: int, run: Callable[[], Path], blocked_s: float) -> None:
        self.step = step
        self.blocked_seconds = blocked_s
        """How long ``save_async`` held the caller (the snapshot)."""
        self._result: Path | None = None
        self._error: BaseException | None = None
        self.reported = False
        """True once ``wait()`` raised the error: the manager does not raise it a second time."""
        # Not a daemon: an interpreter exit waits for the commit instead of cutting it off.
        self._thread = threading.Thread(target=self._run, args=(run,), name=f"ckptguard-save-{step}")
        self._thread.start()

    @classmethod
    def completed(cls, step: int, path: Path, blocked_s: float) -> PendingSave:
        return cls(step, lambda: path, blocked_s)

    def _run(self, run: Callable[[], Path]) -> None:
        try:
            self._result = run()
        except BaseException as exc:  # kept for wait(), never lost in the thread
            self._error = exc
            log.error("ckptguard: the background save of step %d failed: %s: %s (raised by the next "
                      "save, restore or wait)", self.step, type(exc).__name__, exc)

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> Path:
        """Block until the commit finished; raise its error if it failed."""
        start = time.monotonic()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise SaveStillRunningError(
                f"the background save of step {self.step} is still running after {time.monotonic() - start:.0f} s; "
                "call wait() again (without a timeout to block until it ends)",
                step=self.step,
            )
        if self._error is not None:
            self.reported = True
            raise self._error
        assert self._result is not None
        return self._result
