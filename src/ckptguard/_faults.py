"""Named points in the commit protocol where tests inject crashes.

Library code calls ``reached(point)``; nothing happens unless a test registered a
hook for that point (typically one that SIGKILLs its own process). The points:

- ``storage.data_written``: this rank's DCP data files are written, ``.metadata`` is not
- ``commit.before_manifest``: every rank reported success; no manifest yet
- ``commit.manifest_tmp_written``: manifest bytes are in a temp file, not renamed
- ``commit.before_rename``: manifest in place inside the temp directory
- ``commit.before_tracker``: step directory published, tracker not yet moved
- ``run.role_written``: one role's part of a run step is written and confirmed by the role's ranks
  (its manifest is in the run's temp directory); reached on every rank of the role, before the next
  role
- ``run.before_manifest``: every role on every rank confirmed; the run manifest is not written yet
- ``commit.rank_written``: this rank wrote all its files and is about to report them
- ``node.files_verified``: (node-local roots) this node's publishing rank checked its node's files,
  the replicated copies included; no node manifest yet
- ``node.confirmed``: this node's node manifest is written; not every node has confirmed
- ``node.before_rename``: every node confirmed; the global manifest is in this node's temp directory
- ``node.before_tracker``: this node's step directory is published, its tracker not yet moved
- ``node.after_tracker``: this node's tracker is moved; other nodes' may not be
- ``transfer.file_copied``: ``ckptguard transfer`` copied one file of several
- ``transfer.before_tracker``: the transferred step directory is renamed in, the tracker not yet set
- ``store.part_uploaded``: (object stores) one part or small file of a step's upload is in; others
  may not be
- ``store.before_marker``: (object stores) every file of the attempt is uploaded; no commit marker
  yet
- ``store.before_tracker``: (object stores) the commit marker is created; the tracker not yet moved
- ``transfer.before_rename``: ``ckptguard transfer s3://... DEST`` downloaded and checked the step
  into its temp directory; not renamed to the step name yet
- ``export.shard_written``: ``ckptguard export`` wrote and fsynced one safetensors file, not yet
  read back
- ``export.before_manifest``: every export file is written and checked; the export manifest is not
  written

``ckptguard rehearse`` sets ``PAUSE_ENV`` for one launch of the user's command: the first
save of each process then stops at ``storage.data_written`` (mid-write, nothing committed),
leaves a marker file and waits there for rehearse to SIGKILL the whole process tree.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from .errors import ConfigError

COMMIT_POINTS = (
    "storage.data_written",
    "commit.before_manifest",
    "commit.manifest_tmp_written",
    "commit.before_rename",
    "commit.before_tracker",
)
RUN_POINTS = ("run.role_written", "run.before_manifest")
NODE_POINTS = (
    "node.files_verified",
    "node.confirmed",
    "node.before_rename",
    "node.before_tracker",
    "node.after_tracker",
)
"""The points of per-node publish (node-local roots), reached by each node's publishing rank."""
STORE_POINTS = ("store.part_uploaded", "store.before_marker", "store.before_tracker")
"""The points of an object-store commit (``ckptguard.storage.s3``)."""
POINTS = (
    *COMMIT_POINTS,
    "commit.rank_written",
    *NODE_POINTS,
    *RUN_POINTS,
    "transfer.file_copied",
    "transfer.before_tracker",
    *STORE_POINTS,
    "transfer.before_rename",
    "export.shard_written",
    "export.before_manifest",
)

_hooks: dict[str, Callable[[], None]] = {}


def set_hook(point: str, hook: Callable[[], None] | None) -> None:
    if point not in POINTS:
        raise ConfigError(f"unknown fault point {point!r}; known: {', '.join(POINTS)}")
    if hook is None:
        _hooks.pop(point, None)
    else:
        _hooks[point] = hook


def reached(point: str) -> None:
    hook = _hooks.get(point)
    if hook is not None:
        hook()


PAUSE_ENV = "CKPTGUARD_REHEARSE_PAUSE_DIR"
PAUSE_POINT = "storage.data_written"


def arm_pause_from_env(rank: int) -> None:
    """Pause this process's first save mid-write when ``ckptguard rehearse`` asked for it
    (``PAUSE_ENV``)."""
    where = os.environ.get(PAUSE_ENV)
    if not where or PAUSE_POINT in _hooks:
        return
    logging.getLogger("ckptguard").warning(
        "ckptguard: %s is set: the first save of this process stops mid-write "
        "for `ckptguard rehearse`",
        PAUSE_ENV,
    )

    def pause() -> None:
        set_hook(PAUSE_POINT, None)
        Path(where, f"paused_rank_{rank:05d}").write_text(str(os.getpid()))
        deadline = time.monotonic() + 3600.0
        while Path(where).is_dir() and time.monotonic() < deadline:
            time.sleep(0.2)
        # rehearse is gone without killing us: end as its kill would have, never finish the save
        os.kill(os.getpid(), signal.SIGKILL)

    set_hook(PAUSE_POINT, pause)
