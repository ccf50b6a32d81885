"""A ``TieredCheckpoint.save_async``: how it starts in the caller's thread, and its commits in one
background thread.

``start``: the tiers' ``on_busy`` round decides alike on every rank whether the requested step
starts (``_commit.busy.may_start``; ``OnBusy.FAST_TIER``: ``route_tiered``, which may write it to
the fast tier alone, beside the persistent commit in flight), then each due tier's snapshot is
staged through its manager's hooks (``Parts.commits``) and one ``TieredSave`` commits them in the
background. ``joined``: the tiers' ``prepare_async`` futures as one.

``TieredSave`` runs the due tiers' staged commits one after the other (the fast tier, its replica
push and its cleanup, then the persistent tier and its cleanup); ``wait()`` returns the committed
directories or raises the first failure. A save redirected to the fast tier (``OnBusy.FAST_TIER``)
``overlaps`` the save in flight: its commit starts once that save's fast part and cleanup ended on
this rank (the caller's busy round has seen it ended on every rank), beside that save's persistent
commit; waiting for it (``wait``, ``join``, ``busy``) waits for the save it overlaps too, and raises
that one's error first.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from .._agree import Agreement
from .._commit import replica as _replica
from .._commit.busy import BusyRound, may_start, route_tiered
from .._context import Actions, Context
from .._priority import lower_this_thread
from .._records import manifest as _manifest
from .._types import StateDict
from ..config import OnBusy
from ..errors import CheckpointError, SaveStillRunningError
from ..storage._staging import Fence
from .parts import Parts
from .tierrestore import Tier, after_transfers

log = logging.getLogger("ckptguard")


def durable(paths: dict[Tier, Path]) -> Path | None:
    """A step's directory in the most durable tier it reached: the persistent tier's, else the fast
    tier's."""
    return paths.get(Tier.PERSISTENT, paths.get(Tier.FAST))


