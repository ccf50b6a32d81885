"""``TieredCheckpoint``'s constructor arguments, checked: which root is the fast tier, and whether the
persistent tier is an object store."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import ConfigError


def fast_root(root: str | os.PathLike[str] | None) -> str | os.PathLike[str]:
    """The fast tier's root: the first argument, as ``CheckpointManager(root)`` and ``RunCheckpoint(root, roles)``
    take theirs."""
    if root is None:
        raise ConfigError("TieredCheckpoint(root, persistent=...): give the fast tier's root (node-local storage, the "
                          "same path on every node) as the first argument")
    return root


def remote_tier(persistent: Any, staging: Any, options: Any, fast: Any) -> bool:
    """True for an object-store persistent tier (``s3://``); its arguments checked."""
    remote = isinstance(persistent, str) and persistent.startswith("s3://")
    if not remote and (staging is not None or options is not None):
        raise ConfigError("TieredCheckpoint(persistent_staging=, persistent_options=) go with an object-store "
                          f"persistent tier (persistent='s3://bucket/prefix'), not persistent={persistent!r}")
    if remote and staging is None:
        raise ConfigError(
            f"TieredCheckpoint(persistent={persistent!r}): give persistent_staging=<a local directory> (node-local or "
            "shared, the same path on every node, room for one step), where each persistent step is committed "
            "before its upload and downloaded before a restore from the store (docs/objectstore.md)")
    if remote and Path(staging).absolute() == Path(fast).absolute():
        raise ConfigError(f"TieredCheckpoint: persistent_staging is the fast root {fast}; give its own directory")
    return remote
