"""How much host memory a save may stage into, from the memory contract instead of a constant.

Contract: ``host_budget(snapshot, ray)`` returns a ``HostBudget`` whose ``bytes`` is what a
save may add to this node's memory without crossing either line that kills it:

- Ray's: ``total x RAY_memory_usage_threshold`` (or ``total - RAY_min_memory_free_bytes``),
  compared with Ray's own figure of what is used (``ray_figure``);
- the cgroup's: ``memory.max`` compared with what the kernel cannot reclaim (current minus
  the file LRU), the figure the OOM killer acts on;

minus ``margin`` (the larger of ``margin_bytes`` and ``margin_fraction`` of the total), because
the rest of the job keeps allocating while the save runs. The figures are per cgroup (or per
node without one), not per process: every rank of a node draws on the same budget, so a caller
with several ranks per node divides it (``ranks_per_node``). When the figures are not obtained
the budget is ``fallback_bytes`` and ``why`` says so; it is never a guess presented as a reading.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .host import HostProbe, HostSnapshot
from .ray import RayConfig, ray_figure

__all__ = ["HostBudget", "host_budget"]

_GiB = 1 << 30


@dataclass(frozen=True)
class HostBudget:
    """The host bytes a save may stage into on this rank, and how they were derived."""

    bytes: int
    total: int | None
    """The figure the limits apply to: cgroup memory.max, else MemTotal (per cgroup / node)."""
    ray_threshold_bytes: int | None
    ray_used: int | None
    unreclaimable: int | None
    """cgroup current minus the file LRU (what the OOM killer counts)."""
    margin: int
    ranks_per_node: int
    why: str

    def to_json(self) -> dict[str, Any]:
        return {
            "bytes": self.bytes,
            "total": self.total,
            "ray_threshold_bytes": self.ray_threshold_bytes,
            "ray_used": self.ray_used,
            "unreclaimable": self.unreclaimable,
            "margin": self.margin,
            "ranks_per_node": self.ranks_per_node,
            "why": self.why,
        }


def local_ranks() -> int:
    """Ranks sharing this node's memory: torchrun's LOCAL_WORLD_SIZE, else 1."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def host_budget(
    snapshot: HostSnapshot | None = None,
    ray: RayConfig | None = None,
    *,
    ranks_per_node: int = 1,
    margin_bytes: int = 2 * _GiB,
    margin_fraction: float = 0.05,
    fallback_bytes: int = _GiB,
) -> HostBudget:
    """The staging budget of one rank (see the module docstring)."""
    if not isinstance(ranks_per_node, int) or ranks_per_node < 1:
        raise ConfigError(
            f"host_budget: ranks_per_node must be an int >= 1, got {ranks_per_node!r}"
        )
    snap = snapshot if snapshot is not None else HostProbe().read()
    fig = ray_figure(snap, ray or RayConfig.from_env())
    total = fig.total
    margin = max(margin_bytes, int(total * margin_fraction)) if total is not None else margin_bytes
    unreclaimable = None
    if snap.current is not None and snap.reclaimable is not None:
        unreclaimable = snap.current - snap.reclaimable
    heads: list[tuple[int, str]] = []
    if fig.threshold_bytes is not None and fig.used is not None:
        heads.append(
            (
                fig.threshold_bytes - fig.used,
                f"Ray threshold {fig.threshold_bytes} B - used {fig.used} B",
            )
        )
    if snap.limit is not None and unreclaimable is not None:
        heads.append(
            (
                snap.limit - unreclaimable,
                f"memory.max {snap.limit} B - unreclaimable {unreclaimable} B",
            )
        )
    if not heads:
        reasons = (
            "; ".join(f"{k}: {v}" for k, v in {**snap.not_obtained, **fig.not_obtained}.items())
            or "no figures"
        )
        return HostBudget(
            fallback_bytes,
            total,
            fig.threshold_bytes,
            fig.used,
            unreclaimable,
            margin,
            ranks_per_node,
            f"memory figures not obtained ({reasons}); fallback {fallback_bytes} B",
        )
    head, what = min(heads)
    per_rank = max(0, head - margin) // ranks_per_node
    why = f"min of [{'; '.join(w for _, w in heads)}] = {what}, minus margin {margin} B"
    if ranks_per_node > 1:
        why += f", divided by {ranks_per_node} ranks on this node"
    return HostBudget(
        per_rank, total, fig.threshold_bytes, fig.used, unreclaimable, margin, ranks_per_node, why
    )
