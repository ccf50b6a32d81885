"""The persistent tier of a ``TieredCheckpoint`` as the tiers drive it, whatever holds it (docs/tiers.md).

A persistent tier is a ``CheckpointManager`` on its root; where that root is an object store, the
manager commits into a staging root and each committed step is then published to the store
(``ckptguard.objectstore.ObjectStoreCheckpoint``). The tiers never ask which: they call the
``PersistentTier`` protocol, which ``FilesystemTier`` (here) and ``ObjectStoreCheckpoint`` implement,
so the store's extra steps (its lease, the publish after the commit, a staging copy the store never
committed, the download before a restore) live in the store's door and nowhere in ``tiers.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from .._disk import layout as _layout
from .._disk import lease as _lease
from ..config import CheckpointConfig

log = logging.getLogger("ckptguard")


class PersistentTier(Protocol):
    """What the tiers call on their persistent tier, beside its manager's own save and restore."""

    def hold(self, break_lease: bool = False) -> None:
        """Rank 0's part (not collective): create the root (tracker 0) if absent, take or renew its write lease."""
        ...

    def replaces(self, step: int) -> bool:
        """Whether the manager's save of ``step`` must replace a step it holds (collective)."""
        ...

    def then_publish(self, step: int, run: Callable[[], Path]) -> Callable[[], Path]:
        """The background commit of ``step`` followed by whatever makes it durable beyond the manager's root."""
        ...

    def published(self, step: int, path: Path) -> None:
        """What follows the manager's commit of ``step`` at ``path`` before the save returns (collective)."""
        ...

    def before_restore(self, break_lease: bool = False) -> None:
        """The restore's checks beyond the manager's root (collective)."""
        ...

    def bring(self, step: int) -> Path:
        """The committed ``step`` as a directory the manager restores (collective)."""
        ...

    def close(self) -> None: ...


class _Rooted(Protocol):
    root: Path
    config: CheckpointConfig

    def close(self) -> None: ...


class FilesystemTier:
    """A persistent tier on a filesystem root: its manager's commit is the whole story."""

    def __init__(self, manager: _Rooted, naming: _layout.StepNaming) -> None:
        self.manager = manager
        self.naming = naming

    def hold(self, break_lease: bool = False) -> None:
        root = self.manager.root
        created = not root.exists()
        if created:
            root.mkdir(parents=True)
        note = _lease.acquire(root, ttl_s=self.manager.config.storage.lease_ttl_s, override=break_lease)
        if note:
            log.warning("ckptguard: %s: %s", root, note)
        if created:
            _layout.write_tracker(root, 0)

    def replaces(self, step: int) -> bool:
        return False  # a committed step of a filesystem root is replaced only when the caller asks

    def then_publish(self, step: int, run: Callable[[], Path]) -> Callable[[], Path]:
        return run

    def published(self, step: int, path: Path) -> None:
        return None

    def before_restore(self, break_lease: bool = False) -> None:
        return None  # the tiers check every root's lease themselves

    def bring(self, step: int) -> Path:
        return self.manager.root / self.naming.name(step)

    def close(self) -> None:
        self.manager.close()
