"""RunCheckpoint: every role of one run (actor, critic, ref, driver, ...) committed as one step.

An RL run is several models and a driver, each on its own ranks (colocated or disaggregated).
Saved by separate managers, a half-written step (the actor's files, not the critic's) could be
picked as the latest. Here every role's part is written by the single-role commit protocol
into one run temp directory, the role's ranks confirming its part (its manifest); then every
rank of the run reports, and rank 0 writes the run manifest listing every role (written last),
renames the directory to the step name and moves the one tracker. A crash anywhere before that
leaves the previous step as the resume target; a step missing a role is never restored.
On-disk form: ``_commit.runmanifest`` (each role's part is a step directory that plain DCP reads).

Collective rules: every rank of the default process group creates the RunCheckpoint with the
same roles in the same order (each role gets its own gloo group, created by every rank as
``torch.distributed.new_group`` requires) and calls ``save``/``restore`` together, passing the
states of the roles it holds; a rank holding no role passes ``{}``. Inside Ray actors, form the
default group with ``ckptguard.integrations.ray.join_process_group`` first, as for a manager.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from . import _faults, _log
from ._commit import layout as _layout
from ._commit import lease as _lease
from ._commit import protocol as _commit
from ._commit import retention, runmanifest
from ._commit.protocol import Outcome, failure_from
from ._dist import Wire, gather_decide, make_agreement, on_every_rank
from ._resume import restore as _restore
from ._resume.derived import DerivedState
from ._resume.expert import ExpertParallel
from ._resume.restore import Resolution, ResolveView
from .config import CheckpointConfig, ParallelLayout, ResumeMode
from .errors import CheckpointError, CheckpointWriteError, ConfigError, error_payload
from .storage.base import Storage, StorageContext
from .storage.streaming import StreamingStorage

log = _log.logger()


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
            if not ranks or any(not isinstance(r, int) or isinstance(r, bool) or r < 0 for r in ranks):
                raise ConfigError(f"Role({self.name!r}, ranks={self.ranks!r}): ranks must be non-empty ints >= 0")
            if len(set(ranks)) != len(ranks):
                raise ConfigError(f"Role({self.name!r}, ranks={self.ranks!r}): a rank is listed twice")
            object.__setattr__(self, "ranks", tuple(sorted(ranks)))


@dataclass(frozen=True)
class _RunReport(Wire):
    """Which roles this rank wrote its part of, or the first error it hit."""

    roles: list[str] = field(default_factory=list)
    failure: dict[str, Any] | None = None


def _in_role(exc: BaseException, role: str) -> BaseException:
    """The same error, its message naming the role (fields kept, so every rank rebuilds it alike)."""
    if not isinstance(exc, CheckpointError) or str(exc).startswith("role "):
        return exc
    named = type(exc).from_wire(f"role {role!r}: {exc}", exc.wire_fields())
    named.__cause__ = exc
    return named


def _role_failure(exc: BaseException, *, rank: int, role: str) -> dict[str, Any]:
    """This rank's first write error of ``role``: the role's own first failure when it has one."""
    if isinstance(exc, CheckpointWriteError) and exc.first is not None:
        return dataclasses.replace(exc.first, rank=rank, phase=f"role {role!r}: {exc.first.phase}").to_json()
    return failure_from(exc, rank=rank, phase=f"role {role!r}: write").to_json()


class RunCheckpoint:
    """Saves and restores every role of a run as one step under one checkpoint root.

    ``save(step, states)`` commits every role on every rank or raises on every rank; the
    tracker moves only after the run manifest, listing every role, is written. ``restore``
    restores every role or raises on every rank: every role's files, versions, topology and
    contract are checked before any role reads a tensor, and a step missing a role (or with a
    role's part damaged) is refused naming the role. ``root`` is never created by the
    constructor or by ``restore``; the first ``save`` creates it. Retention (the config's
    policy) deletes whole run steps, never one role's part.
    """

    _created = 0

    def __init__(
        self, root: str | os.PathLike[str], roles: Sequence[Role], *, config: CheckpointConfig | None = None
    ) -> None:
        self.config = config or CheckpointConfig()
        if not isinstance(self.config, CheckpointConfig):
            raise ConfigError(f"config must be a CheckpointConfig, got {type(self.config).__name__}")
        if self.config.health.prefer.value != "latest":
            # RunCheckpoint keeps no trust record yet (no healthy= on its save): refused, never ignored.
            raise ConfigError(
                "RunCheckpoint: CheckpointConfig(health=HealthPolicy(prefer='verified')) is not supported for a "
                "run of several roles (it keeps no trust record); use prefer='latest'"
            )
        roles = list(roles)
        if not roles or not all(isinstance(r, Role) for r in roles):
            raise ConfigError("RunCheckpoint(roles=...): give a non-empty list of ckptguard.Role(name, ranks=...)")
        names = [r.name for r in roles]
        if len(set(names)) != len(names):
            raise ConfigError(f"RunCheckpoint(roles=...): role names must be unique, got {names}")
        self.root = Path(root).absolute()
        self._naming = _layout.StepNaming(self.config.dir_template)
        distributed = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if distributed else 1
        self._ranks = {r.name: list(r.ranks) if r.ranks is not None else list(range(world)) for r in roles}
        for name, ranks in self._ranks.items():
            if max(ranks) >= world:
                raise ConfigError(f"role {name!r} lists ranks {ranks}, but the default process group has {world} ranks")
        # Created collectively, in the same order on every rank: the counter names the store keys alike.
        RunCheckpoint._created += 1
        ns = f"run-{RunCheckpoint._created}"
        run_agreement = make_agreement(None, timeout_s=self.config.timeout_s, namespace=ns)
        me = run_agreement.info.rank
        self._run = self._context(run_agreement, self.config, StreamingStorage(), None, None)
        self._roles: dict[str, _commit.Context] = {}
        self._derived: dict[str, DerivedState] = {}
        for role in roles:
            group = None
            if distributed:
                # Every rank creates every role's group (new_group's rule); a dedicated gloo group with our
                # timeout, so DCP's own collectives of a stalled role fail within timeout_s too.
                group = dist.new_group(
                    self._ranks[role.name], backend="gloo", timeout=_dt.timedelta(seconds=self.config.timeout_s)
                )
            if me not in self._ranks[role.name]:
                continue
            agreement = make_agreement(group, timeout_s=self.config.timeout_s, namespace=f"{ns}/{role.name}")
            cfg = dataclasses.replace(self.config, layout=role.layout)
            self._roles[role.name] = self._context(
                agreement, cfg, role.storage or StreamingStorage(), group, role.expert_parallel
            )
            if role.derived is not None:
                self._derived[role.name] = role.derived
        self._restored_step: int | None = None
        self._check_lease("create")

    def _context(
        self, agreement: Any, config: CheckpointConfig, storage: Storage, group: Any, expert: ExpertParallel | None
    ) -> _commit.Context:
        info = agreement.info
        return _commit.Context(
            root=self.root,
            config=config,
            naming=self._naming,
            agreement=agreement,
            storage=storage,
            storage_ctx=StorageContext(rank=info.rank, world_size=info.world_size, process_group=group),
            expert=expert,
        )

    @property
    def rank(self) -> int:
        """This process's rank in the run (the default process group)."""
        return self._run.rank

    @property
    def roles(self) -> dict[str, list[int]]:
        """Every role and the ranks that hold it."""
        return {name: list(ranks) for name, ranks in self._ranks.items()}

    @property
    def my_roles(self) -> list[str]:
        """The roles this rank holds, in declared order: the keys ``save`` and ``restore`` expect."""
        return list(self._roles)

    # ------------------------------------------------------------ queries

    def committed_steps(self) -> list[int]:
        """Run steps with every role's part in place and no newer than the tracker, ascending."""
        tracker = _layout.read_tracker(self.root)
        out = []
        for step, path in sorted(_layout.step_dirs(self.root, self._naming).items()):
            if tracker is None or step > tracker:
                continue
            try:
                runmanifest.checked(path, roles=list(self._ranks))
            except CheckpointError:
                continue
            out.append(step)
        return out

    def resolve(self, *, mode: ResumeMode = ResumeMode.AUTO, path: str | os.PathLike[str] | None = None) -> Resolution:
        """Which run step a restore would load and why, agreed by every rank; loads nothing.

        The tracker's step (or ``path``) must be a run step holding every declared role;
        otherwise every rank raises, naming the role that is missing."""
        if not isinstance(mode, ResumeMode):
            raise ConfigError(f"mode must be a ResumeMode (AUTO, MUST, NEVER), got {mode!r}")
        res: Resolution | None = None
        names = list(self._ranks)
        try:
            res = _restore.resolve_local(
                self.root,
                self._naming,
                mode,
                Path(path) if path is not None else None,
                read_manifest=lambda d: runmanifest.checked(d, roles=names),
            )
            view = ResolveView(res.step, str(res.path) if res.path else None)
        except Exception as exc:  # shipped, so no rank waits for a peer that raised
            view = ResolveView(error=error_payload(exc))
        gather_decide(self._run.agreement, "run.resolve", view, _restore._same_checkpoint, decision=_restore.AgreedStep)
        assert res is not None
        return res

    # ------------------------------------------------------------ save

    def save(self, step: int, states: dict[str, dict[str, Any]]) -> Path:
        """Commit every role's state as run step ``step`` on every rank, or raise on every rank.

        ``states`` maps each role this rank holds (``my_roles``) to its state dict (the items
        a CheckpointManager takes). Returns the committed step directory."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 1:
            raise ConfigError(f"save(step={step!r}): step must be an int >= 1 (0 is reserved for 'fresh start')")
        self._check_states(states, "save")
        snaps: dict[str, _commit.Snapshot] = {}

        def take() -> None:
            first: BaseException | None = None
            for name, ctx in self._roles.items():  # declared order on every rank: no cross-role wait cycle
                try:
                    snaps[name] = _commit.snapshot(ctx, step, states[name])
                except Exception as exc:  # the later roles still run, so their other ranks are not stranded
                    first = first or _in_role(exc, name)
            if first is not None:
                raise first

        on_every_rank(self._run.agreement, "run.snapshot", take)
        prep = _commit._prepare(self._run, step)
        if prep.nodes:  # every rank got the same verdict: all raise alike; the temp dir is swept as dead
            raise ConfigError(
                f"RunCheckpoint save of step {step} under {self.root}: the ranks see node-local disks (not one "
                "shared root); a run of several roles commits on a shared filesystem only. Put the root on "
                "shared storage, or give each role its own CheckpointManager (per-node publish)."
            )
        tmp = Path(prep.tmp)
        if self.rank == 0:
            with contextlib.suppress(OSError):  # the run directory holds roles, not a state/ of its own
                (tmp / _layout.STATE_DIR).rmdir()
        failure = None
        for name, ctx in self._roles.items():
            try:
                (tmp / name / _layout.STATE_DIR).mkdir(parents=True, exist_ok=True)
                _commit.commit(ctx, snaps[name], part=dataclasses.replace(prep, tmp=str(tmp / name)))
                _faults.reached("run.role_written")
            except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
                failure = failure or _role_failure(exc, rank=self.rank, role=name)
        outcome = gather_decide(
            self._run.agreement,
            "run.written",
            _RunReport(list(self._roles), failure),
            lambda reports: self._publish_or_fail(step, tmp, prep, reports),
            decision=Outcome,
            patience=2.0,
        )
        _commit._raise_if_failed(self._run, outcome.failures, step=step, phase=outcome.phase)
        path = self.root / self._naming.name(step)
        log.info("ckptguard: committed run step %d (roles %s) at %s", step, ", ".join(self._ranks), path)
        self._rotate(step)
        return path

    def _publish_or_fail(self, step: int, tmp: Path, prep: _commit.Prepared, reports: list[_RunReport]) -> Outcome:
        """Rank 0: the run manifest, the rename and the tracker if every role on every rank confirmed."""
        failures = [r.failure for r in reports if r.failure]
        if failures:
            _commit._discard(self._run, tmp)
            return Outcome(failures, "write")
        try:
            held = {name: [r for r, rep in enumerate(reports) if name in rep.roles] for name in self._ranks}
            for name, ranks in held.items():
                if ranks != sorted(self._ranks[name]):
                    raise ConfigError(
                        f"role {name!r} was written by ranks {ranks} but is declared on {self._ranks[name]}: "
                        "every rank must create the RunCheckpoint with the same roles"
                    )
            _faults.reached("run.before_manifest")
            manifest = runmanifest.build(
                step_dir=tmp,
                step=step,
                chain_id=prep.chain_id,
                dir_template=self._naming.template,
                world_size=self._run.world,
                roles={name: self._ranks[name] for name in self._ranks},
                contract={"phase": prep.phase, "hash": prep.contract_hash},
            )
            _layout.atomic_write_json(manifest.path, manifest.to_json())
            _faults.reached("commit.before_rename")
            _commit.publish_dir(self._run, step, tmp)
        except Exception as exc:
            if tmp.exists():  # refused or failed before the rename: nothing of it may linger
                _commit._discard(self._run, tmp)
            return Outcome([failure_from(exc, rank=0, phase="publish").to_json()], "publish")
        return Outcome()

    def _rotate(self, step: int) -> None:
        """Rank 0 applies retention to whole run steps after the commit; a failure is logged, never raised.
        A run step missing a role is incomplete for retention (``verify_step``): never counted, never deleted."""
        policy = self.config.retention
        if policy is None or self.rank != 0:
            return
        protect = {step} | ({self._restored_step} if self._restored_step else set())
        try:
            report = retention.apply(self.root, self._naming, policy, protect=protect)
        except Exception as exc:  # rotation must never stop training
            log.warning("ckptguard: retention after run step %d failed (%s: %s); retried at the next save",
                        step, type(exc).__name__, exc)
            return
        if report.deleted:
            log.info("ckptguard: retention deleted run steps %s, kept %s", report.deleted, report.kept)
        for name, why in report.not_counted.items():
            log.warning("ckptguard: %s is not counted as a kept checkpoint: %s", name, why)

    # ------------------------------------------------------------ restore

    def restore(
        self,
        states: dict[str, dict[str, Any]],
        *,
        mode: ResumeMode = ResumeMode.AUTO,
        path: str | os.PathLike[str] | None = None,
    ) -> int:
        """Load the resolved run step into every role's state in place; return its step (0: fresh).

        ``states`` as for ``save``. Every role's files, versions, topology, contract, items and
        keys are checked on every rank before any role reads a tensor; a failure after that (a
        damaged shard, a digest that differs) raises on every rank of the run, so no rank trains
        on a partly restored run."""
        self._check_states(states, "restore")
        self._check_lease("restore")
        res = self.resolve(mode=mode, path=path)
        if res.fresh:
            log.warning("ckptguard: %s", res.describe())
            return 0
        log.info("ckptguard: %s (roles %s)", res.describe(), ", ".join(self._ranks))
        assert res.path is not None
        parts = {
            n: Resolution(res.step, res.path / n, f"role {n!r} of run step {res.step}", res.mode) for n in self._ranks
        }

        def each_role(act: Any) -> None:
            first: BaseException | None = None
            for name, ctx in self._roles.items():
                try:
                    act(name, ctx)
                except Exception as exc:  # the later roles still run, so their other ranks are not stranded
                    first = first or _in_role(exc, name)
            if first is not None:
                raise first

        def check(name: str, ctx: _commit.Context) -> None:
            # What restore checks before it reads a tensor, for every role before any role reads one.
            _restore._agree_files(ctx, parts[name])
            part = parts[name]
            manifest, extras, _plan = on_every_rank(
                ctx.agreement, "run.precheck", lambda: _restore._precheck(ctx, part, states[name])
            )
            _restore._plan(ctx, states[name], manifest, extras)  # items and keys, both ways

        def load(name: str, ctx: _commit.Context) -> None:
            _restore.restore(ctx, states[name], parts[name])
            if name in self._derived:
                self._derived[name].mark_restored(res.step)

        on_every_rank(self._run.agreement, "run.checked", lambda: each_role(check))
        on_every_rank(self._run.agreement, "run.restored", lambda: each_role(load))
        self._restored_step = res.step
        return res.step

    # ------------------------------------------------------------ guards

    def _check_states(self, states: Any, where: str) -> None:
        if not isinstance(states, dict):
            raise ConfigError(f"{where}(states): a dict of role name -> state dict, got {type(states).__name__}")
        mine = set(self._roles)
        if missing := sorted(mine - set(states)):
            raise ConfigError(
                f"{where}(states) on rank {self.rank}: this rank holds roles {sorted(mine)} and got no state for "
                f"{missing}; pass a state dict for every role of my_roles"
            )
        if extra := sorted(set(states) - mine):
            raise ConfigError(
                f"{where}(states) on rank {self.rank}: role(s) {extra} are not held by this rank (roles and their "
                f"ranks: {self._ranks}); pass only the states of my_roles"
            )
        for name, state in states.items():
            if not isinstance(state, dict) or not state:
                raise ConfigError(f"{where}(states[{name!r}]): a non-empty dict of named items, got {state!r:.60}")

    def _check_lease(self, where: str) -> None:
        """As CheckpointManager: another live run holding the root's lease is a warning at
        creation and a refusal on every rank at restore."""
        if self.config.break_lease:
            return
        _lease.check_on_every_rank(
            self._run.agreement, self.root, ttl_s=self.config.lease_ttl_s, where=where, key=f"run.lease.{where}"
        )
