"""A run step's save (``ckptguard.RunCheckpoint``): every role's snapshot, then one commit of them
all.

``snapshots`` takes the snapshot of every role this rank holds, in declared order on every rank (no
cross-role wait cycle), each inside its role's divergence records; ``staged_snapshots`` does it for
``save_async``, each role's copies queued into its own host pool. ``commit_roles`` prepares the run
temp directory, writes every role's part into it by the single-role protocol and publishes the run
step once every rank of every role reported (``_commit.publish_run``): in the caller's thread, or in
save_async's background commit.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from .. import _faults, _log
from .._agree import gather_decide, on_every_rank
from .._commit import pending as _async
from .._commit import protocol as _commit
from .._commit.messages import Outcome, raise_if_failed
from .._commit.publish_run import RunReport, node_local_message, publish_run_step
from .._commit.snapshot import Snapshot
from .._context import Actions, Context
from .._disk import layout as _layout
from .._records.entries import Figure
from .._types import StateDict
from ..errors import ConfigError
from ..storage._staging import Fence, StagingPool
from .roles import RoleProofs, each_role, role_failure

log = _log.logger()


def snapshots(
    run: Context,
    roles: dict[str, Context],
    proofs: RoleProofs,
    take_one: Callable[[str, Context], Snapshot],
    step: int,
) -> dict[str, Snapshot]:
    """Every role's snapshot, in declared order on every rank (no cross-role wait cycle); the later
    roles still run after a failure, so their other ranks are not stranded; every rank raises
    alike."""
    snaps: dict[str, Snapshot] = {}

    def take(name: str, ctx: Context) -> None:
        with proofs.sinks[name].divergence(step):  # in the role's records: prove names it
            snaps[name] = take_one(name, ctx)

    on_every_rank(run.agreement, "run.snapshot", lambda: each_role(roles, take))
    return snaps


def staged_snapshots(
    run: Context,
    roles: dict[str, Context],
    proofs: RoleProofs,
    staging: dict[str, _async.AsyncStaging],
    step: int,
    states: dict[str, StateDict],
    actions: Actions,
    *,
    budget: tuple[int, str],
    cost: Callable[[], Mapping[str, Figure]],
) -> tuple[dict[str, Snapshot], list[Fence], list[StagingPool]]:
    """``save_async``'s snapshots: every role's copies queued into its own host pool (``staging``,
    one per role, ``budget`` this rank's share for each); with the fences the next mutation waits on
    and the pools whose placed slots the commit reads. A failure releases both before it is
    raised."""
    fences: list[Fence] = []
    pools: list[StagingPool] = []

    def stage(name: str, ctx: Context) -> Snapshot:
        # The core's staging (CheckpointManager's): one host pool per role, this rank's budget split
        # between them.
        held = staging.setdefault(name, _async.AsyncStaging())
        held.budget, held.budget_why = budget
        snap, fence = _async.staged_snapshot(ctx, held, step, states[name], actions, cost)
        fences.append(fence)
        if held.pool is not None:
            pools.append(held.pool)  # placed slots: done() once the commit no longer reads them
        return snap

    try:
        return snapshots(run, roles, proofs, stage, step), fences, pools
    except BaseException:
        # Nothing will read the staged or live tensors: training may change them.
        for fence in fences:
            fence.live_read()
        for pool in pools:
            pool.done()
        raise


def commit_roles(
    run: Context,
    roles: dict[str, Context],
    ranks: dict[str, list[int]],
    proofs: RoleProofs,
    step: int,
    snaps: dict[str, Snapshot],
    actions: Actions,
) -> Path:
    """Prepare the run step, write every role's part into its temp directory, publish once every
    rank of every role reported; every rank raises alike or gets the step's directory, each role's
    save recorded."""
    prep = _commit.prepare(run, step, actions)
    if prep.nodes:  # the probe's verdict changed since (a remount): every rank raises alike
        others = [r for node in prep.nodes[1:] for r in node]
        raise ConfigError(node_local_message(run.root, step, others))
    tmp = Path(prep.tmp)
    if run.rank == 0:
        with contextlib.suppress(OSError):  # the run directory holds roles, not a state/ of its own
            (tmp / _layout.STATE_DIR).rmdir()
    failure = None
    for name, ctx in roles.items():
        try:
            (tmp / name / _layout.STATE_DIR).mkdir(parents=True, exist_ok=True)
            with proofs.sinks[name].divergence(step):  # save_async's guard runs in the commit
                _commit.commit(
                    ctx, snaps[name], part=dataclasses.replace(prep, tmp=str(tmp / name))
                )
            _faults.reached("run.role_written")
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
            failure = failure or role_failure(exc, rank=run.rank, role=name)
    outcome = gather_decide(
        run.agreement,
        "run.written",
        RunReport(list(roles), failure),
        lambda reports: publish_run_step(run, step, tmp, prep, reports, ranks, actions),
        decision=Outcome,
    )
    raise_if_failed(run, outcome.failures, step=step, phase=outcome.phase)
    path = run.root / run.naming.name(step)
    log.info("ckptguard: committed run step %d (roles %s) at %s", step, ", ".join(ranks), path)
    for name, ctx in roles.items():
        proofs.record(
            name,
            "save",
            step=step,
            path=str(path / name),
            world_size=ctx.world,
            **({"async": True} if snaps[name].resumed is not None else {}),
        )
    return path
