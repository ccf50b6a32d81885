"""A run step's restore (``ckptguard.RunCheckpoint``): which run step, then every role's part of it.

``resolve_run`` picks the step (the tracker's, or a given path) only where it holds every declared
role, agreed by every rank of the run, else every rank raises naming the missing role.
``restore_roles`` checks every role's part (files, versions, topology, contract, items and keys) on
every rank before any role reads a tensor, then loads each into its state; a failure raises on every
rank of the run, so no rank trains on a partly restored run.
"""

from __future__ import annotations

import os
from pathlib import Path

from .._agree import gather_decide, on_every_rank
from .._context import Context
from .._records import checks as _checks
from .._records.trust import Prefer
from .._resume import resolve_agreed as _resolve
from .._resume.resolve_agreed import ResolveView
from .._resume.resolve_local import Resolution, resolve_local
from .._state.derived import DerivedState
from .._types import StateDict
from ..config import ResumeMode
from ..errors import error_payload
from .roles import RoleProofs, check_role_part, each_role, load_role_part


def resolve_run(
    run: Context,
    names: list[str],
    mode: ResumeMode,
    path: str | os.PathLike[str] | None,
    prefer: Prefer,
) -> Resolution:
    """The run step a restore would load, agreed by every rank: a step holding every role of
    ``names``."""
    res: Resolution | None = None
    try:
        res = resolve_local(
            run.root,
            run.naming,
            mode,
            Path(path) if path is not None else None,
            prefer,
            read_manifest=lambda d: _checks.checked_run_step(d, roles=names),
        )
        view = ResolveView(res.step, str(res.path) if res.path else None)
    except Exception as exc:  # shipped, so no rank waits for a peer that raised
        view = ResolveView(error=error_payload(exc))
    gather_decide(
        run.agreement, "run.resolve", view, _resolve.same_checkpoint, decision=_resolve.AgreedStep
    )
    assert res is not None
    return res


def restore_roles(
    run: Context,
    roles: dict[str, Context],
    res: Resolution,
    states: dict[str, StateDict],
    *,
    names: list[str],
    derived: dict[str, DerivedState],
    proofs: RoleProofs,
) -> None:
    """Load run step ``res`` into the state of every role this rank holds (``roles``), each recorded
    in its role's proof records; every part is checked on every rank before any role reads a
    tensor."""
    assert res.path is not None
    parts = {
        n: Resolution(res.step, res.path / n, f"role {n!r} of run step {res.step}", res.mode)
        for n in names
    }

    # What restore checks before it reads a tensor, for every role before any role reads one.
    on_every_rank(
        run.agreement,
        "run.checked",
        lambda: each_role(roles, lambda name, ctx: check_role_part(ctx, parts[name], states[name])),
    )
    on_every_rank(
        run.agreement,
        "run.restored",
        lambda: each_role(
            roles,
            lambda name, ctx: load_role_part(
                ctx,
                parts[name],
                states[name],
                step=res.step,
                derived=derived.get(name),
                record=lambda event, **fields: proofs.record(name, event, **fields),
                sink=proofs.sinks[name],
            ),
        ),
    )
