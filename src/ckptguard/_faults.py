"""Named points in the commit protocol where tests inject crashes.

Library code calls ``reached(point)``; nothing happens unless a test registered a
hook for that point (typically one that SIGKILLs its own process). The points:

- ``storage.data_written``: this rank's DCP data files are written, ``.metadata`` is not
- ``commit.before_manifest``: every rank reported success; no manifest yet
- ``commit.manifest_tmp_written``: manifest bytes are in a temp file, not renamed
- ``commit.before_rename``: manifest in place inside the temp directory
- ``commit.before_tracker``: step directory published, tracker not yet moved
- ``transfer.file_copied``: ``ckptguard transfer`` copied one file of several
- ``transfer.before_tracker``: the transferred step directory is renamed in, the tracker not yet set
"""

from __future__ import annotations

from collections.abc import Callable

from .errors import ConfigError

COMMIT_POINTS = (
    "storage.data_written",
    "commit.before_manifest",
    "commit.manifest_tmp_written",
    "commit.before_rename",
    "commit.before_tracker",
)
POINTS = (*COMMIT_POINTS, "transfer.file_copied", "transfer.before_tracker")

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
