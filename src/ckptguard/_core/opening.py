"""What a ``CheckpointManager``'s constructor opens before its bookkeeping: its root, config and
``Context``.

``checked_config`` refuses a config that is not a ``CheckpointConfig`` or whose ``on_busy`` a
manager does not take, before the manager is numbered. ``open_context`` opens the root's stage
(``_core.rootstage.open_stage``: an ``s3://`` root commits into a staging root), makes the agreement
its ranks decide over (namespaced by the manager's creation number, alike on every rank) and, with
several ranks, the dedicated gloo group DCP's collectives run on with the manager's timeout. The
manager builds its ``Root`` and its background commits on what it returns.
"""

from __future__ import annotations

import datetime as _dt
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from .._commit.busy import check_policy
from .._context import Context
from .._disk import layout as _layout
from .._dist import make_agreement
from .._state.expert import ExpertParallel
from ..config import CheckpointConfig, OnBusy
from ..errors import ConfigError
from ..storage.base import Storage
from ..storage.streaming import StreamingStorage
from .rootstage import RootStage, open_stage


def checked_config(config: CheckpointConfig | None) -> CheckpointConfig:
    """``config`` (None: the defaults), refused unless it is a ``CheckpointConfig`` with a manager's
    ``on_busy``."""
    base = config or CheckpointConfig()
    if not isinstance(base, CheckpointConfig):
        raise ConfigError(f"config must be a CheckpointConfig, got {type(base).__name__}")
    check_policy(
        base.async_save.on_busy, "CheckpointManager", (OnBusy.SKIP, OnBusy.WAIT, OnBusy.COALESCE)
    )
    return base


def dcp_group(process_group: Any | None, timeout_s: float) -> Any | None:
    """The group DCP's collectives run on: None with one process (no ``torch.distributed``)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    ranks = (
        dist.get_process_group_ranks(process_group)
        if process_group
        else list(range(dist.get_world_size()))
    )
    # DCP's own collectives get our timeout too: a dedicated gloo group, created by
    # the group's members only, so a stalled peer fails this save within timeout_s.
    return dist.new_group(
        ranks,
        backend="gloo",
        timeout=_dt.timedelta(seconds=timeout_s),
        use_local_synchronization=True,
    )


def open_context(
    root: str | os.PathLike[str],
    config: CheckpointConfig,
    process_group: Any | None,
    storage: Storage | None,
    expert_parallel: ExpertParallel | None,
    namespace: str,
) -> tuple[Path, CheckpointConfig, RootStage, Context]:
    """The local root, the config, the root's stage and the ``Context`` of a manager whose agreement
    keys are named ``namespace`` (``config``: as ``checked_config`` returned it)."""
    # Its local root and stage: an s3:// root commits into a staging root, then publishes
    # (_core.rootstage).
    local, opened, stage = open_stage(
        root, config, process_group=process_group, namespace=namespace
    )
    agreement = make_agreement(process_group, timeout_s=opened.timeout_s, namespace=namespace)
    group = dcp_group(process_group, opened.timeout_s)
    naming = _layout.StepNaming(opened.storage.dir_template)
    ctx = Context.of(
        local, opened, naming, agreement, storage or StreamingStorage(), group, expert_parallel
    )
    return local, opened, stage, ctx
