"""Tiered checkpoints: a fast node-local tier often, a persistent shared tier less often, one manager.

Contract. ``TieredCheckpoint.save(step, state)`` commits ``step`` to the fast tier when
``step % fast_every == 0`` and to the persistent tier when ``step % persistent_every == 0``,
each a full ``CheckpointManager`` commit with its own retention. With ``replicas=1`` every
rank's files of a fast step are also sent to its peer on another node (``_commit.replica``),
so losing any one node leaves the whole step on the others. ``save_async`` snapshots each due
tier now (its manager's staging) and commits them in one background thread: the fast tier, then
its replica push (never of an uncommitted step), then the persistent tier; every later collective
call waits for it first. Rank 0 holds the persistent root's write lease from the first save of
any tier on, so a second live job on that root is refused at its first save or restore.

``restore`` is collective: every rank reports what it can load (fast steps complete on its
own disk, peer replicas it holds, the persistent tier's step), and rank 0 picks the newest
step that EVERY rank can load from some tier: from its own disk, from a peer's replica
(fetched over torch.distributed, checked against the manifest's xxh3, then loaded like any
local step), or from the persistent tier. A newer step that only part of the job can load is
never chosen; when the choice falls back past it, the log says which files were missing on
which rank. Nothing loadable but something committed somewhere is refused, naming the
missing files; a fresh start stays what it is for one manager (an absent root, tracker 0).

The restore record (``ROOT/proof``) carries the tier it used (``tier``, ``tier_detail``) and
``ckptguard prove`` shows it. Proof records of both tiers go to one log: the persistent
root's when there is one (shared, so ``prove`` sees every rank), else the fast root's.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from ._commit import replica as _replica
from ._core.guard import GuardTarget, recorded_save_seconds
from ._core.root import check_state, check_step
from ._disk import layout as _layout
from ._disk import lease as _lease
from ._dist import Wire, gather_decide, on_every_rank
from ._priority import lower_this_thread
from ._records import manifest as _manifest
from ._records import trust as _trust
from ._records.checks import files_needed
from ._records.retention import KeepLast, RetentionPolicy, default_policy
from ._resume.resolve import resolve_local
from ._state.derived import DerivedState
from ._state.expert import ExpertParallel
from .config import CheckpointConfig, ResumeMode
from .errors import (
    CheckpointError,
    CheckpointIncompleteError,
    ConfigError,
    SaveStillRunningError,
    error_payload,
    rebuild,
)
from .manager import CheckpointManager
from .storage._staging import Fence
from .storage.base import Storage

log = logging.getLogger("ckptguard")


class Tier(str, enum.Enum):
    """Where a step was saved or restored from."""

    FAST = "fast"
    """The node-local tier (``/dev/shm``, NVMe): every ``fast_every`` steps."""
    PERSISTENT = "persistent"
    """The shared filesystem: every ``persistent_every`` steps."""


@dataclass(frozen=True)
class _View(Wire):
    """What one rank can load: fast steps complete on its disk, replicas it holds, the persistent step."""

    host: str
    complete: list[int] = field(default_factory=list)
    published: list[int] = field(default_factory=list)  # complete here, newer than this node's tracker
    missing: dict[str, list[str]] = field(default_factory=dict)  # str(step) -> files this rank lacks
    replicas: dict[str, list[int]] = field(default_factory=dict)  # str(step) -> source ranks held here
    persistent: int = 0  # the persistent tier's committed step (0: none)
    persistent_error: dict[str, Any] | None = None
    error: dict[str, Any] | None = None


@dataclass(frozen=True)
class _Choice(Wire):
    tier: str = ""  # "fast", "persistent", or "" (nothing committed anywhere: the managers' own fresh start)
    step: int = 0
    senders: dict[str, int] = field(default_factory=dict)  # str(receiver rank) -> sender rank
    detail: str = ""
    fell_back: bool = False  # a newer step exists on part of the job: said as a warning


class TieredSave:
    """A ``TieredCheckpoint.save_async`` in flight: the tiers' background commits, one after the other
    in one thread (the fast tier, its replica push with ``replicas=1``, then the persistent tier).
    ``wait()`` returns the committed directories as ``save`` does and raises the first failure."""

    def __init__(
        self, step: int, parts: list[tuple[Tier, Callable[[], Path], Fence]], blocked_s: float,
        push: Callable[[], None] | None,
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
        self.reported = False
        """True once ``wait()`` raised: ``TieredCheckpoint`` does not raise it a second time."""
        # Not a daemon: an interpreter exit waits for the commits instead of cutting them off.
        self._thread = threading.Thread(target=self._run, args=(parts, push), name=f"ckptguard-tiers-save-{step}")
        if parts:  # a step on neither interval starts no thread
            self._thread.start()

    @property
    def mutation_wait_seconds(self) -> float:
        """How long later mutations (optimizer step, ``staged()``) waited for this save's reads."""
        return sum(f.waited_s for f in self.fences)

    def _run(self, parts: list[tuple[Tier, Callable[[], Path], Fence]], push: Callable[[], None] | None) -> None:
        self.priority = lower_this_thread()
        for tier, run, fence in parts:
            try:
                fence.host_wait()  # the staged copies have landed before anything reads them
                self._result[tier] = run()
                if tier is Tier.FAST and push is not None:
                    push()  # after the commit: a replica is never made of an uncommitted step
            except BaseException as exc:  # kept for wait(); the next tier still saves (its own commit)
                self._error = self._error or exc
                log.error("ckptguard: the background save of step %d to the %s tier failed: %s: %s (raised by the "
                          "next save, restore or wait)", self.step, tier.value, type(exc).__name__, exc)
            finally:
                fence.live_read()  # a failed save reads nothing more: training may go on

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> dict[Tier, Path]:
        """Block until every tier's commit (and the replica push) ended; raise the first error."""
        if self.tiers:
            self._thread.join(timeout)
        if self._thread.is_alive():
            raise SaveStillRunningError(
                f"the background save of step {self.step} ({', '.join(t.value for t in self.tiers)} tier) is still "
                "running; call wait() again (without a timeout to block until it ends)", step=self.step,
            )
        if self._error is not None:
            self.reported = True
            raise self._error
        return dict(self._result)


