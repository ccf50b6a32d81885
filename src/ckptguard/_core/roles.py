"""The roles of a run (``ckptguard.RunCheckpoint``): what a role is, the run's roles checked and
each one's context (its group and agreement) made, what a rank reports of its roles.

A ``Role`` names the ranks that hold one model or the driver of a run; every role's part of a step
is written by the single-role protocol into the run's temp directory
(``_commit.publish.RolePartPublisher``), and the run step is published once every role on every rank
confirmed (``_commit.publish_run``).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from .._agree import on_every_rank
from .._commit import pending as _async
from .._commit.messages import failure_from
from .._context import Context
from .._dist import make_agreement
from .._records import runmanifest
from .._records.exportdigest import ExportFingerprint, export_fingerprint, logprob_diff
from .._records.proofwriter import ProofLog
from .._records.trust import HealthLog, HealthPolicy
from .._resume import resolve_agreed as _resolve
from .._resume import restore as _restore
from .._resume.resolve_local import Resolution
from .._state.derived import DerivedState
from .._state.expert import ExpertParallel
from .._state.state import addresses, check_items, moved
from .._state.trajectory import fingerprint, step_metrics
from .._types import JsonObject, StateDict
from ..config import CheckpointConfig, ParallelLayout
from ..errors import CheckpointError, CheckpointWriteError, ConfigError, WriteFailure
from ..storage.base import Storage
from ..storage.streaming import StreamingStorage
from .root import ProofSink, check_step


@dataclass(frozen=True)
class Role:
    """One role of a run: its name, the ranks that hold it, and how its part is written.

    ``ranks`` are ranks of the default process group (None: every rank); a role's part of each
    step is a single-role step directory ``<step>/<name>/`` written by those ranks, numbered
    0..len(ranks)-1 in ascending order (as ``torch.distributed.new_group`` numbers them).
    ``layout``, ``expert_parallel`` and ``storage`` are those of a CheckpointManager for the
    role's ranks; ``derived`` is invalidated when the role is restored."""

    name: str
    ranks: tuple[int, ...] | None = None
    storage: Storage | None = field(default=None, compare=False)
    layout: ParallelLayout | None = None
    expert_parallel: ExpertParallel | None = field(default=None, compare=False)
    derived: DerivedState | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        runmanifest.check_role_name(self.name)
        if self.ranks is not None:
            ranks = tuple(self.ranks)
            if not ranks or any(
                not isinstance(r, int) or isinstance(r, bool) or r < 0 for r in ranks
            ):
                raise ConfigError(
                    f"Role({self.name!r}, ranks={self.ranks!r}): ranks must be non-empty ints >= 0"
                )
            if len(set(ranks)) != len(ranks):
                raise ConfigError(
                    f"Role({self.name!r}, ranks={self.ranks!r}): a rank is listed twice"
                )
            object.__setattr__(self, "ranks", tuple(sorted(ranks)))


def check_roles(roles: Sequence[Role]) -> list[Role]:
    """A run's ``roles`` argument: a non-empty list of ``Role``s, their names unique."""
    declared = list(roles)
    if not declared or not all(isinstance(r, Role) for r in declared):
        raise ConfigError(
            "RunCheckpoint(roles=...): give a non-empty list of ckptguard.Role(name, ranks=...)"
        )
    names = [r.name for r in declared]
    if len(set(names)) != len(names):
        raise ConfigError(f"RunCheckpoint(roles=...): role names must be unique, got {names}")
    return declared


def role_ranks(roles: Sequence[Role], world: int) -> dict[str, list[int]]:
    """Every role's ranks (None: every rank), in declared order, each a rank of the default process
    group."""
    held = {r.name: list(r.ranks) if r.ranks is not None else list(range(world)) for r in roles}
    for name, ranks in held.items():
        if max(ranks) >= world:
            raise ConfigError(
                f"role {name!r} lists ranks {ranks}, but the default "
                f"process group has {world} ranks"
            )
    return held


def role_contexts(
    roles: Sequence[Role],
    ranks: dict[str, list[int]],
    run: Context,
    namespace: str,
    *,
    distributed: bool,
) -> tuple[dict[str, Context], dict[str, int]]:
    """The context of each role this rank holds, in declared order, and this rank's rank in each
    (its proof records: ``ROOT/proof/<role>/``). Created collectively: every rank creates every
    role's group."""
    contexts: dict[str, Context] = {}
    held: dict[str, int] = {}
    timeout_s = run.config.timeout_s
    for role in roles:
        group = None
        if distributed:
            # Every rank creates every role's group (new_group's rule); a dedicated gloo group with
            # our timeout, so DCP's own collectives of a stalled role fail within timeout_s too.
            group = dist.new_group(
                ranks[role.name], backend="gloo", timeout=_dt.timedelta(seconds=timeout_s)
            )
        if run.rank not in ranks[role.name]:
            continue
        agreement = make_agreement(group, timeout_s=timeout_s, namespace=f"{namespace}/{role.name}")
        reshard = dataclasses.replace(run.config.reshard, layout=role.layout)
        cfg = dataclasses.replace(run.config, reshard=reshard)
        contexts[role.name] = Context.of(
            run.root,
            cfg,
            run.naming,
            agreement,
            role.storage or StreamingStorage(),
            group,
            role.expert_parallel,
        )
        held[role.name] = agreement.info.rank
    return contexts, held


