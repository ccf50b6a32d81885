"""What a ``CheckpointManager``'s root holds beyond its local directory: its ``RootStage``
(docs/objectstore.md).

A manager always commits into a local root with the one protocol (``_commit``). A filesystem root is
that directory and nothing more (``_core.root.LocalStage``, beside the root's own bookkeeping). An
``s3://bucket/prefix`` root is an object store whose local root is a staging directory
(``StorageOptions.object_staging``): every step committed there is then published to the store, a
restore resolves on the store and downloads the step into the staging root first
(``_core.storestage.StoreStage``). The manager calls its stage at the same points whichever it is
(before a save, after each commit, before a restore, to resolve and to fetch, at close), and so do
the tiers on their persistent tier: no caller asks which kind of root it has.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Protocol

from .._context import Actions
from .._disk import layout as _layout
from .._records.trust import Prefer
from .._resume.resolve_local import Resolution
from ..config import CheckpointConfig, ResumeMode
from ..errors import ConfigError
from ..storage.s3 import StoreURL
from .root import LocalStage

log = logging.getLogger("ckptguard")

STORE_SCHEME = "s3://"


class RootStage(Protocol):
    """What a manager (and the tiers, on their persistent tier) call beside the local root's own
    protocol."""

    url: str
    """The root as the caller named it: a directory, or ``s3://bucket/prefix``."""

    def before_save(self, step: int, actions: Actions) -> Actions:
        """The save's checks beyond the local root (collective); the actions the local commit runs
        with."""
        ...

    def published(self, step: int, path: Path) -> None:
        """What follows the local commit of ``step`` at ``path`` before the save counts as done
        (collective)."""
        ...

    def hold(self, break_lease: bool = False) -> None:
        """Rank 0's part (not collective): create the root (tracker 0) if absent, take or renew its
        write lease."""
        ...

    def before_restore(self, break_lease: bool = False) -> None:
        """The restore's checks beyond the local root (collective)."""
        ...

    def resolve(self, mode: ResumeMode, prefer: Prefer) -> Resolution | None:
        """The step a restore loads, agreed (collective); None: the local root's own resolution
        decides."""
        ...

    def bring(self, step: int) -> Path:
        """The committed ``step`` as a directory of the local root (collective)."""
        ...

    def committed_steps(self) -> list[int] | None:
        """The root's committed steps (this process's reads); None: the local root's."""
        ...

    def tracker_step(self) -> int | None:
        """The committed step a restore would load (this process's reads; 0: none); None: the local
        root's."""
        ...

    def marker_url(self, step: int) -> str | None:
        """Where ``step`` is committed when that is not the local root (a store's marker); None: it
        is."""
        ...

    def close(self) -> None: ...


def is_store(root: str | os.PathLike[str]) -> bool:
    """Whether ``root`` names an object-store root (``s3://bucket/prefix``, a string); a root that
    only reads like one (``s3:/bkt/x``, ``S3://...``, a Path of the URL) is refused
    (``StoreURL.lookalike``)."""
    why = StoreURL.lookalike(root)
    if why is not None:
        raise ConfigError(f"checkpoint root {why}")
    return isinstance(root, str) and root.startswith(STORE_SCHEME)


def local_root(root: str | os.PathLike[str], config: CheckpointConfig) -> Path:
    """The directory a manager of ``root`` commits into: ``root`` itself, or for an ``s3://`` root
    its staging root (``StorageOptions.object_staging``; None:
    ``$TMPDIR/ckptguard-staging-<uid>/<endpoint>/<bucket>/<prefix>``, node-local, a directory per
    user and per store endpoint)."""
    if not is_store(root):
        return Path(root).absolute()
    url = StoreURL.parse(str(root))
    if config.storage.object_staging is not None:
        return Path(config.storage.object_staging).absolute()
    store = config.storage.object_store
    endpoint = (store.endpoint_url if store is not None else None) or "default-endpoint"
    where = hashlib.sha256(str(endpoint).encode()).hexdigest()[:12]
    top = Path(tempfile.gettempdir()) / f"ckptguard-staging-{os.getuid()}"
    return (top / where / url.bucket / url.prefix).absolute()


def open_stage(
    root: str | os.PathLike[str],
    config: CheckpointConfig,
    *,
    process_group: Any | None,
    namespace: str,
) -> tuple[Path, CheckpointConfig, RootStage]:
    """The local root a manager of ``root`` commits into, the config its local protocol runs with
    (an ``s3://`` root's staging keeps its newest step; the store rotates by ``config.retention``),
    and its stage. ``namespace``: the manager's agreement name (the store's rounds agree under names
    of their own)."""
    local = local_root(root, config)
    if not is_store(root):
        return (
            local,
            config,
            LocalStage(
                local, _layout.StepNaming(config.storage.dir_template), config.storage.lease_ttl_s
            ),
        )
    try:
        from .storestage import StoreStage  # optional: boto3, the s3 extra
    except (
        ImportError
    ) as exc:  # without it the first save would fail deep in an upload, after training
        raise ConfigError(
            f"{root}: an object-store root needs the s3 extra ({exc}); pip install 'ckptguard[s3]'"
        ) from exc
    stage = StoreStage(str(root), local, config, process_group=process_group, namespace=namespace)
    return local, stage.local_config, stage
