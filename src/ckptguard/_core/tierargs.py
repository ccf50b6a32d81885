"""``TieredCheckpoint``'s constructor arguments, checked: which root is the fast tier, and that the
persistent tier's local root is another one."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ConfigError
from .rootstage import is_store


def fast_root(root: str | os.PathLike[str] | None) -> str | os.PathLike[str]:
    """The fast tier's root: the first argument, as ``CheckpointManager(root)`` and ``RunCheckpoint(root, roles)``
    take theirs."""
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
    """The root of the tiers' one proof log: the persistent tier's local root (``persistent_local``: an
    ``s3://`` root's staging root) when there is one, else the fast root; the two tiers' roots checked apart."""
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