class TieredSave:
    """A ``TieredCheckpoint.save_async`` in flight: the tiers' background commits, one after the
    other in one thread (the fast tier, its replica push with ``replicas=1``, then the persistent
    tier). ``wait()`` returns the step's directory as ``save`` does (``outcome()``: each tier's) and
    raises the first failure."""

    def __init__(
        self,
        step: int,
        parts: list[tuple[Tier, Callable[[], Path], Fence]],
        blocked_s: float,
        push: Callable[[], None] | None,
        *,
        cleanups: list[Callable[[], None]] | None = None,
        after: TieredSave | None = None,
        overlaps: TieredSave | None = None,
    ) -> None:
        self.step = step
        self.tiers = [tier for tier, _, _ in parts]
        """The tiers this step is saved to (none: the step is on neither tier's interval)."""
        self.blocked_seconds = blocked_s
        """How long ``save_async`` held the caller (every tier's snapshot and queued copies)."""
        self.priority: list[str] = []
        self.fences = [fence for _, _, fence in parts]
        self._result: dict[Tier, Path] = {}
        self._error: BaseException | None = None
        self._started = time.monotonic() - blocked_s
        self._published = threading.Event()
        self.commit_seconds: float | None = None
        """From the ``save_async`` call until every tier's commit (and the replica push) ended."""
        self.cleanup_seconds: float | None = None
        """How long the tiers' retention and proof pruning took after the commits, off the caller's
        path."""
        self.reported = False
        """True once ``wait()`` raised: ``TieredCheckpoint`` does not raise it a second time."""
        self.overlaps = overlaps
        """The save in flight this one (redirected to the fast tier) was started beside."""
        self.fast_committed = threading.Event()
        """Set once the fast part (commit, replica push) ended, or there is none: the fast tier is
        idle here."""
        self.fast_settled = threading.Event()
        """Set once the fast part and the fast tier's cleanup ended: a redirected save may commit
        there now."""
        if Tier.FAST not in self.tiers:
            self.fast_committed.set()
            self.fast_settled.set()
        # Not a daemon: an interpreter exit waits for the commits instead of cutting them off.
        self._thread = threading.Thread(
            target=self._run,
            args=(parts, push, cleanups or [], after, overlaps),
            name=f"ckptguard-tiers-save-{step}",
        )
        if parts:  # a step on neither interval starts no thread
            self._thread.start()
        else:
            self._published.set()

    @property
    def mutation_wait_seconds(self) -> float:
        """How long later mutations (optimizer step, ``staged()``) waited for this save's reads."""
        return sum(f.waited_s for f in self.fences)

    def all_fences(self) -> list[Fence]:
        """This save's fences and those of the saves it overlaps."""
        return self.fences + (self.overlaps.all_fences() if self.overlaps is not None else [])

    def _run(
        self,
        parts: list[tuple[Tier, Callable[[], Path], Fence]],
        push: Callable[[], None] | None,
        cleanups: list[Callable[[], None]],
        after: TieredSave | None,
        overlaps: TieredSave | None,
    ) -> None:
        self.priority = lower_this_thread()
        if after is not None:
            after.join()  # the previous save's cleanup ends before these commits touch the roots
        if overlaps is not None:
            # its fast cleanup ends before this commit touches the fast root
            overlaps.fast_settled.wait()
        began = 0.0
        try:
            for i, (tier, run, fence) in enumerate(parts):
                self._commit(tier, run, fence, push)
                if tier is Tier.FAST:
                    self.fast_committed.set()
                    began = time.monotonic()
                    self._cleanup(cleanups[i] if i < len(cleanups) else None)
                    self.cleanup_seconds = time.monotonic() - began
                    self.fast_settled.set()
        finally:
            self.fast_committed.set()
            self.fast_settled.set()
            self.commit_seconds = time.monotonic() - self._started
            self._published.set()
        began = time.monotonic()
        for i, (tier, _, _) in enumerate(parts):
            if tier is not Tier.FAST:
                self._cleanup(cleanups[i] if i < len(cleanups) else None)
        self.cleanup_seconds = (self.cleanup_seconds or 0.0) + time.monotonic() - began

    def _cleanup(self, cleanup: Callable[[], None] | None) -> None:
        if cleanup is None or self._error is not None:
            return
        try:
            cleanup()
        except Exception as exc:  # retention never stops training
            log.warning(
                "ckptguard: the cleanup after step %d failed: %s: %s",
                self.step,
                type(exc).__name__,
                exc,
            )

    def _commit(
        self, tier: Tier, run: Callable[[], Path], fence: Fence, push: Callable[[], None] | None
    ) -> None:
        try:
            fence.host_wait()  # the staged copies have landed before anything reads them
            self._result[tier] = run()
            if tier is Tier.FAST and push is not None:
                push()  # after the commit: a replica is never made of an uncommitted step
        except BaseException as exc:  # kept for wait(); the next tier still saves (its own commit)
            self._error = self._error or exc
            log.error(
                "ckptguard: the background save of step %d to the %s tier failed: %s: %s (raised "
                "by the next save, restore or wait)",
                self.step,
                tier.value,
                type(exc).__name__,
                exc,
            )
        finally:
            fence.live_read()  # a failed save reads nothing more: training may go on

    def done(self) -> bool:
        return not self._thread.is_alive()

    def busy(self) -> bool:
        """True until every tier's commit ended, this save's and the one it overlaps (cleanups do
        not count)."""
        return not self._published.is_set() or (self.overlaps is not None and self.overlaps.busy())

    def fast_busy(self) -> bool:
        """True until the fast part (commit, replica push) ended, this save's and the one it
        overlaps."""
        return not self.fast_committed.is_set() or (
            self.overlaps is not None and self.overlaps.fast_busy()
        )

    def running_seconds(self) -> float:
        return time.monotonic() - self._started

    def join(self) -> None:
        if self.tiers:
            self._thread.join()
        if self.overlaps is not None:
            self.overlaps.join()

    def wait(self, timeout: float | None = None) -> Path | None:
        """Block until every tier's commit (and the replica push) and their cleanup ended; raise the
        first error. Returns the step's directory in the most durable tier it reached
        (``outcome()``: each tier's)."""
        if self.overlaps is not None and not self.overlaps.reported:
            self.overlaps.wait(timeout)  # its error first: it was requested first
        if self.tiers:
            self._thread.join(timeout)
        if self._thread.is_alive():
            raise SaveStillRunningError(
                f"the background save of step {self.step} "
                f"({', '.join(t.value for t in self.tiers)} tier) is still running; call wait() "
                f"again (without a timeout to block until it ends)",
                step=self.step,
            )
        return durable(self.outcome())

    def outcome(self) -> dict[Tier, Path]:
        """The tiers' committed directories once the commits ended, or the first error raised (the
        overlapped save's first)."""
        if self.overlaps is not None and not self.overlaps.reported:
            self.overlaps.outcome()
        self._published.wait()
        if self._error is not None:
            self.reported = True
            raise self._error
        return dict(self._result)


