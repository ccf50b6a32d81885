"""The run-role publisher: one role's part of a run step (``ckptguard.run``).

The role's ranks write their part into ``<run temp>/<role>/`` and rank 0 of the role writes the
part's manifest, as a single-role step would; nothing is renamed and no tracker moves: the run
commit publishes the whole step once every role on every rank confirmed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .._context import Context
from .messages import Prepared, RankReport
from .publish import confirm_and_publish
from .snapshot import Snapshot


class RolePartPublisher:
    """``Publisher`` of one role's part: the marker of the part, then nothing (the run publishes)."""

    def run(
        self, ctx: Context, snap: Snapshot, prep: Prepared, tmp: Path, write: Callable[[], RankReport]
    ) -> Path:
        ctx.node_publisher = False
        confirm_and_publish(ctx, snap, prep, tmp, write, lambda: None)
        return tmp
