"""What a front door that composes a ``CheckpointManager`` hands to its constructor
(docs/architecture.md).

A ``TieredCheckpoint`` runs two managers as one door: both tiers' proof records go to one log
(tagged with the tier), both tiers' health checks read the same step metrics, and its background
thread commits both tiers' staged saves. Megatron's async save starts the commit only once
Megatron's own writer finished. Neither reaches into the manager: they pass ``Parts`` in, holding
the sink and the health log they share, and the manager binds its staged-commit calls into
``Parts.commits``. Only a door that made the manager with its ``Parts`` can stage a commit apart
from ``save_async``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._commit.busy import BusyRound
from .._commit.pending import AsyncStaging
from .._commit.savehandle import PendingSave
from .._context import NO_ACTIONS, Actions, Context
from .._records.trust import HealthLog
from .._types import StateDict
from ..errors import ConfigError
from ..storage._staging import Fence
from .root import ProofSink
from .rootstage import RootStage

Staged = tuple[Callable[[], Path], Fence, float]
"""A staged commit: the background commit to run, the fence of its copies, when the save began."""


class CommitHooks:
    """A manager's staged-commit calls, bound by the manager made with these ``Parts``."""

    def __init__(self) -> None:
        self._stage: Callable[..., Staged | None] | None = None
        self._start: Callable[..., PendingSave] | None = None
        self._cleanup: Callable[[int], None] | None = None
        self._resumed: Callable[[int], None] | None = None

    def bind(
        self,
        stage: Callable[..., Staged | None],
        start: Callable[..., PendingSave],
        cleanup: Callable[[int], None],
        resumed: Callable[[int], None],
    ) -> None:
        if (
            self._stage is not None
        ):  # two managers behind one hook: the door would drive the wrong root
            raise ConfigError(
                "Parts(...) serve one CheckpointManager: give each manager its own Parts"
            )
        self._stage, self._start, self._cleanup, self._resumed = stage, start, cleanup, resumed

    def stage(
        self,
        step: int,
        state: StateDict,
        healthy: bool | None,
        loss: Any,
        grad_norm: Any,
        actions: Actions = NO_ACTIONS,
        *,
        busy: BusyRound | None = None,
        measure: bool = False,
    ) -> Staged | None:
        """``save_async``'s part in the caller's thread (health agreement, snapshot, copies queued):
        the background commit, its fence, its start; None: the step is unhealthy (on every rank)."""
        staged: Staged | None = self._bound(self._stage)(
            step, state, healthy, loss, grad_norm, actions, busy=busy, measure=measure
        )
        return staged

    def start(self, step: int, staged: Staged, resumed: float) -> PendingSave:
        """Start in the background the commit ``stage`` prepared (``resumed``: when the caller got
        control back)."""
        pending: PendingSave = self._bound(self._start)(step, staged, resumed)
        return pending

    def cleanup(self, step: int) -> None:
        """Retention and proof pruning after the commit of ``step``."""
        self._bound(self._cleanup)(step)

    def resumed(self, step: int) -> None:
        """This process's training goes on from ``step``, restored through another manager of the
        same run (the tiers' other tier): trust vouches for steps up to it, retention keeps it,
        later commits start a new trajectory there."""
        self._bound(self._resumed)(step)

    @staticmethod
    def _bound(call: Any) -> Any:
        if call is None:
            raise ConfigError(
                "these Parts were not given to a CheckpointManager "
                "(CheckpointManager(..., parts=...))"
            )
        return call


@dataclass
class Parts:
    """The parts a composing door shares with a manager it makes (``CheckpointManager(root,
    parts=...)``)."""

    proof: ProofSink | None = None
    """Where the manager's proof records go (the tiers: one log, tagged by tier); None: its own,
    ROOT/proof."""
    health: HealthLog | None = None
    """The step metrics its health checks read (the tiers: one, fed by either tier's record_step);
    None: its own."""
    staging: AsyncStaging | None = None
    """The host staging set the manager's ``save_async`` copies into (the tiers: one pool for both
    tiers, not a pool per tier); None: its own."""
    commits: CommitHooks = field(default_factory=CommitHooks)
    """Bound by the manager: its staged-commit calls, for the door that made it."""
    context: Context | None = None
    """Bound by the manager: the context of its root (the tiers' restore and replica push run on
    it)."""
    root_stage: RootStage | None = None
    """Bound by the manager: what its root holds beyond the local directory (the tiers' persistent
    lease, restore checks and fetch: ``_core.rootstage``)."""

    def bind(
        self,
        context: Context,
        root_stage: RootStage,
        stage: Callable[..., Staged | None],
        start: Callable[..., PendingSave],
        cleanup: Callable[[int], None],
        resumed: Callable[[int], None],
    ) -> None:
        """The manager made with these parts hands over its context, its root's stage and its
        staged-commit calls."""
        self.commits.bind(stage, start, cleanup, resumed)
        self.context, self.root_stage = context, root_stage

    def bound_stage(self) -> RootStage:
        """The root stage of the manager these parts were given to."""
        if self.root_stage is None:
            raise ConfigError(
                "these Parts were not given to a CheckpointManager "
                "(CheckpointManager(..., parts=...))"
            )
        return self.root_stage

    def bound(self) -> Context:
        """The context of the manager these parts were given to."""
        if self.context is None:
            raise ConfigError(
                "these Parts were not given to a CheckpointManager "
                "(CheckpointManager(..., parts=...))"
            )
        return self.context