class TieredCheckpoint:
    """A fast node-local tier and a persistent shared tier under one object.

    ``fast`` is a root on node-local storage (the same path on every node, e.g. ``/dev/shm/run1``
    or NVMe) or, for a single node, any directory; ``persistent`` a root on the shared
    filesystem, or None for a fast tier alone (then ``replicas=1`` is what survives a lost node).
    ``fast_retention`` and ``persistent_retention`` rotate each tier on its own. ``config`` is
    the base ``CheckpointConfig`` of both tiers (its ``retention`` is replaced per tier).
    Every method is collective, like ``CheckpointManager``'s.
    """

    def __init__(
        self,
        *,
        fast: str | os.PathLike[str],
        persistent: str | os.PathLike[str] | None = None,
        fast_every: int = 1,
        persistent_every: int = 10,
        fast_retention: RetentionPolicy | None = None,
        persistent_retention: RetentionPolicy | None = None,
        replicas: int = 0,
        config: CheckpointConfig | None = None,
        process_group: Any | None = None,
        storage: Storage | None = None,
        derived: DerivedState | None = None,
        expert_parallel: ExpertParallel | None = None,
    ) -> None:
        for name, value in (("fast_every", fast_every), ("persistent_every", persistent_every)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"TieredCheckpoint({name}={value!r}): must be an int >= 1 (steps between saves)")
        if replicas not in (0, 1):
            raise ConfigError(f"TieredCheckpoint(replicas={replicas!r}): 0 or 1 (one peer copy of each node's part)")
        base = config or CheckpointConfig()
        if persistent is not None and Path(persistent).absolute() == Path(fast).absolute():
            raise ConfigError(f"TieredCheckpoint: fast and persistent are the same root {fast}; give two roots")
        self.fast_every, self.persistent_every, self.replicas = fast_every, persistent_every, replicas

        def manager(root: str | os.PathLike[str], retention: RetentionPolicy) -> CheckpointManager:
            return CheckpointManager(root, config=dataclasses.replace(base, retention=retention),
                                     process_group=process_group, storage=storage, derived=derived,
                                     expert_parallel=expert_parallel)

        self.fast = manager(fast, fast_retention or KeepLast(2))
        self.persistent = None if persistent is None else manager(persistent, persistent_retention or default_policy())
        # One proof log for both tiers, in the root every rank can read: prove sees the whole run.
        home = self.persistent or self.fast
        for mgr, tier in ((self.fast, Tier.FAST), (self.persistent, Tier.PERSISTENT)):
            if mgr is not None:
                mgr.core.proof.share(home.core.proof, {"tier": tier.value})
        self._pending: TieredSave | None = None
        agreement = self.fast.context.agreement
        self._hosts = [str(h) for h in agreement.exchange("tiers.hosts", agreement.info.host)]
        self._peers = _replica.peers(self._hosts)
        if replicas and self._peers[0] is None:
            raise ConfigError(
                f"TieredCheckpoint(replicas=1): all {len(self._hosts)} ranks run on host {self._hosts[0]}; a peer "
                "replica must live on another node. Run on two or more nodes, or use replicas=0"
            )

    def preemption_target(self) -> GuardTarget:
        """What a ``PreemptionGuard`` guards: a save of the step now, to the persistent tier when there is
        one (the node may not come back), else to the fast tier (with its peer replicas), whatever the
        tiers' intervals."""
        home = self._home()
        return GuardTarget(
            root=home.root, timeout_s=home.config.timeout_s, process_group=home.process_group,
            save=self._save_now, wait=self.wait, committed_here=lambda: list(home.core.committed_here),
            save_seconds=lambda step: recorded_save_seconds(home.root / home.context.naming.name(step)),
        )

    def _save_now(self, step: int, state: dict[str, Any], **save_kwargs: Any) -> Path | None:
        check_step(step, "save")
        self.wait()
        self._hold_persistent()
        home = self._home()
        path = home.save(step, state, **save_kwargs)
        if path is not None and home is self.fast and self.replicas:
            self._push(step)
        return path

    @property
    def rank(self) -> int:
        return self.fast.rank

    # ------------------------------------------------------------ save

    def save(
        self, step: int, state: dict[str, Any], *, healthy: bool | None = None, loss: Any = None, grad_norm: Any = None
    ) -> dict[Tier, Path]:
        """Commit ``step`` to the tiers whose interval it is on; returns the committed directories
        (none for a step the health policy skipped on every rank).

        The fast tier first (and its peer replicas), then the persistent tier; a failure of
        either raises on every rank, like ``CheckpointManager.save``."""
        check_step(step, "save")
        self.wait()
        out: dict[Tier, Path] = {}
        if not self._due(step):
            return out  # no collective, no lease write: a loop may call save at every step
        self._hold_persistent()
        if step % self.fast_every == 0:
            fast = self.fast.save(step, state, healthy=healthy, loss=loss, grad_norm=grad_norm)
            if fast is None:  # an unhealthy step (CheckpointConfig.health): skipped on every rank, every tier
                return out
            out[Tier.FAST] = fast
            if self.replicas:
                self._push(step)
        if self.persistent is not None and step % self.persistent_every == 0:
            persistent = self.persistent.save(step, state, healthy=healthy, loss=loss, grad_norm=grad_norm)
            if persistent is not None:
                out[Tier.PERSISTENT] = persistent
        return out

    def save_async(
        self, step: int, state: dict[str, Any], *, healthy: bool | None = None, loss: Any = None, grad_norm: Any = None
    ) -> TieredSave | None:
        """``save`` in the background. Each tier on its interval is snapshotted now as its manager's
        ``save_async`` does (the health agreement; copies queued into its pinned staging pool; the
        next optimizer step, the next forward of a module with buffers, or ``staged()`` waits for
        them), then one background thread commits the fast tier, pushes its peer replicas once that
        commit completed (a replica is never made of an uncommitted step), and commits the persistent
        tier: one thread, because one process's c10d store client serves one blocking wait at a time.
        Returns a ``TieredSave``, or None for a step the health policy skipped on every rank. The next
        ``save``, ``save_async``, ``restore``, ``wait`` or ``close`` waits for it first and raises its
        error: a restore chooses its step with every pending save ended, on every rank alike."""
        check_step(step, "save_async")
        check_state(state, "save_async")
        start = time.monotonic()
        self.wait()
        due = self._due(step)
        if due:
            self._hold_persistent()
        parts: list[tuple[Tier, Callable[[], Path], Fence]] = []
        push = (lambda: self._push(step)) if self.replicas else None
        try:
            for tier, mgr in due:
                prepared = mgr.stage_commit(step, state, healthy, loss, grad_norm)
                if prepared is None:  # an unhealthy step: skipped on every rank (the fast verdict: every tier)
                    if tier is Tier.FAST or not parts:
                        return None
                    continue
                run, fence, _ = prepared
                parts.append((tier, run, fence))
        finally:
            # Also when the persistent snapshot raised (on every rank alike): the fast part already
            # staged commits, so its pool slots and its fence are released, never left hanging.
            if parts:
                self._pending = TieredSave(step, parts, time.monotonic() - start, push)
        return self._pending if parts else TieredSave(step, [], time.monotonic() - start, None)

    def _due(self, step: int) -> list[tuple[Tier, CheckpointManager]]:
        due = [(Tier.FAST, self.fast)] if step % self.fast_every == 0 else []
        if self.persistent is not None and step % self.persistent_every == 0:
            due.append((Tier.PERSISTENT, self.persistent))
        return due

    def wait(self) -> dict[Tier, Path]:
        """Wait for a pending ``save_async`` (both tiers, the replica push); returns its directories,
        raises its error."""
        pending, self._pending = self._pending, None
        return pending.wait() if pending is not None and not pending.reported else {}

    def staged(self) -> float:
        """``CheckpointManager.staged`` for both tiers of the last ``save_async``: call it before changing
        saved tensors outside an optimizer step. Returns the seconds it blocked."""
        pending = self._pending
        return sum(f.before_mutation() for f in pending.fences) if pending is not None else 0.0

    def close(self) -> None:
        """Wait for a pending save (raising its error) and release both tiers' host staging pools."""
        try:
            self.wait()
        finally:
            for mgr in (self.fast, self.persistent):
                if mgr is not None:
                    mgr.close()

    def _hold_persistent(self) -> None:
        """Rank 0 takes (or renews) the persistent root's write lease at every save, creating the root
        (tracker 0: a declared fresh start) at the first one, so the proof records of the fast saves
        before the first persistent save are durable there, and a second live job on the same root is
        refused at once, on every rank, as a plain manager's save refuses it. Without it a job whose
        persistent saves are rare wrote into a root it held no lease of, and a duplicate launch went
        on training until its own first persistent save."""
        mgr = self.persistent
        if mgr is None:
            return

        def take() -> None:
            if self.rank != 0:
                return
            created = not mgr.root.exists()
            if created:
                mgr.root.mkdir(parents=True)
            note = _lease.acquire(mgr.root, ttl_s=mgr.config.lease_ttl_s, override=mgr.config.break_lease)
            if note:
                log.warning("ckptguard: %s: %s", mgr.root, note)
            if created:
                _layout.write_tracker(mgr.root, 0)

        # The fast manager's agreement: no background commit uses it now (every caller waited first).
        on_every_rank(self.fast.context.agreement, "tiers.persistent_lease", take)

    def _push(self, step: int) -> None:
        """Send this rank's files of ``step`` to its peer; a failed replica is a loud warning on every rank
        (the step is committed; only its protection against a lost node is missing)."""
        ctx = self.fast.context
        name = ctx.naming.name(step)
        problems: list[str] = []
        try:
            files = _manifest.read(self.fast.root / name).files
        except CheckpointError as exc:
            files, problems = [], [f"{type(exc).__name__}: {exc}"]
        try:
            problems += _replica.push(root=self.fast.root, step=step, step_name=name, manifest_files=files,
                                      peer_of=self._peers, rank=self.rank, group=ctx.storage_ctx.process_group)
        except RuntimeError as exc:  # a peer died mid-transfer (gloo names no rank): the agreement below does
            problems.append(f"the replica transfer broke off: {exc}")
        sources = [r for r, p in enumerate(self._peers) if p == self.rank]
        _replica.prune(self.fast.root, ctx.naming, set(self.fast.committed_steps()) | {step}, sources)

        bad = _after_transfers(ctx.agreement, "tiers.replicas", problems)
        if bad:
            log.warning("ckptguard: step %d is committed in the fast tier but its peer replicas are incomplete "
                        "(%s); losing a node now loses this step's files there", step, " | ".join(bad))

    # ------------------------------------------------------------ restore

    def restore(self, state: dict[str, Any], *, mode: ResumeMode = ResumeMode.AUTO) -> int:
        """Load the newest step every rank can load from some tier; return it (0: fresh start).
        ``HealthPolicy(prefer="verified")`` is refused here: the tier choice takes the newest step."""
        if not isinstance(mode, ResumeMode):
            raise ConfigError(f"mode must be a ResumeMode (AUTO, MUST, NEVER), got {mode!r}")
        if self.fast.config.health.prefer is not _trust.Prefer.LATEST:
            raise ConfigError(
                "TieredCheckpoint.restore: CheckpointConfig(health=HealthPolicy(prefer='verified')) is not "
                "supported across tiers (the choice is the newest step every rank can load); use prefer='latest', "
                "or restore the persistent tier with a CheckpointManager(..., prefer='verified')"
            )
        home = self.persistent or self.fast
        self.wait()  # a pending save_async ends first: the choice below sees its step, or its error is raised
        if mode is ResumeMode.NEVER:
            return home.restore(state, mode=mode)
        for mgr in (self.fast, self.persistent):  # a duplicate launch stops here, whichever tier it would load
            if mgr is not None:
                mgr.core.check_lease("restore")
        broken: dict[int, str] = {}  # fast steps whose fetch failed (the same on every rank: an agreed error)
        while True:
            choice = gather_decide(self.fast.context.agreement, "tiers.choose", self._view(),
                                   lambda views: self._choose(views, broken), decision=_Choice)
            if not choice.tier:
                return home.restore(state, mode=mode)  # nothing committed anywhere: the manager's own fresh start
            if choice.fell_back:
                log.warning("ckptguard: %s", choice.detail)
            else:
                log.info("ckptguard: %s", choice.detail)
            if not choice.senders:
                break
            try:
                self._fetch(choice)
                break
            except CheckpointIncompleteError as exc:  # a damaged replica: the next choice, never a guess
                broken[choice.step] = str(exc)
                log.warning("ckptguard: %s; choosing again without fast step %d", exc, choice.step)
        mgr = self.fast if choice.tier == Tier.FAST.value else self.persistent
        assert mgr is not None
        tags = mgr.core.proof.tags
        mgr.core.proof.tags = {**tags, "tier_detail": choice.detail,
                               "replica_ranks": sorted(int(r) for r in choice.senders)}
        try:
            step = mgr.restore(state, path=mgr.root / mgr.context.naming.name(choice.step))
        finally:
            mgr.core.proof.tags = tags
        self._align_fast(step, Tier(choice.tier))
        for other in (self.fast, self.persistent):  # both tiers continue the restored trajectory (trust)
            if other is not None and other is not mgr:
                other.core.restored_step = step
        return step

    def _view(self) -> _View:
        host = self.fast.context.agreement.info.host
        try:
            complete, published, missing = self._fast_steps()
            replicas = {str(s): r for s, r in _replica.held(self.fast.root, self.fast.context.naming).items()}
        except Exception as exc:  # shipped: no rank waits for a peer that raised
            return _View(host, error=error_payload(exc))
        persistent, perror = 0, None
        if self.persistent is not None:
            try:
                res = resolve_local(self.persistent.root, self.persistent.context.naming, ResumeMode.AUTO, None)
                persistent = res.step
            except Exception as exc:
                perror = error_payload(exc)
        return _View(host, complete, published, missing, replicas, persistent, perror)

    def _fast_steps(self) -> tuple[list[int], list[int], dict[str, list[str]]]:
        """Fast steps whose files this rank has on its own disk (sizes as the manifest says): committed
        ones (up to the tracker), and published ones past it (node-local roots: a save stopped between
        the nodes' trackers; they count only where another node's tracker names them). For the
        others, the files this rank lacks."""
        root, naming, rank = self.fast.root, self.fast.context.naming, self.rank
        tracker = _layout.read_tracker(root) if root.is_dir() else None
        complete: list[int] = []
        published: list[int] = []
        missing: dict[str, list[str]] = {}
        if tracker is None:
            # Steps but no tracker was never written by ckptguard: raised as the manager's resolve does.
            resolve_local(root, naming, ResumeMode.AUTO, None)
            return complete, published, missing
        for step, path in sorted(_layout.step_dirs(root, naming).items()):
            try:
                manifest = _manifest.read(path)
                if manifest.world_size != self.fast.world_size or manifest.step != step:
                    continue  # another layout: restore decides, on its own tier
                if step > tracker and not manifest.nodes:
                    continue  # an orphan on a shared root: never a resume target
                needed = files_needed(path, manifest, rank)
            except CheckpointError:
                continue
            sizes = {f["path"]: int(f["size"]) for f in manifest.files}
            lacking = sorted(p for p in needed if not _size_is(path / p, sizes.get(p, -1)))
            if lacking:
                missing[str(step)] = [str(path / p) for p in lacking[:5]]
            else:
                (complete if step <= tracker else published).append(step)
        return complete, published, missing

    def _choose(self, views: list[_View], broken: dict[int, str]) -> _Choice:
        """Rank 0: the newest step every rank can load, preferring the fast tier at equal steps; a fast
        step in ``broken`` (its fetch failed) is loadable only where no rank needs a fetch."""
        errors = {r: v.error for r, v in enumerate(views) if v.error}
        if errors:
            r = min(errors)
            raise rebuild(errors[r], note=f"(rank {r}, reading the fast tier) ")
        fast_steps = {s for v in views for s in v.complete}  # committed: some node's tracker names it
        best: tuple[int, dict[str, int]] | None = None
        for step in sorted(fast_steps, reverse=True):
            senders = self._senders(views, step)
            if senders and step in broken:
                continue
            if senders is not None:
                best = (step, senders)
                break
        newest = max(fast_steps, default=0)
        gap = self._gap(views, newest) if newest and (best is None or best[0] < newest) else ""
        if newest in broken:
            gap = f"its replicas failed: {broken[newest]}"
        perrors = {r: v.persistent_error for r, v in enumerate(views) if v.persistent_error}
        persistent = min(v.persistent for v in views) if not perrors else 0
        if best is not None and best[0] >= persistent:
            step, senders = best
            fetched = f", ranks {sorted(int(r) for r in senders)} from peer replicas on ranks " \
                      f"{sorted(set(senders.values()))}" if senders else " on every rank's own disk"
            older = f"; the newer fast step {newest} is not loadable on every rank ({gap})" if gap else ""
            if perrors:  # said, not hidden: the fallback a later loss of this tier would need is broken
                older += f"; the persistent tier cannot be read: {perrors[min(perrors)]['message']}"
            return _Choice(Tier.FAST.value, step, senders, f"tier fast: step {step}{fetched}{older}",
                           bool(gap or perrors))
        if persistent:
            why = f" (the fast tier's newest step {newest} cannot be loaded on every rank: {gap})" if gap else ""
            if best is not None:
                why = f" (newer than the fast tier's newest loadable step {best[0]})"
            return _Choice(Tier.PERSISTENT.value, persistent, {}, f"tier persistent: step {persistent}{why}", bool(gap))
        if newest or perrors:
            where = f"the fast tier's newest step {newest} is incomplete: {gap}" if newest else ""
            if perrors:
                r = min(perrors)
                where += f"{'; ' if where else ''}the persistent tier: {perrors[r]['message']}"
            elif self.persistent is None:
                where += "; there is no persistent tier"
            else:
                where += f"; the persistent tier {self.persistent.root} holds no committed step"
            raise CheckpointIncompleteError(
                f"restore refused: no step can be loaded by every rank from any tier ({where}). "
                + ("No peer replica holds the missing files. " if self.replicas else
                   "Without replicas=1 the files of a lost node exist nowhere else. ")
                + "Copy the missing files back (ckptguard transfer), or restore(path=...) a step you trust"
            )
        return _Choice()

    @staticmethod
    def _senders(views: list[_View], step: int) -> dict[str, int] | None:
        """For every rank that lacks ``step``, a rank on another node that holds its replica and the step."""
        senders: dict[str, int] = {}
        for r, v in enumerate(views):
            if step in v.complete or step in v.published:
                continue
            holder = next((h for h, w in enumerate(views) if w.host != v.host and step in w.complete + w.published
                           and r in w.replicas.get(str(step), [])), None)
            if holder is None:
                return None
            senders[str(r)] = holder
        return senders

    def _gap(self, views: list[_View], step: int) -> str:
        """Which rank lacks which files of ``step`` (for a rank whose disk has no trace of the step, rank 0
        names the files from its own copy of the step, where it has one)."""
        lacking = []
        for r, v in enumerate(views):
            if step in v.complete or step in v.published:
                continue
            files = v.missing.get(str(step)) or self._expected(step, r)
            what = f"missing {', '.join(files)}" if files else f"no committed step {step} on its disk"
            lacking.append(f"rank {r} (host {v.host}): {what}")
        return "; ".join(lacking[:8]) + (" ..." if len(lacking) > 8 else "")

    def _expected(self, step: int, rank: int) -> list[str]:
        path = self.fast.root / self.fast.context.naming.name(step)
        try:
            needed = files_needed(path, _manifest.read(path), rank)
        except (CheckpointError, OSError):
            return []
        return [str(path / p) for p in sorted(needed)[:5]] + (["..."] if len(needed) > 5 else [])

    def _fetch(self, choice: _Choice) -> None:
        """Rebuild the lacking ranks' part of the chosen fast step from their peers' replicas: into a
        temp directory of the node's root, checked against the manifest, then sealed (node manifest,
        manifest, rename) by the node's first receiving rank once every rank's part arrived."""
        ctx = self.fast.context
        name = ctx.naming.name(choice.step)
        group = ctx.storage_ctx.process_group
        receivers = sorted(int(r) for r in choice.senders)
        nonce = xxhash.xxh3_64_hexdigest(json.dumps([choice.step, receivers]).encode())[:12]
        tmp = self.fast.root / _layout.temp_dir_name(name, nonce)  # the same on every receiver of a node
        problems: list[str] = []
        if self.rank in receivers:
            try:
                (tmp / _layout.STATE_DIR).mkdir(parents=True, exist_ok=True)  # an empty node's root is rebuilt too
                _layout.write_owner(tmp, node=ctx.agreement.info.host)  # swept if this process dies
            except OSError as exc:
                problems.append(f"creating {tmp}: {exc}")
        for receiver in receivers:
            sender = choice.senders[str(receiver)]
            try:
                if self.rank == sender:
                    try:
                        step_dir = self.fast.root / name
                        manifest = _manifest.read(step_dir)
                        needed = files_needed(step_dir, manifest, receiver)
                        specs, paths = _replica.fetch_plan(self.fast.root, name, needed, manifest.files, receiver)
                    except (OSError, CheckpointError, KeyError) as exc:  # told to the receiver, which then stops
                        why = f"rank {self.rank} cannot send step {choice.step}: {type(exc).__name__}: {exc}"
                        _replica.send_json({"error": why}, receiver, group)
                        problems.append(why)
                        continue
                    problems += _replica.send_part(specs, paths, receiver, group)
                elif self.rank == receiver:
                    problems += _replica.recv_part(self.fast.root, tmp, receiver, sender, group)
            except (OSError, CheckpointError, RuntimeError) as exc:  # RuntimeError: a peer died mid-transfer
                problems.append(f"{type(exc).__name__}: {exc}")
                break  # the agreement below names the ranks that never arrived

        def failed(bad: list[str]) -> CheckpointIncompleteError:
            return CheckpointIncompleteError(
                f"fetching step {choice.step} from peer replicas failed ({' | '.join(bad)}); nothing was "
                "loaded. Check the disks of the ranks named, then restore again"
            )

        try:
            bad = _after_transfers(ctx.agreement, "tiers.fetch", problems)
            if bad:
                raise failed(bad)  # on every rank alike: the same list everywhere
        except CheckpointError:
            if self.rank in receivers:
                shutil.rmtree(tmp, ignore_errors=True)  # nothing of a failed fetch lingers on the node
            raise
        sealer = next((r for r in receivers if self._hosts[r] == self._hosts[self.rank]), None) == self.rank
        failure: list[str] = []
        if sealer:
            try:
                _replica.seal_fetch(tmp, self.fast.root / name, self.rank, self._node_record)
                tracker = _layout.read_tracker(self.fast.root)
                if tracker is None or tracker < choice.step:
                    _layout.write_tracker(self.fast.root, choice.step)
            except (OSError, CheckpointError) as exc:
                failure = [f"sealing {tmp}: {type(exc).__name__}: {exc}"]
        if bad := _after_transfers(ctx.agreement, "tiers.fetch_sealed", failure):
            raise failed(bad)
        log.info("ckptguard: rebuilt step %d on ranks %s from peer replicas (xxh3 checked against the manifest)",
                 choice.step, receivers)

    def _node_record(self, manifest: _manifest.Manifest) -> dict[str, Any] | None:
        """The node manifest of the node this rank's part belongs to (node-local roots); None on a
        shared root (no ``nodes`` in the manifest)."""
        index = manifest.node_of(self.rank)
        if index is None or manifest.nodes is None:
            return None
        node = manifest.nodes[index]
        return _manifest.node_manifest(step=manifest.step, index=index, name=str(node["name"]),
                                       ranks=list(node["ranks"]), files=manifest.node_files(index))

    def _align_fast(self, step: int, tier: Tier) -> None:
        """After a restore of ``step``, one rank per node points its fast tracker at the step where the
        node holds it committed (a node rebuilt from replicas, one a stopped save left behind), or, when
        its tracker is past it (a newer step only part of the job had), back at the newest step it holds
        up to ``step``, so the next fast saves are not refused as going backwards. Newer steps stay on
        disk as orphans (``ckptguard gc --orphans`` removes them)."""
        root = self.fast.root
        if self._hosts.index(self._hosts[self.rank]) != self.rank or not root.is_dir():
            return
        tracker = _layout.read_tracker(root)
        if tracker is None or tracker == step:
            return
        held = [s for s, path in _layout.step_dirs(root, self.fast.context.naming).items()
                if s <= step and (path / _layout.MANIFEST_NAME).is_file()]
        if tier is Tier.FAST and step in held:
            target = step
        elif tracker > step:
            target = max(held, default=0)
        else:
            return
        _layout.write_tracker(root, target)
        log.warning("ckptguard: fast tier %s: tracker moved from step %d to %d after the restore of step %d from "
                    "the %s tier%s", root, tracker, target, step, tier.value,
                    "; the newer steps there are orphans now (kept; `ckptguard gc --orphans` removes them)"
                    if tracker > target else "")

    # ------------------------------------------------------------ proof records and queries

    def _home(self) -> CheckpointManager:
        return self.persistent or self.fast

    def record_step(self, step: int, **fields: Any) -> dict[str, Any]:
        """``CheckpointManager.record_step`` into the one proof log of both tiers; both tiers' health
        checks see it (a NaN recorded at a step keeps that step out of either tier)."""
        home = self._home()
        recorded = home.record_step(step, **fields)
        if self.persistent is not None:
            metrics: dict[str, Any] = dict(recorded.get("extra", {}))
            metrics.update({k: recorded[k] for k in ("loss", "grad_norm") if k in recorded})
            self.fast.core.health.note(self.fast.config.health, step, metrics)
        return recorded

    def record_export(self, step: int, payload: Any, *, scales: Any = None) -> dict[str, str]:
        return self._home().record_export(step, payload, scales=scales)

    def record_logprobs(self, step: int, trainer_logprobs: Any, rollout_logprobs: Any) -> dict[str, float]:
        return self._home().record_logprobs(step, trainer_logprobs, rollout_logprobs)

    def record_update(self, step: int, *, grad_norm: float, params_changed: bool) -> None:
        self._home().record_update(step, grad_norm=grad_norm, params_changed=params_changed)


def _after_transfers(agreement: Any, phase: str, problems: list[str]) -> list[str]:
    """Every rank's problems, on every rank. An all-gather, not rank 0's verdict: a rank still blocked
    in a transfer with a dead peer arrives up to one timeout late, and every live rank must then name
    the dead one (waiting 2x the timeout for it), not the late one."""
    views = agreement.exchange(phase, problems[:5], patience=2.0)
    return [f"rank {r}: {'; '.join(v)}" for r, v in enumerate(views) if v]


def _size_is(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except OSError:
        return False
