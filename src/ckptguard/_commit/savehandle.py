"""``PendingSave``, what ``save_async`` returns: the background thread that commits a staged
snapshot (after the previous save's cleanup, once the staged copies landed, at a lowered CPU and I/O
priority), its figures, and the wait that raises the commit's error once; ``committer``, the commit
it runs."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from .._priority import lower_this_thread
from ..errors import SaveStillRunningError
from ..storage._staging import Fence, StagingPool
from .snapshot import Snapshot

log = logging.getLogger("ckptguard")


def committer(
    commit: Callable[[Snapshot, float, float, bool], Path],
    snap: Snapshot,
    start: float,
    pool: StagingPool | None,
    measure: bool = False,
) -> Callable[[], Path]:
    """The background commit of a staged ``snap``: ``commit(snap, start, blocked_s, measure)``, then
    the pool's slots are free for the next save (also when it failed)."""
    blocked_s = (snap.resumed if snap.resumed is not None else time.monotonic()) - start

    def run() -> Path:
        try:
            return commit(snap, start, blocked_s, measure)
        finally:
            if pool is not None:
                pool.done()

    return run


class PendingSave:
    """A save whose commit runs in the background; ``wait()`` returns its step directory.

    ``cleanup`` (retention, proof pruning) runs in the same thread once the commit is published:
    ``busy()`` is False from then on, so a deletion never holds the next ``save_async``, whose
    snapshot goes on while it runs; its commit (``after``: this save) starts when the cleanup
    ended."""

    def __init__(
        self,
        step: int,
        run: Callable[[], Path],
        blocked_s: float,
        *,
        fence: Fence | None = None,
        started: float | None = None,
        cleanup: Callable[[], None] | None = None,
        after: PendingSave | None = None,
    ) -> None:
        self.step = step
        self.blocked_seconds = blocked_s
        """How long ``save_async`` held the caller (the copies queued; into GPU memory, the
        clones)."""
        self.fence = fence
        self.staged_seconds: float | None = None
        """From the ``save_async`` call until every staged copy had landed (set by the background
        thread)."""
        self.commit_seconds: float | None = None
        """From the ``save_async`` call until the commit was published (or failed)."""
        self.cleanup_seconds: float | None = None
        """How long the cleanup after the commit (retention, proof pruning) took, off the caller's
        path."""
        self.priority: list[str] = []
        """What the background thread lowered (nice, ioprio); empty where the system refused."""
        self._started = started if started is not None else time.monotonic()
        self._result: Path | None = None
        self._error: BaseException | None = None
        self._published = threading.Event()
        self.reported = False
        """True once ``wait()`` raised the error: the manager does not raise it a second time."""
        # Not a daemon: an interpreter exit waits for the commit instead of cutting it off.
        self._thread = threading.Thread(
            target=self._run, args=(run, cleanup, after), name=f"ckptguard-save-{step}"
        )
        self._thread.start()

    @property
    def mutation_wait_seconds(self) -> float:
        """How long later mutations (optimizer step, ``staged()``) waited for this save's reads."""
        return self.fence.waited_s if self.fence is not None else 0.0

    @classmethod
    def completed(cls, step: int, path: Path, blocked_s: float) -> PendingSave:
        return cls(step, lambda: path, blocked_s)

    def _run(
        self, run: Callable[[], Path], cleanup: Callable[[], None] | None, after: PendingSave | None
    ) -> None:
        # Writes, checksums and digests of this save yield the CPU and the disk to training.
        self.priority = lower_this_thread()
        try:
            if after is not None:
                after.join()  # the previous save's cleanup ends before this commit touches the root
            if self.fence is not None:
                self.fence.host_wait()  # the staged copies have landed before anything reads them
                self.staged_seconds = time.monotonic() - self._started
            self._result = run()
        except BaseException as exc:  # kept for wait(), never lost in the thread
            self._error = exc
            log.error(
                "ckptguard: the background save of step %d failed: %s: %s (raised by the next "
                "save, restore or wait)",
                self.step,
                type(exc).__name__,
                exc,
            )
        finally:
            if self.fence is not None:
                self.fence.live_read()  # a failed save reads nothing more: training may go on
            self.commit_seconds = time.monotonic() - self._started
            self._published.set()
        if self._error is None and cleanup is not None:
            began = time.monotonic()
            try:
                cleanup()
            except Exception as exc:  # retention never stops training (Root.rotate logs its own)
                log.warning(
                    "ckptguard: the cleanup after step %d failed: %s: %s",
                    self.step,
                    type(exc).__name__,
                    exc,
                )
            self.cleanup_seconds = time.monotonic() - began

    def busy(self) -> bool:
        """True until the commit was published or failed (the cleanup after it does not count)."""
        return not self._published.is_set()

    def running_seconds(self) -> float:
        return time.monotonic() - self._started

    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self) -> None:
        """Until the thread ended (the cleanup included); raises nothing."""
        self._thread.join()

    def wait(self, timeout: float | None = None) -> Path:
        """Block until the commit and its cleanup finished; raise its error if it failed."""
        start = time.monotonic()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise SaveStillRunningError(
                f"the background save of step {self.step} is still running after "
                f"{time.monotonic() - start:.0f} s; call wait() again (without a "
                f"timeout to block until it ends)",
                step=self.step,
            )
        return self.outcome()

    def outcome(self) -> Path:
        """The published commit's directory, or its error raised (once the commit ended; see
        ``busy``)."""
        self._published.wait()
        if self._error is not None:
            self.reported = True
            raise self._error
        assert self._result is not None
        return self._result
