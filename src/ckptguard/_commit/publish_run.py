"""The run publisher: a run step of several roles, published once every role on every rank
confirmed.

Each role's part was written and marked by the role-part publisher (``publish.RolePartPublisher``);
rank 0 then checks that every role was written by exactly its declared ranks, writes the run
manifest (the commit marker, listing every role), renames the run's temp directory to the step name
and moves the one tracker. A run commits on one shared root only: ``check_shared_root`` refuses
node-local roots before anything of a save is written.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from .. import _faults
from .._agree import Wire, gather_decide
from .._context import Actions, Context
from .._disk import layout as _layout
from .._records import runmanifest
from ..errors import ConfigError, WriteFailure
from ..storage.dcp import current_versions
from . import stepdir as _stepdir
from .messages import Outcome, Prepared, failure_from, read_failure


@dataclass(frozen=True)
class RunReport(Wire):
    """Which roles this rank wrote its part of, or the first error it hit."""

    roles: list[str] = field(default_factory=list)
    failure: WriteFailure | None = None
    READERS = {"failure": read_failure}


@dataclass(frozen=True)
class Probe(Wire):
    """Rank 0's probe directory under the root (its name), or whether this rank sees it."""

    name: str = ""
    sees: bool = True


@dataclass(frozen=True)
class Placed(Wire):
    """Rank 0's verdict on the probe: the ranks that do not see rank 0's disk at the root's path."""

    blind: list[int] = field(default_factory=list)


def node_local_message(root: Path, step: int, blind: list[int]) -> str:
    return (
        f"RunCheckpoint save of step {step} under {root}: ranks {blind} do not see rank 0's disk "
        f"at that path (node-local disks, not one shared root); a run of several roles commits on "
        f"a shared filesystem only. Nothing was written. Put the root on shared storage, or give "
        f"each role its own CheckpointManager (per-node publish)."
    )


def check_shared_root(ctx: Context, step: int) -> None:
    """Refuse node-local roots before anything of the save is written, with one verdict on every
    rank: rank 0 makes a probe directory (a temp directory, swept if this process dies) under the
    root, every rank looks for it, rank 0 removes it (and the root, if it made it for the probe and
    refuses)."""
    made_root: list[bool] = []

    def make(_: list[Probe]) -> Probe:
        made_root.append(not ctx.root.exists())
        ctx.root.mkdir(parents=True, exist_ok=True)  # the first save creates it anyway
        probe = ctx.root / _layout.temp_dir_name("probe", secrets.token_hex(6))
        probe.mkdir()
        _layout.write_owner(probe)
        return Probe(probe.name)

    probe = gather_decide(ctx.agreement, "run.probe", Probe(), make, decision=Probe)
    sees = (ctx.root / probe.name).is_dir()

    def judge(views: list[Probe]) -> Placed:
        shutil.rmtree(ctx.root / probe.name, ignore_errors=True)
        blind = [r for r, v in enumerate(views) if not v.sees]
        if blind and made_root and made_root[0]:
            with contextlib.suppress(OSError):  # only if still empty: never anything else's
                ctx.root.rmdir()
        return Placed(blind)

    placed = gather_decide(
        ctx.agreement, "run.placed", Probe(probe.name, sees), judge, decision=Placed
    )
    if placed.blind:
        raise ConfigError(node_local_message(ctx.root, step, placed.blind))


def publish_run_step(
    ctx: Context,
    step: int,
    tmp: Path,
    prep: Prepared,
    reports: list[RunReport],
    declared: dict[str, list[int]],
    actions: Actions,
) -> Outcome:
    """Rank 0: the run manifest, the rename and the tracker if every role on every rank
    confirmed."""
    failures = [r.failure for r in reports if r.failure]
    if failures:
        _stepdir.discard(ctx, tmp)
        return Outcome(failures, "write")
    try:
        held = {
            name: [r for r, rep in enumerate(reports) if name in rep.roles] for name in declared
        }
        for name, ranks in held.items():
            if ranks != sorted(declared[name]):
                raise ConfigError(
                    f"role {name!r} was written by ranks {ranks} but is declared "
                    f"on {declared[name]}: every rank must create the "
                    f"RunCheckpoint with the same roles"
                )
        _faults.reached("run.before_manifest")
        manifest = runmanifest.build(
            step_dir=tmp,
            step=step,
            chain_id=prep.chain_id,
            dir_template=ctx.naming.template,
            world_size=ctx.world,
            roles={name: declared[name] for name in declared},
            contract={"phase": prep.phase, "hash": prep.contract_hash},
            versions=current_versions(),
        )
        _layout.atomic_write_json(manifest.path, manifest.to_json())
        _faults.reached("commit.before_rename")
        _stepdir.publish_dir(ctx, step, tmp, actions)
    except Exception as exc:
        if tmp.exists():  # refused or failed before the rename: nothing of it may linger
            _stepdir.discard(ctx, tmp)
        return Outcome([failure_from(exc, rank=0, phase="publish")], "publish")
    return Outcome()
