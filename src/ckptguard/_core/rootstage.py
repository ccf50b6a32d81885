"""What a ``CheckpointManager``'s root holds beyond its local directory: its ``RootStage`` (docs/objectstore.md).

A manager always commits into a local root with the one protocol (``_commit``). A filesystem root is
that directory and nothing more (``_core.root.LocalStage``, beside the root's own bookkeeping). An
``s3://bucket/prefix`` root is an object store whose local root is a staging directory
(``StorageOptions.object_staging``): every step committed there is then published to the store, a
restore resolves on the store and downloads the step into the staging root first
(``_core.storestage.StoreStage``). The manager calls its stage at the same points whichever it is
(before a save, after each commit, before a restore, to resolve and to fetch, at close), and so do the
tiers on their persistent tier: no caller asks which kind of root it has.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import stat
import tempfile
from pathlib import Path
from typing import Any, Protocol

from .._context import Actions
from .._disk import layout as _layout
from .._records.trust import Prefer
from .._resume.resolve_local import Resolution
from .._types import JsonObject
from ..config import CheckpointConfig, ResumeMode
from ..errors import ConfigError
from ..storage.s3 import StoreURL
from .root import LocalStage

log = logging.getLogger("ckptguard")

STORE_SCHEME = "s3://"


class RootStage(Protocol):
    """What a manager (and the tiers, on their persistent tier) call beside the local root's own protocol."""

    url: str
    """The root as the caller named it: a directory, or ``s3://bucket/prefix``."""

    def before_save(self, step: int, actions: Actions) -> Actions:
        """The save's checks beyond the local root (collective); the actions the local commit runs with."""
        ...

    def published(self, step: int, path: Path) -> None:
        """What follows the local commit of ``step`` at ``path`` before the save counts as done (collective)."""
        ...

    def hold(self, break_lease: bool = False) -> None:
        """Rank 0's part (not collective): create the root (tracker 0) if absent, take or renew its write lease."""
        ...

    def before_restore(self, break_lease: bool = False) -> None:
        """The restore's checks beyond the local root (collective)."""
        ...

    def resolve(self, mode: ResumeMode, prefer: Prefer) -> Resolution | None:
        """The step a restore loads, agreed (collective); None: the local root's own resolution decides."""
        ...

    def bring(self, step: int) -> Path:
        """The committed ``step`` as a directory of the local root (collective)."""
        ...

    def committed_steps(self) -> list[int] | None:
        """The root's committed steps (this process's reads); None: the local root's."""
        ...

    def tracker_step(self) -> int | None:
        """The committed step a restore would load (this process's reads; 0: none); None: the local root's."""
        ...

    def marker_url(self, step: int) -> str | None:
        """Where ``step`` is committed when that is not the local root (a store's marker); None: it is."""
        ...

    def close(self) -> None: ...


def is_store(root: str | os.PathLike[str]) -> bool:
    """Whether ``root`` names an object-store root (``s3://bucket/prefix``, a string); a root that only reads
    like one (``s3:/bkt/x``, ``S3://...``, a Path of the URL) is refused (``StoreURL.lookalike``)."""
    why = StoreURL.lookalike(root)
    if why is not None:
        raise ConfigError(f"checkpoint root {why}")
    return isinstance(root, str) and root.startswith(STORE_SCHEME)


STAGING_RECORD = "ckptguard-staging.json"
"""Which store a staging root stages (``{"store": url, "endpoint": endpoint_url}``), written when it is claimed."""


def _store_id(root: str, config: CheckpointConfig) -> JsonObject:
    endpoint = config.storage.object_store.endpoint_url if config.storage.object_store else None
    return {"store": str(StoreURL.parse(root)), "endpoint": endpoint}


def local_root(root: str | os.PathLike[str], config: CheckpointConfig) -> Path:
    """The directory a manager of ``root`` commits into: ``root`` itself, or for an ``s3://`` root its staging
    root (``StorageOptions.object_staging``; None: ``$TMPDIR/ckptguard-staging-<uid>/<endpoint>/<bucket>/<prefix>``,
    node-local, a directory per user and per store endpoint)."""
    if not is_store(root):
        return Path(root).absolute()
    url = StoreURL.parse(str(root))
    if config.storage.object_staging is not None:
        return Path(config.storage.object_staging).absolute()
    endpoint = _store_id(str(root), config)["endpoint"] or "default-endpoint"
    where = hashlib.sha256(str(endpoint).encode()).hexdigest()[:12]
    top = Path(tempfile.gettempdir()) / f"ckptguard-staging-{os.getuid()}"
    return (top / where / url.bucket / url.prefix).absolute()


def claim_staging(local: Path, root: str, config: CheckpointConfig) -> None:
    """Make ``local`` the staging root of the store ``root``, or refuse it: the staging keeps only its newest
    step (``KeepLast(1)``), so a directory holding anything else (an existing checkpoint root, another store's
    staging, a link planted at the default path) would lose it. Its record (``STAGING_RECORD``) names the store
    and endpoint; it is created with O_EXCL-like ``link`` (ranks of one node may claim at once)."""
    mine = _store_id(root, config)
    if (
        config.storage.object_staging is None
    ):  # the default path: this user's directory, never a planted link
        top = Path(tempfile.gettempdir()) / f"ckptguard-staging-{os.getuid()}"
        top.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(top)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            raise ConfigError(
                f"staging root of {root}: {top} is not a directory of this user (uid {os.getuid()}):"
                " set StorageOptions(object_staging=...) to a directory of yours"
            )
    if local.is_symlink():
        raise ConfigError(
            f"staging root of {root}: {local} is a symbolic link; ckptguard never writes through a "
            "link (it could reach another root): set StorageOptions(object_staging=...) to a directory"
        )
    local.mkdir(parents=True, exist_ok=True)
    record = local / STAGING_RECORD
    for _ in range(50):
        if record.exists():
            break
        others = [e for e in os.listdir(local) if e != STAGING_RECORD and ".tmp-" not in e]
        if others:
            raise ConfigError(
                f"staging root of {root}: {local} already holds {sorted(others)[:5]} and is not a staging root "
                f"(no {STAGING_RECORD}); a staging root keeps only its newest step, so an existing checkpoint "
                "root there would lose its steps: set StorageOptions(object_staging=...) to an empty or new "
                "directory"
            )
        tmp = local / f"{STAGING_RECORD}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.write_text(json.dumps(mine, sort_keys=True) + "\n")
        try:
            os.link(
                tmp, record
            )  # fails if another rank of this node claimed it first: its record is compared
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    found = json.loads(_layout.read_small(record, what="staging record"))
    if found != mine:
        raise ConfigError(
            f"staging root of {root}: {local} stages {found.get('store')} (endpoint {found.get('endpoint')}), not "
            f"{mine['store']} (endpoint {mine['endpoint']}): two stores must not share a staging root (its steps "
            "and proof records would mix). Set StorageOptions(object_staging=...) to a directory of this root's; "
            "if it is the same store under another endpoint, the staging root is scratch (the store holds every "
            "committed step): delete it"
        )


def open_stage(
    root: str | os.PathLike[str],
    config: CheckpointConfig,
    *,
    process_group: Any | None,
    namespace: str,
) -> tuple[Path, CheckpointConfig, RootStage]:
    """The local root a manager of ``root`` commits into, the config its local protocol runs with (an
    ``s3://`` root's staging keeps its newest step; the store rotates by ``config.retention``), and its stage.
    ``namespace``: the manager's agreement name (the store's rounds agree under names of their own)."""
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