class Fences:
    """The fences of every role of one save_async, as one (what PendingSave and ``staged`` wait
    on)."""

    def __init__(self, fences: list[Any]) -> None:
        self._fences = fences

    def host_wait(self) -> None:
        for f in self._fences:
            f.host_wait()

    def live_read(self) -> None:
        for f in self._fences:
            f.live_read()

    def before_mutation(self) -> float:
        return float(sum(f.before_mutation() for f in self._fences))

    @property
    def waited_s(self) -> float:
        return float(sum(f.waited_s for f in self._fences))


def in_role(exc: BaseException, role: str) -> BaseException:
    """The same error, its message naming the role (fields kept, so every rank rebuilds it
    alike)."""
    if not isinstance(exc, CheckpointError) or str(exc).startswith("role "):
        return exc
    named = type(exc).from_wire(f"role {role!r}: {exc}", exc.wire_fields())
    named.__cause__ = exc
    return named


def role_failure(exc: BaseException, *, rank: int, role: str) -> WriteFailure:
    """This rank's first write error of ``role``: the role's own first failure when it has one."""
    if isinstance(exc, CheckpointWriteError) and exc.first is not None:
        return dataclasses.replace(exc.first, rank=rank, phase=f"role {role!r}: {exc.first.phase}")
    return failure_from(exc, rank=rank, phase=f"role {role!r}: write")


def each_role(roles: dict[str, Context], act: Callable[[str, Context], None]) -> None:
    """``act`` on every role this rank holds, in declared order; the later roles still run after a
    failure, so their other ranks are not stranded; the first failure is raised, naming its role."""
    first: BaseException | None = None
    for name, ctx in roles.items():
        try:
            act(name, ctx)
        except Exception as exc:
            first = first or in_role(exc, name)
    if first is not None:
        raise first


def check_role_part(ctx: Context, part: Resolution, state: StateDict) -> None:
    """Everything a restore checks of one role's part before it reads a tensor (files, versions,
    topology, contract, items and keys, both ways), collectively over the role's ranks."""
    _resolve.agree_files(ctx, part)
    manifest, extras, _plan = on_every_rank(
        ctx.agreement, "run.precheck", lambda: _restore.precheck(ctx, part, state)
    )
    _restore.plan_targets(ctx, state, manifest, extras)


def load_role_part(
    ctx: Context,
    part: Resolution,
    state: StateDict,
    *,
    step: int,
    record: Callable[..., None],
    derived: DerivedState | None,
    sink: ProofSink | None = None,
) -> None:
    """Restore one role's part into ``state`` and record it (a failure is recorded, then raised).
    ``sink``: the role's; its first step record after this carries the replicas again."""
    before = addresses(state)
    where: dict[str, Any] = {"step": step, "path": str(part.path), "world_size": ctx.world}
    seen: dict[str, dict[str, Any]] = {"digests": {}, "layout_free": {}, "replicas": {}}
    try:
        done = _restore.restore(
            ctx, state, part, on_verified=lambda m, kind="digests": seen[kind].update(m)
        )
    except Exception as exc:  # recorded as a failed restore (prove shows it as FAIL), then raised
        record(
            "restore",
            ok=False,
            error=f"{type(exc).__name__}: {exc}"[:2000],
            digests_match=seen["digests"],
            layout_free_match=seen["layout_free"],
            replicas=seen["replicas"],
            **where,
        )
        raise
    if (
        done.reshard is not None
    ):  # old -> new world, the rules, this rank's RNG streams (prove shows them)
        where["reshard"] = done.reshard
    record(
        "restore",
        digests_match=done.digests_match,
        layout_free_match=done.layout_free_match,
        replicas=done.replicas,
        source_rank=done.source_rank,
        saved_world_size=done.saved_world_size,
        format_version=done.format_version,
        addresses_changed=moved(before, addresses(state)),
        ok=True,
        **where,
    )
    if sink is not None:
        sink.after_restore(state, ctx.keyfn(), done.replicas)
    if derived is not None:
        derived.mark_restored(step)