def push_replicas(
    ctx: Context, agreement: Agreement, step: int, peers: list[int | None], committed: set[int]
) -> None:
    """Send this rank's files of the fast tier's ``step`` to its peer; a failed replica is a loud
    warning on every rank (the step is committed; only its protection against a lost node is
    missing)."""
    name = ctx.naming.name(step)
    problems: list[str] = []
    try:
        files = _manifest.read(ctx.root / name).files
    except CheckpointError as exc:
        files, problems = (), [f"{type(exc).__name__}: {exc}"]
    try:
        problems += _replica.push(
            root=ctx.root,
            step=step,
            step_name=name,
            manifest_files=files,
            peer_of=peers,
            rank=ctx.rank,
            group=ctx.storage_ctx.process_group,
        )
    except (
        RuntimeError
    ) as exc:  # a peer died mid-transfer (gloo names no rank): the agreement below does
        problems.append(f"the replica transfer broke off: {exc}")
    sources = [r for r, p in enumerate(peers) if p == ctx.rank]
    _replica.prune(ctx.root, ctx.naming, committed | {step}, sources)
    bad = after_transfers(agreement, "tiers.replicas", problems)
    if bad:
        log.warning(
            "ckptguard: step %d is committed in the fast tier but its peer replicas are incomplete "
            "(%s); losing a node now loses this step's files there",
            step,
            " | ".join(bad),
        )


def start(
    step: int,
    state: StateDict,
    due: list[Tier],
    parts: dict[Tier, Parts],
    *,
    health: tuple[bool | None, Any, Any],
    actions: Actions,
    began: float,
    busy: BusyRound,
    policy: OnBusy,
    pending: TieredSave | None,
    wait: Callable[[], Any],
    record: Callable[..., None],
    hold: Callable[[], None],
    push: Callable[[], None] | None,
    adopt: Callable[[TieredSave], None],
) -> TieredSave | None:
    """A tiered ``save_async`` of ``step`` to the ``due`` tiers, started: its ``TieredSave`` (also
    handed to ``adopt``, the tiers' save in flight from now on); None when skipped on every rank, or
    unhealthy. ``pending``: the save in flight before it; ``hold``: the persistent lease taken (not
    beside a commit in flight, whose lease is held already); ``push``: the replica push after the
    fast commit."""
    previous: TieredSave | None = pending
    overlaps: TieredSave | None = None
    # The tiers' one pool: while it is still being prepared, a save is skipped.
    staging = parts[Tier.FAST].staging
    unready = staging.unready_bytes() if staging is not None else 0
    if due and policy is OnBusy.FAST_TIER:
        route = route_tiered(busy, step, pending, record=record, unready=unready)
        if route == "skip":
            return None
        if route == "fast":  # beside the persistent commit in flight, whose lease is held already
            due, previous, overlaps = [Tier.FAST], None, pending
    elif due and not may_start(
        busy, step, pending, policy, wait=wait, record=record, unready=unready
    ):
        return None
    if due and overlaps is None:
        hold()
    staged: list[tuple[Tier, Callable[[], Path], Fence]] = []
    cleanups: list[Callable[[], None]] = []
    started: TieredSave | None = None
    healthy, loss, grad_norm = health
    try:
        for tier in due:
            hooks = parts[tier].commits
            prepared = hooks.stage(step, state, healthy, loss, grad_norm, actions, busy=busy)
            # None: an unhealthy step, skipped on every rank (the fast tier's verdict: every
            # tier's).
            if prepared is None:
                if tier is Tier.FAST or not staged:
                    return None
                continue
            run, fence, _ = prepared  # an object store's run publishes after its staging commit
            staged.append((tier, run, fence))
            cleanups.append(functools.partial(hooks.cleanup, step))
    finally:
        # Also when the persistent snapshot raised (on every rank alike): the fast part already
        # staged commits, so its pool slots and its fence are released, never left hanging.
        if staged:
            started = TieredSave(
                step,
                staged,
                time.monotonic() - began,
                push,
                cleanups=cleanups,
                after=previous,
                overlaps=overlaps,
            )
            adopt(started)
    return started if started is not None else TieredSave(step, [], time.monotonic() - began, None)


def joined(futures: list[Future[int]]) -> Future[int]:
    """One future over the tiers' ``prepare_async`` futures: the bytes they added, or the first
    error."""
    done: Future[int] = Future()
    lock = threading.Lock()  # the tiers' futures complete in their own threads

    def settle(_: Future[int]) -> None:
        with lock:
            if done.done() or not all(f.done() for f in futures):
                return
            errors = [
                RuntimeError("a tier's prepare_async was cancelled")
                if f.cancelled()
                else f.exception()
                for f in futures
                if f.cancelled() or f.exception() is not None
            ]
            done.set_exception(errors[0]) if errors else done.set_result(
                sum(f.result() for f in futures)
            )

    for f in futures:
        f.add_done_callback(settle)
    return done
