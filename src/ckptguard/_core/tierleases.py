"""The tiers' write leases: the persistent root's, held from the first save of either tier; both, at
a restore.

``hold``: at every save of either tier, rank 0 takes (or renews) the persistent root's write lease
through its stage (``RootStage.hold``: whatever kind of root it is), creating the root (tracker 0: a
declared fresh start) at the first one, so the fast saves' proof records are durable there and a
second live job on that root is refused at once, on every rank (without it a duplicate launch
trained on until its own first, rare, persistent save). ``check``: before a restore chooses its
step, another live job holding either tier's root stops it, whichever tier it would load; then the
persistent stage runs its own restore checks.
"""

from __future__ import annotations

from .._agree import Agreement, on_every_rank
from .._context import Context
from .._disk import lease as _lease
from .rootstage import RootStage
from .tierrestore import Tier


def hold(
    agreement: Agreement, stage: RootStage | None, rank: int, break_lease: bool = False
) -> None:
    """Rank 0 holds the persistent root's write lease (``stage``: the persistent tier's; None: no
    such tier)."""
    if stage is None:
        return
    on_every_rank(
        agreement, "tiers.persistent_lease", lambda: stage.hold(break_lease) if rank == 0 else None
    )


def check(
    agreement: Agreement,
    roots: dict[Tier, Context],
    stage: RootStage | None,
    break_lease: bool = False,
) -> None:
    """Before a restore (collective): no other live job holds a tier's root (``roots``: each tier's
    context; not checked with ``break_lease``, whose load takes the lease over). Then the persistent
    ``stage``'s restore checks (an object store's lease; its proof log, a lost node's, back from the
    store)."""
    for tier, ctx in roots.items():
        if not break_lease:  # a duplicate launch stops here, whichever tier it would load
            _lease.check_on_every_rank(
                agreement,
                ctx.root,
                ttl_s=ctx.config.storage.lease_ttl_s,
                where="restore",
                key=f"tiers.lease.{tier.value}",
            )
    if stage is not None:
        stage.before_restore(break_lease)
