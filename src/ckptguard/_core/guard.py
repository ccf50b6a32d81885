"""What a ``PreemptionGuard`` needs of a front door: a small protocol the three doors implement.

The guard saves one last step at a step boundary after a signal; it needs the root (for the
tracker and its messages), the group to agree over, the save and the wait of the front door, this
process's commits and the measured time of a save. Each front door hands those over in a
``GuardTarget`` (``preemption_target()``); the guard never looks inside a front door.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from .._records import manifest as _manifest
from .._records import runmanifest as _runmanifest
from ..errors import CheckpointError


@dataclass(frozen=True)
class GuardTarget:
    """A front door as a ``PreemptionGuard`` sees it."""

    root: Path
    """The root whose tracker a preemption save moves (a ``TieredCheckpoint``'s persistent tier, if
    any)."""
    timeout_s: float
    process_group: Any
    """The group the front door agrees over (None: the default group)."""
    save: Callable[..., Any]
    """``save(step, state, **kwargs)``: commits ``step`` on every rank; None when the step was
    unhealthy."""
    wait: Callable[[], Any]
    """Waits for a pending background save, raising its error."""
    committed_here: Callable[[], list[int]]
    """The steps this process committed, oldest first."""
    save_seconds: Callable[[int], float | None]
    """How long the save of a step took (measured, or from its manifest's cost block); None if
    unknown."""


class Preemptible(Protocol):
    """A front door a ``PreemptionGuard`` can guard: ``CheckpointManager``, ``RunCheckpoint``,
    ``TieredCheckpoint``."""

    def preemption_target(self) -> GuardTarget: ...


def recorded_save_seconds(step_dir: Path) -> float | None:
    """The ``save_seconds`` of a committed step's cost block; None when rotated out, damaged or
    absent."""
    try:
        cost = _manifest.read(step_dir).cost
    except CheckpointError:
        return None
    return None if cost is None or cost.save_seconds is None else float(cost.save_seconds)


def recorded_run_save_seconds(step_dir: Path) -> float | None:
    """A run step's save time: the sum of its roles' recorded ``save_seconds`` (the roles are
    written one after another); None when rotated out, damaged, or a role's figure is missing."""
    try:
        parts = [_manifest.read(step_dir / name).cost for name in _runmanifest.read(step_dir).roles]
    except CheckpointError:
        return None  # rotated out or damaged
    seconds = [None if c is None else c.save_seconds for c in parts]
    numbers = [float(x) for x in seconds if x is not None]
    return sum(numbers) if numbers and len(numbers) == len(seconds) else None
