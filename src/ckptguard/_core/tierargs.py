"""``TieredCheckpoint``'s constructor arguments, checked, and what they make of the tiers.

``fast_root`` and ``separate_roots``: which root is the fast tier, and that the persistent tier's
local root is another one. ``TierPlan.of`` checks the intervals (``fast_every``,
``persistent_every``: ints >= 1) and ``replicas`` (0 or 1), and derives from the
``CheckpointConfig`` passed the one each tier's manager gets: its saves whole (no blocking budget of
its own) and, under the tiers' ``OnBusy.FAST_TIER``, a manager that skips (the tiers route a busy
``save_async``, not the manager). ``staging``: one host staging pool for both tiers, except under
``FAST_TIER``. ``check_peers``: a peer replica lives on another node. ``check_restore``: a restore's
``mode``, and the health policy a choice across tiers can follow.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from .._commit.busy import check_policy
from .._commit.pending import AsyncStaging
from .._records.trust import Prefer
from ..config import BlockingBudget, CheckpointConfig, OnBusy, ResumeMode
from ..errors import ConfigError
from .rootstage import is_store


def fast_root(root: str | os.PathLike[str] | None) -> str | os.PathLike[str]:
    """The fast tier's root: the first argument, as ``CheckpointManager(root)`` and
    ``RunCheckpoint(root, roles)`` take theirs."""
    if root is None or is_store(root):
        raise ConfigError(
            f"TieredCheckpoint({root!r}, persistent=...): give the fast tier's root (node-local "
            "storage, the same path on every node) as the first argument; an s3:// root is a "
            "persistent tier (persistent='s3://bucket/prefix')"
        )
    return root


def separate_roots(
    fast: str | os.PathLike[str],
    persistent: str | os.PathLike[str] | None,
    persistent_local: Path | None,
) -> Path:
    """The root of the tiers' one proof log: the persistent tier's local root (``persistent_local``:
    an ``s3://`` root's staging root) when there is one, else the fast root; the two tiers' roots
    checked apart."""
    fast_dir = Path(fast).absolute()
    if persistent is None or persistent_local is None:
        return fast_dir
    if persistent_local == fast_dir:
        what = (
            "persistent's staging root (StorageOptions.object_staging)"
            if is_store(persistent)
            else "persistent"
        )
        raise ConfigError(
            f"TieredCheckpoint: fast and {what} are the same root {fast_dir}; give two roots"
        )
    return persistent_local


@dataclass(frozen=True)
class TierPlan:
    """The tiers' intervals, replicas and ``on_busy`` policy, and their managers' config."""

    fast_every: int
    persistent_every: int
    replicas: int
    on_busy: OnBusy
    """The tiers' ``CheckpointConfig.async_save.on_busy`` (SKIP, WAIT or FAST_TIER)."""
    base: CheckpointConfig
    """The config of both tiers' managers (each with its own ``retention``)."""

    @classmethod
    def of(
        cls, fast_every: int, persistent_every: int, replicas: int, config: CheckpointConfig | None
    ) -> TierPlan:
        for name, value in (("fast_every", fast_every), ("persistent_every", persistent_every)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(
                    f"TieredCheckpoint({name}={value!r}): must be an int >= 1 (steps between saves)"
                )
        if replicas not in (0, 1):
            raise ConfigError(
                f"TieredCheckpoint(replicas={replicas!r}): 0 or 1 (one peer "
                f"copy of each node's part)"
            )
        # The tiers' saves are whole: a manager whose own blocking budget moved its save to the
        # background would return None, read here as a skipped step (no persistent save).
        # TieredCheckpoint.save stays synchronous; save_async is the non-blocking path
        # (docs/tiers.md).
        if config is not None and not isinstance(config, CheckpointConfig):
            raise ConfigError(
                f"TieredCheckpoint(config=...) must be a CheckpointConfig, "
                f"got {type(config).__name__}"
            )
        base = dataclasses.replace(
            config or CheckpointConfig(), blocking=BlockingBudget(fraction=None)
        )
        check_policy(
            base.async_save.on_busy,
            "TieredCheckpoint",
            (OnBusy.SKIP, OnBusy.WAIT, OnBusy.FAST_TIER),
        )
        on_busy = base.async_save.on_busy
        if (
            on_busy is OnBusy.FAST_TIER
        ):  # the tiers' policy; each tier's own manager skips (its save_async)
            base = dataclasses.replace(
                base, async_save=dataclasses.replace(base.async_save, on_busy=OnBusy.SKIP)
            )
        return cls(fast_every, persistent_every, replicas, on_busy, base)

    def staging(self) -> AsyncStaging | None:
        """One staging pool for both tiers (a step due on both stages the same bytes into the same
        slots; host 1x the state, not 2x), except under FAST_TIER, whose fast save runs beside a
        persistent commit reading its pool."""
        return AsyncStaging() if self.on_busy is not OnBusy.FAST_TIER else None

    def check_peers(self, hosts: list[str], peers: list[int | None]) -> None:
        """With ``replicas=1``, every rank's peer on another node (``_commit.replica.peers``)."""
        if self.replicas and peers[0] is None:
            raise ConfigError(
                f"TieredCheckpoint(replicas=1): all {len(hosts)} ranks run on host "
                f"{hosts[0]}; a peer replica must live on another node. Run on two or more "
                f"nodes, or use replicas=0"
            )


def check_restore(mode: ResumeMode, prefer: Prefer = Prefer.LATEST) -> None:
    """``TieredCheckpoint.restore``'s (and ``resolve``'s) ``mode``; ``prefer``: the tiers' health
    policy, whose ``prefer='verified'`` a restore refuses (the tier choice takes the newest step
    every rank can load)."""
    if not isinstance(mode, ResumeMode):
        raise ConfigError(f"mode must be a ResumeMode (AUTO, MUST, NEVER), got {mode!r}")
    if prefer is not Prefer.LATEST:
        raise ConfigError(
            "TieredCheckpoint.restore: "
            "CheckpointConfig(health=HealthPolicy(prefer='verified')) is not supported across "
            "tiers (the choice is the newest step every rank can load); use prefer='latest', "
            "or restore the persistent tier with a CheckpointManager(..., prefer='verified')"
        )
