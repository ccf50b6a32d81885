"""The shared-root publisher: one root every rank sees (a shared filesystem, or one host's disk).

Rank 0 checks every rank's reported files where it publishes (sizes; checksums when
``publish_checksums=True``), writes the manifest (the commit marker), renames the temp directory
to the step name, fsyncs the root and moves the tracker: the commit point.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .. import _faults
from .._context import Context
from .messages import Prepared, RankReport
from .publish import confirm_and_publish
from .snapshot import Snapshot
from .stepdir import publish_dir


class SharedRootPublisher:
    """``Publisher`` of a root every rank sees."""

    def run(
        self, ctx: Context, snap: Snapshot, prep: Prepared, tmp: Path, write: Callable[[], RankReport]
    ) -> Path:
        ctx.node_publisher = False

        def rename_and_move_tracker() -> None:
            _faults.reached("commit.before_rename")
            publish_dir(ctx, snap.step, tmp, snap.actions)

        confirm_and_publish(ctx, snap, prep, tmp, write, rename_and_move_tracker)
        return ctx.root / ctx.naming.name(snap.step)