def check_states(
    states: Any, *, mine: set[str], ranks: dict[str, list[int]], rank: int, where: str
) -> None:
    """A run's ``states`` argument: a non-empty state dict for each role this rank holds, no
    other."""
    if not isinstance(states, dict):
        raise ConfigError(
            f"{where}(states): a dict of role name -> state dict, got {type(states).__name__}"
        )
    if missing := sorted(mine - set(states)):
        raise ConfigError(
            f"{where}(states) on rank {rank}: this rank holds roles {sorted(mine)} and got no "
            f"state for {missing}; pass a state dict for every role of my_roles"
        )
    if extra := sorted(set(states) - mine):
        raise ConfigError(
            f"{where}(states) on rank {rank}: role(s) {extra} are not held by this rank (roles and "
            f"their ranks: {ranks}); pass only the states of my_roles"
        )
    for name, state in states.items():
        if not isinstance(state, dict) or not state:
            raise ConfigError(
                f"{where}(states[{name!r}]): a non-empty dict of named items, got {state!r:.60}"
            )
        if where == "restore":  # an item no save could write: refused before the run trains on it
            check_items(state, f"restore of role {name!r}")


class RoleProofs:
    """The proof records of the roles this rank holds: ``ROOT/proof/<role>/``, one core
    ``ProofSink`` per role (written as a CheckpointManager's are; ``Root.cleanup`` prunes them)."""

    def __init__(self, sinks: dict[str, ProofSink], *, health: HealthPolicy, rank: int) -> None:
        self.sinks = sinks
        self.health = health
        self.rank = rank

    @classmethod
    def open(
        cls, root: Path, ranks: dict[str, int], config: CheckpointConfig, *, rank: int
    ) -> RoleProofs:
        """The sinks of the roles this rank holds (``ranks``: role -> this rank's rank in the
        role)."""
        sinks = {}
        for name, role_rank in ranks.items():
            log = ProofLog(root, role_rank, role=name)
            log.code = config.contract.code if config.contract is not None else None
            sinks[name] = ProofSink(log, enabled=config.proof.record, plan=config.proof.as_dict())
        return cls(sinks, health=config.health, rank=rank)

    def held(self, role: Any, where: str) -> str:
        """The role a record is for: ``role``, else (None) the one role this rank holds."""
        if role is None and len(self.sinks) == 1:
            return next(iter(self.sinks))
        if role is None:
            raise ConfigError(
                f"{where}(step, ..., role=...) on rank {self.rank}: this rank holds roles "
                f"{list(self.sinks)}; name the role whose event this is"
            )
        if role not in self.sinks:
            raise ConfigError(
                f"{where}(role={role!r}) on rank {self.rank}: this rank holds roles "
                f"{list(self.sinks)}; record a role's events on the ranks that hold it"
            )
        return str(role)

    def record(self, role: str, event: str, *, durable: bool = True, **fields: Any) -> None:
        self.sinks[role].record(event, durable=durable, role=role, **fields)

    def step(
        self,
        role: str | None,
        step: int,
        health: HealthLog,
        *,
        sample_ids: Any,
        batch: Any,
        loss: Any,
        grad_norm: Any,
        **extra: Any,
    ) -> JsonObject:
        """A step record of ``role``; its loss and grad_norm are health evidence for the next
        save."""
        role = self.held(role, "record_step")
        check_step(step, "record_step")
        fields = fingerprint(sample_ids, batch, loss, grad_norm, extra)
        health.note(self.health, step, step_metrics(fields), role=role)
        self.record(role, "step", durable=False, step=step, **fields)
        return fields

    def update(
        self, role: str | None, step: int, *, grad_norm: float, params_changed: bool
    ) -> None:
        role = self.held(role, "record_update")
        self.record(
            role,
            "update",
            step=step,
            grad_norm=float(grad_norm),
            params_changed=bool(params_changed),
        )

    def export(
        self, role: str | None, step: int, payload: Any, *, scales: Any = None
    ) -> ExportFingerprint:
        role = self.held(role, "record_export")
        fp = export_fingerprint(payload, scales)
        self.record(role, "export", step=step, fingerprint=fp)
        return fp

    def logprobs(
        self, role: str | None, step: int, trainer_logprobs: Any, rollout_logprobs: Any
    ) -> dict[str, float]:
        role = self.held(role, "record_logprobs")
        diff = logprob_diff(trainer_logprobs, rollout_logprobs)
        self.record(role, "logprobs", step=step, **dict[str, Any](diff))
        return diff


def role_budget(config: CheckpointConfig, roles: int) -> tuple[int, str]:
    """This rank's host staging budget for ``save_async``, split evenly between the ``roles`` it
    holds."""
    total = _async.AsyncStaging().host_budget(config)
    n = max(1, roles)
    return total // n, f"this rank's host staging budget {total} B split between its {n} role(s)"
