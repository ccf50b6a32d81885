"""The one shape every front door has: ``Checkpointer``, a small protocol (docs/architecture.md).

``CheckpointManager`` (one state, on a directory or an ``s3://`` root: there its ``save`` returns
the step's directory in the staging root and its ``Resolution.url`` names the store's marker),
``RunCheckpoint`` (every role of a run) and ``TieredCheckpoint`` (a fast and a persistent tier)
differ in what they commit, not in how a training loop talks to them: the same calls, the same
return types. A loop, a ``PreemptionGuard`` or an integration written against ``Checkpointer`` takes
any of them. ``tests/test_architecture.py`` runs one conformance test against each door, so a door
that drifts (a ``save`` returning a dict, a missing ``resolve``) fails.

The state argument is positional: a manager and the tiers take one state dict, a run takes a dict of
each role's state dict (``{"actor": {...}, "critic": {...}}``). A run's ``record_*`` calls name the
role by keyword (``role=``, needed when this rank holds several roles).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from .._records.exportdigest import ExportFingerprint
from .._resume.resolve_local import Resolution
from .._types import JsonObject
from ..config import ResumeMode
from .guard import GuardTarget


@runtime_checkable
class PendingCommit(Protocol):
    """A ``save_async`` in flight: its commit runs in the background."""

    step: int
    """The step being committed."""

    def done(self) -> bool:
        """True once the background commit ended (committed or failed)."""
        ...

    def wait(self, timeout: float | None = None) -> Path | None:
        """Block until the commit ended; its step directory, or its error raised."""
        ...


@runtime_checkable
class Checkpointer(Protocol):
    """What a training loop calls on a front door. Every call is collective: all ranks call it in
    the same order. ``save`` returns the committed step directory (None: the step was not committed:
    the health policy skipped it, or it is on no tier's interval); ``restore`` returns the restored
    step (0: fresh)."""

    def save(
        self,
        step: int,
        state: Any,
        /,
        *,
        healthy: bool | None = None,
        loss: Any = None,
        grad_norm: Any = None,
        overwrite: bool = False,
        break_lease: bool = False,
    ) -> Path | None: ...

    def save_async(
        self,
        step: int,
        state: Any,
        /,
        *,
        healthy: bool | None = None,
        loss: Any = None,
        grad_norm: Any = None,
        overwrite: bool = False,
        break_lease: bool = False,
    ) -> PendingCommit | None: ...

    def wait(self) -> Path | None: ...

    def close(self) -> None: ...

    def resolve(self, *, mode: ResumeMode = ResumeMode.AUTO) -> Resolution: ...

    def restore(
        self, state: Any, /, *, mode: ResumeMode = ResumeMode.AUTO, break_lease: bool = False
    ) -> int: ...

    def record_step(
        self,
        step: int,
        *,
        sample_ids: Any = None,
        batch: Any = None,
        loss: Any = None,
        grad_norm: Any = None,
        **extra: Any,
    ) -> JsonObject: ...

    def record_update(self, step: int, /, *, grad_norm: float, params_changed: bool) -> None: ...

    def record_export(
        self, step: int, payload: Any, /, *, scales: Any = None
    ) -> ExportFingerprint: ...

    def record_logprobs(
        self, step: int, trainer_logprobs: Any, rollout_logprobs: Any, /
    ) -> dict[str, float]: ...

    def preemption_target(self) -> GuardTarget: ...


MEMBERS = (
    "save",
    "save_async",
    "wait",
    "close",
    "resolve",
    "restore",
    "record_step",
    "record_update",
    "record_export",
    "record_logprobs",
    "preemption_target",
)
"""The protocol's calls, in the order the conformance test checks them."""
