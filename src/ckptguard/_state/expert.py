"""Expert-parallel state that survives DCP: per-EP-rank keys.

Contract: under expert parallelism, ranks of different EP groups hold different experts under the
same FQN, and with FSDP inside each EP group even the same chunk offsets. DCP stores one chunk per
(key, offset), so after a restore one EP group silently holds another's experts (measured on torch
2.13, and the EP4 + FSDP2 key rule of expert-parallel checkpoints). Keys that match ``patterns`` get
the EP rank appended (``<key>#ep<r>``), so every EP group's experts (and their optimizer state) are
stored and restored separately. The manifest records the EP size and each rank's EP rank; restoring
with another EP size raises TopologyMismatchError (no reshard of experts across EP sizes is
implemented).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from ..errors import ConfigError

EP_SUFFIX = "#ep"


@dataclass(frozen=True)
class ExpertParallel:
    """Which state keys are per expert-parallel rank, and the EP process group.

    A runtime object (it holds a process group): pass it to ``CheckpointManager``.
    """

    group: Any = None
    """The process group whose ranks hold different experts (the EP dimension)."""
    patterns: tuple[str, ...] = (r"(^|\.)experts\.",)
    """Regexes searched in each flat state key (FQN-based); a match marks an expert tensor."""
    _compiled: tuple[re.Pattern[str], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.patterns:
            raise ConfigError(
                "ExpertParallel.patterns must name at least one key pattern, e.g. r'\\.experts\\.'"
            )
        try:
            compiled = tuple(re.compile(p) for p in self.patterns)
        except re.error as exc:
            raise ConfigError(f"ExpertParallel.patterns: {exc}") from None
        object.__setattr__(self, "_compiled", compiled)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if self.group is not None else 0

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group) if self.group is not None else 1

    def is_expert(self, key: str) -> bool:
        return any(p.search(key) for p in self._compiled)

    def key(self, key: str) -> str:
        """The DCP key for a flat state key on this rank."""
        return f"{key}{EP_SUFFIX}{self.rank}" if self.is_expert(key) else key
