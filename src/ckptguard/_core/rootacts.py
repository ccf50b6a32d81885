"""What a ``CheckpointManager`` does on its root on request, between saves: phases, holds, a guard's
target.

``adopt`` (a phase that adopts another run's chain, so a restore may continue from its step) and
``declare_phase`` (the only way to extend training or change data) append to the root's contract
phases (``_records.contract``): rank 0 writes, every rank returns the path or raises the same error.
``hold`` pins a committed step against rotation (``_records.retention``). ``committed_steps`` is the
list a hold is checked against: this rank's reading of the root now, not agreed.
``preemption_target`` is what a ``PreemptionGuard`` guards of the manager (``_core.guard``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .._agree import rank0_does
from .._disk import layout as _layout
from .._records import contract as _contract
from .._records import manifest as _manifest
from .._records import retention
from ..errors import ConfigError
from .guard import GuardTarget, recorded_save_seconds
from .root import Root
from .rootstage import RootStage

log = logging.getLogger("ckptguard")


def committed_steps(root: Root, stage: RootStage) -> list[int]:
    """Steps with a valid manifest and no newer than the tracker, ascending (an ``s3://`` root's:
    the store's)."""
    stored = stage.committed_steps()
    return (
        stored
        if stored is not None
        else _layout.committed_steps(root.path, root.naming, _manifest.read)
    )


def on_rank0(root: Root, phase: str, write: Callable[[], Path], wait: Callable[[], Any]) -> Path:
    """Rank 0 writes a root-level file; every rank returns its path or raises its error."""
    wait()
    return Path(rank0_does(root.agreement, phase, lambda: str(write())))


def adopt(root: Root, path: str | os.PathLike[str], reason: str, wait: Callable[[], Any]) -> Path:
    """A contract phase that adopts the run chain of the checkpoint at ``path``
    (``CheckpointManager.adopt``)."""
    chain = _manifest.read(Path(path)).chain_id

    def write() -> Path:
        # Adopting is an explicit act of creating a run.
        root.path.mkdir(parents=True, exist_ok=True)
        return _contract.adopt(root.path, root.config.contract, chain, reason)

    written = on_rank0(root, "adopt", write, wait)
    log.warning("ckptguard: %s adopted chain %s from %s (%s)", root.path, chain, path, reason)
    return written


def declare_phase(root: Root, reason: str, changes: Iterable[str], wait: Callable[[], Any]) -> Path:
    """Append a contract phase naming the contract items that changed
    (``CheckpointManager.declare_phase``)."""
    changed = sorted(changes)
    written = on_rank0(
        root,
        "declare_phase",
        lambda: _contract.declare(root.path, root.config.contract, reason, changed),
        wait,
    )
    log.warning("ckptguard: declared contract phase %s (%s): %s", written, reason, changed)
    return written


def hold(root: Root, step: int, reason: str, committed: list[int]) -> Path:
    """Pin ``step`` against rotation; it must be one of the ``committed`` steps."""
    if step not in committed:
        raise ConfigError(f"hold({step}): step {step} is not committed under {root.path}")
    return retention.hold(root.path, step, reason)


def preemption_target(
    root: Root, process_group: Any, save: Callable[..., Any], wait: Callable[[], Any]
) -> GuardTarget:
    """A manager as a ``PreemptionGuard`` sees it: its ``save`` and ``wait``, its commits and save
    times."""
    return GuardTarget(
        root=root.path,
        timeout_s=root.config.timeout_s,
        process_group=process_group,
        save=save,
        wait=wait,
        committed_here=lambda: list(root.committed_here),
        save_seconds=lambda step: recorded_save_seconds(root.path / root.naming.name(step)),
    )
