"""The bookkeeping every front door keeps for one checkpoint root (docs/architecture.md).

``CheckpointManager`` (one state), ``RunCheckpoint`` (roles over one commit) and
``TieredCheckpoint`` (two managers and a replica step) all need the same things around the
commit protocol: the write lease checked at creation and restore, the health round before a
save, the trust record after it, retention after the commit, the trajectory of this process
(the restored step, its commits, the steps it skipped) and the time each save took. ``Root``
owns them once; the front doors compose it and never reach into each other.

Every method that takes part in an agreement is collective over ``agreement``; rank 0 (or, on
node-local roots, each node's publishing rank) writes the sidecars, and a failure to write one
is logged, never raised: the commit is what matters.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from .._agree import Agreement, gather_decide, on_every_rank
from .._context import Actions
from .._disk import layout as _layout
from .._disk import lease as _lease
from .._records import retention
from .._records import trust as _trust
from .._records.proofwriter import ProofLog, read_alone, replica_fields
from .._resume.resolve_local import Resolution
from .._state.state import KeyFn
from .._types import JsonObject
from ..config import CheckpointConfig, ResumeMode
from ..errors import CheckpointError, ConfigError, ReplicatedDivergenceError

log = logging.getLogger("ckptguard")


def check_step(step: Any, where: str) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ConfigError(
            f"{where}(step={step!r}): step must be an int >= 1 (0 is reserved for 'fresh start')"
        )


def check_state(state: Any, where: str) -> None:
    if not isinstance(state, dict) or not state:
        raise ConfigError(
            f"{where}(state): state must be a non-empty dict of named items, "
            f"got {type(state).__name__}"
        )


class ProofSink:
    """Where a front door's proof records go: a ``ProofLog`` (``ROOT/proof``), tagged; written as
    every record is (``ProofLog.keep``: held until the root exists, a failure logged, never raised).

    A ``TieredCheckpoint`` gives both tiers a sink into one log (the root every rank can read), each
    tagging its save and restore records with its tier (``tagged``), through
    ``_core.parts.Parts``."""

    def __init__(
        self,
        log: ProofLog,
        *,
        enabled: bool,
        tags: Mapping[str, str] | None = None,
        plan: JsonObject | None = None,
    ) -> None:
        self.log = log
        self.enabled = enabled
        self.tags: dict[str, str | list[int]] = dict(
            tags or {}
        )  # a tier, the replicas a restore read
        self.plan = plan
        """``ProofPlan.as_dict()``: on every save record and every restore record of a step (prove
        reads it)."""

    @classmethod
    def open(cls, home: Path, rank: int, config: CheckpointConfig) -> ProofSink:
        """The sink of ``rank``'s records under ``home``/proof, as ``config`` asks (on or off, the
        code hash)."""
        log = ProofLog(home, rank)
        log.code = config.contract.code if config.contract is not None else None
        return cls(log, enabled=config.proof.record, plan=config.proof.as_dict())

    def tagged(self, tags: Mapping[str, str]) -> ProofSink:
        """A sink into the same log whose save and restore records carry ``tags`` (a tier's)."""
        return ProofSink(self.log, enabled=self.enabled, tags=tags, plan=self.plan)

    @contextlib.contextmanager
    def adding(self, tags: Mapping[str, str | list[int]]) -> Iterator[None]:
        """``tags`` on the save and restore records made inside the block (where a restore read
        from)."""
        before = self.tags
        self.tags = {**before, **tags}
        try:
            yield
        finally:
            self.tags = before

    def record(self, event: str, *, durable: bool = True, **fields: Any) -> None:
        if not self.enabled:
            return
        tagged: dict[str, Any] = dict(self.tags) if event in ("save", "restore") else {}
        if self.plan is not None and (
            event == "save" or (event == "restore" and not fields.get("fresh"))
        ):
            tagged["plan"] = self.plan
        self.log.keep(self.log.build(event, **{**tagged, **fields}), durable=durable)

    @contextlib.contextmanager
    def divergence(self, step: int) -> Iterator[None]:
        """A ``ReplicatedDivergenceError`` raised in the block (a save's guard: in the caller's
        thread for ``save``, in the background commit for ``save_async`` and the tiers) is recorded,
        then raised: a ``replicas`` record (``ok`` False, ``error`` naming the tensors), which
        prove's replica gate reads."""
        try:
            yield
        except ReplicatedDivergenceError as exc:
            self.record("replicas", step=step, ok=False, error=str(exc)[:4000])
            raise

    def after_restore(
        self, state: Mapping[str, Any], keyfn: KeyFn, replicas: Mapping[str, Any]
    ) -> None:
        """The first step record after this restore carries this rank's replica digests
        (``replica_fields``) when the restore compared replicas (``replicas``: its
        ``replica_report``, some chunk held by 2+ ranks); else none is computed (one rank, every
        tensor sharded, no layout-free digests, FSDP1: ``read_alone``)."""
        due = self.enabled and bool(replicas.get("checked")) and read_alone(state)
        self.log.after_restore((lambda: replica_fields(state, keyfn)) if due else None)


class Root:
    """One checkpoint root's lease, health, trust, retention and trajectory bookkeeping.

    ``label`` names a step in log lines ("step", or "run step" for a run of several roles)."""

    def __init__(
        self,
        path: Path,
        config: CheckpointConfig,
        naming: _layout.StepNaming,
        agreement: Agreement,
        *,
        label: str = "step",
        lease_key: str = "lease",
        proof: ProofSink | None = None,
        health: _trust.HealthLog | None = None,
    ) -> None:
        self.path = path
        self.config = config
        self.naming = naming
        self.agreement = agreement
        self.label = label
        self.lease_key = lease_key
        self.health = health if health is not None else _trust.HealthLog()
        self.restored_step: int | None = None
        self.committed_here: list[
            int
        ] = []  # this process's commits: its trajectory, with the restored step
        self.skipped: dict[
            int, str
        ] = {}  # steps a save skipped as unhealthy (on any rank), with the reasons
        self.save_times: dict[
            int, float
        ] = {}  # this process's saves: step -> seconds (a PreemptionGuard's plan)
        self.last_health: _trust.HealthVerdict | None = None
        self._unobserved: list[tuple[_trust.HealthVerdict, Callable[[int], bool]]] = []
        self.proof = (
            proof if proof is not None else ProofSink.open(path, agreement.info.rank, config)
        )

    @property
    def rank(self) -> int:
        return self.agreement.info.rank

    # ------------------------------------------------------------ lease

    def check_lease(self, where: str, *, break_lease: bool = False) -> None:
        """Look for another live run holding the root's write lease: at creation a loud warning
        (a front door that only reads stays usable), at ``restore`` a refusal on every rank, so a
        duplicate launch stops before its first training step instead of at its first save. Rank 0
        looks and never writes. ``break_lease`` leaves it to the save."""
        if break_lease:
            return
        _lease.check_on_every_rank(
            self.agreement,
            self.path,
            ttl_s=self.config.storage.lease_ttl_s,
            where=where,
            key=f"{self.lease_key}.{where}",
        )

    # ------------------------------------------------------------ trajectory

    def eligible(self) -> Callable[[int], bool]:
        """Steps this process's trajectory vouches for: its own commits and what it restored
        from."""
        mine, restored = set(self.committed_here), self.restored_step or 0
        return lambda k: k in mine or k <= restored

    def restarted_at(self, step: int) -> None:
        """A restore (a rollback within this process included) starts a new trajectory from
        ``step``: the commits and skips above it belong to the abandoned one (a preemption save must
        not take step N as "committed already", and trust must not promote those steps)."""
        self.restored_step = step
        self.committed_here = [s for s in self.committed_here if s <= step]
        self.skipped = {s: why for s, why in self.skipped.items() if s <= step}

    def committed(self, step: int, *, seconds: float | None = None) -> None:
        self.committed_here.append(step)
        if seconds is not None:
            self.save_times[step] = seconds

    # ------------------------------------------------------------ health and trust

    def health_round(
        self,
        step: int,
        healthy: bool | None,
        loss: Any,
        grad_norm: Any,
        *,
        key: str,
        node_publisher: Callable[[], bool] | None = None,
    ) -> _trust.HealthVerdict:
        """The health agreement of a save: every rank's view, one verdict; rank 0 updates the trust
        record. ``node_publisher`` (node-local roots): whether this rank publishes its node's part,
        and then keeps its node's trust record as rank 0 keeps its own."""
        policy = self.config.health

        def local() -> (
            _trust.HealthView
        ):  # a bad argument or a raising check fails the save on every rank
            return self.health.save_view(
                policy, step, healthy, loss, grad_norm, self.skipped.get(step)
            )

        view = on_every_rank(self.agreement, f"{key}.local", local)

        def decide(views: list[_trust.HealthView]) -> _trust.HealthVerdict:
            verdict = _trust.agree(views, step)
            eligible = self.eligible()
            promoted = self.trust_write(
                "observe",
                lambda: _trust.observe(self.path, verdict.healthy, verdict.unhealthy, eligible),
            )
            if promoted:
                log.debug(
                    "ckptguard: steps %s are verified (%d healthy steps after each)",
                    promoted,
                    policy.verify_after,
                )
            return verdict

        verdict = gather_decide(self.agreement, key, view, decide, decision=_trust.HealthVerdict)
        if self.rank != 0 and node_publisher is not None:
            # Whether this rank publishes a node is known only after a commit (the first save of a
            # process included): held until then.
            self._unobserved.append((verdict, self.eligible()))
            if node_publisher():  # known from this process's last commit: record it now
                self.observe_held(publisher=True)
        self.last_health = verdict
        if verdict.skip:
            self.skipped[step] = verdict.describe()
        return verdict

    def observe_held(self, *, publisher: bool) -> None:
        """A node's publisher (rank != 0, node-local roots) records the health verdicts rank 0
        recorded, in the same order; on a shared root (not a publisher) they are dropped."""
        held, self._unobserved = self._unobserved, []
        if self.rank == 0 or not publisher:
            return
        for verdict, eligible in held:
            self._observe(verdict, eligible)

    def _observe(self, verdict: _trust.HealthVerdict, eligible: Callable[[int], bool]) -> None:
        self.trust_write(
            "observe",
            lambda: _trust.observe(self.path, verdict.healthy, verdict.unhealthy, eligible),
        )

    def trust_committed(self, step: int) -> None:
        self.trust_write(
            "commit",
            lambda: _trust.committed(
                self.path,
                step,
                self.config.health.verify_after,
                on_disk=_layout.step_dirs(self.path, self.naming),
            ),
        )

    def trust_write(self, what: str, write: Callable[[], Any]) -> Any:
        """The trust record's updates; a failure is logged, never raised (the commit is what
        matters)."""
        try:
            return write()
        except (OSError, CheckpointError) as exc:
            log.warning(
                "ckptguard: could not update the trust record %s/%s at %s (%s: %s); the steps it "
                "concerns stay candidates",
                self.path,
                _trust.TRUST_NAME,
                what,
                type(exc).__name__,
                exc,
            )
            return None

    def safe_tracker(self) -> str:
        try:
            tracker = _layout.read_tracker(self.path)
            return "no step (nothing committed yet)" if tracker is None else str(tracker)
        except CheckpointError as exc:
            return f"? ({exc})"

    # ------------------------------------------------------------ retention

    def cleanup(self, step: int, *, rotate: bool, sinks: Sequence[ProofSink] = ()) -> None:
        """After the commit of ``step``: retention (``rotate``: this rank applies it) and the proof
        records no retained checkpoint's proof reads again; what retention deleted is recorded with
        its seconds. ``sinks``: the proof sinks pruned and told (a run's roles); none given, this
        root's own."""
        began = time.monotonic()
        deleted = self.rotate(step) if rotate else []
        for sink in sinks or (self.proof,):
            sink.log.prune(self.naming)
            if deleted:
                sink.record(
                    "cleanup",
                    durable=False,
                    step=step,
                    deleted=deleted,
                    seconds=round(time.monotonic() - began, 3),
                )

    def rotate(self, step: int) -> list[int]:
        """Apply retention after the commit of ``step`` (the caller decides which rank does); a
        failure is logged, never raised: rotation must never stop training. Returns the steps
        deleted."""
        policy = self.config.retention
        if policy is None:
            return []
        protect = {step} | ({self.restored_step} if self.restored_step else set())
        try:
            report = retention.apply(self.path, self.naming, policy, protect=protect)
        except Exception as exc:  # rotation must never stop training
            log.warning(
                "ckptguard: retention after %s %d failed (%s: %s); retried at the next save",
                self.label,
                step,
                type(exc).__name__,
                exc,
            )
            return []
        if report.deleted:
            log.info(
                "ckptguard: retention deleted %ss %s, kept %s",
                self.label,
                report.deleted,
                report.kept,
            )
        for name, why in report.not_counted.items():
            log.warning("ckptguard: %s is not counted as a kept checkpoint: %s", name, why)
        return [int(s) for s in report.deleted]


class LocalStage:
    """The stage of a filesystem root (``_core.rootstage.RootStage``): the local root's commit is
    the whole story; ``hold`` is the tiers' lease of a persistent directory root."""

    def __init__(self, root: Path, naming: _layout.StepNaming, lease_ttl_s: float) -> None:
        self.root = root
        self.url = str(root)
        self.naming = naming
        self.lease_ttl_s = lease_ttl_s

    def before_save(self, step: int, actions: Actions) -> Actions:
        return actions  # the local commit checks its own lease and what it replaces

    def published(self, step: int, path: Path) -> None:
        return None

    def hold(self, break_lease: bool = False) -> None:
        created = not self.root.exists()
        if created:
            self.root.mkdir(parents=True)
        note = _lease.acquire(self.root, ttl_s=self.lease_ttl_s, override=break_lease)
        if note:
            log.warning("ckptguard: %s: %s", self.root, note)
        if created:
            _layout.write_tracker(self.root, 0)

    def before_restore(self, break_lease: bool = False) -> None:
        return None  # the manager checks its root's lease itself

    def resolve(self, mode: ResumeMode, prefer: _trust.Prefer) -> Resolution | None:
        return None

    def bring(self, step: int) -> Path:
        return self.root / self.naming.name(step)

    def committed_steps(self) -> list[int] | None:
        return None

    def tracker_step(self) -> int | None:
        return None

    def marker_url(self, step: int) -> str | None:
        return None

    def close(self) -> None:
        return None
