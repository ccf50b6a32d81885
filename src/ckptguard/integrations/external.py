"""Files written by someone else, committed inside the same atomic step directory.

Contract: ``ExternalFiles(inner, writers)`` is a ``Storage``. ``write`` first lets ``inner`` write
the tensor state, then calls each writer with its own subdirectory of the in-flight step
directory (``<tmp>/<name>/``) and returns every file found there with its size and xxh3, so
the manifest lists and checksums them. They are published by the same rename as the rest of
the step, and a failing writer fails the save on every rank, with the tracker unmoved. A
writer must write only below the directory it is given.

A writer may return a callable: once every rank's writers are done, rank 0 calls it before
listing the files. Frameworks whose ranks all write into one staging folder of their own
naming (HF's ``checkpoint-N``) use it to move that folder into place in one rename.

Under a process group the writers run on every rank (verl's and DeepSpeed's own saves are
collective), then the ranks meet at a barrier and rank 0 alone lists the files: each file is
then listed once, whoever wrote it. ``read`` delegates to ``inner``; loading the external
files is the caller's, from ``resolve(...).path / name`` after ``restore`` verified the step.
"""

from __future__ import annotations

import datetime as _dt
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata

from .._disk.digest import file_digest
from ..errors import ConfigError
from ..storage.base import Storage, StorageContext, WrittenFile

__all__ = ["ExternalFiles", "Writer"]

Writer = Callable[[Path], Callable[[], None] | None]
"""Called with the directory to write into (it exists and is empty); may return a finisher."""


class ExternalFiles:
    """A ``Storage`` that adds the files of named writers to the step being committed."""

    foreground_only = True
    """Its writers are a framework's own (collective) save: a blocking budget never moves it to a
    background commit (``OverBudget.BACKGROUND`` acts as ``WARN``)."""

    def __init__(
        self, inner: Storage, writers: Mapping[str, Writer], *, barrier_timeout_s: float = 600.0
    ) -> None:
        for name in writers:
            if (
                not name
                or "/" in name
                or name.startswith(".")
                or name in ("state", "manifest.json")
            ):
                raise ConfigError(
                    f"ExternalFiles: writer name {name!r} must be a plain directory name other "
                    f"than 'state' (e.g. 'actor', 'critic')"
                )
        self.inner = inner
        self.writers = dict(writers)
        self.barrier_timeout_s = barrier_timeout_s

    def write(
        self, state_dir: Path, tensors: dict[str, torch.Tensor], ctx: StorageContext
    ) -> list[WrittenFile]:
        files = self.inner.write(state_dir, tensors, ctx)
        step_dir = state_dir.parent
        finishers = []
        for name, writer in self.writers.items():
            target = step_dir / name
            target.mkdir(exist_ok=True)
            done = writer(target)
            if callable(done):
                finishers.append(done)
        if ctx.process_group is not None:
            # Every rank's writer must be done before rank 0 lists the shared directories.
            dist.monitored_barrier(
                ctx.process_group,
                timeout=_dt.timedelta(seconds=self.barrier_timeout_s),
                wait_all_ranks=True,
            )
        if ctx.rank == 0:
            for finish in finishers:
                finish()
            files += [
                self._entry(step_dir, path)
                for name in self.writers
                for path in _walk(step_dir / name)
            ]
        return files

    @staticmethod
    def _entry(step_dir: Path, path: Path) -> WrittenFile:
        size, xxh3 = file_digest(str(path))
        return WrittenFile(path=str(path.relative_to(step_dir)), size=size, xxh3=xxh3)

    def read_metadata(self, state_dir: Path) -> Metadata:
        return self.inner.read_metadata(state_dir)

    def read(self, state_dir: Path, tensors: dict[str, torch.Tensor], ctx: StorageContext) -> None:
        self.inner.read(state_dir, tensors, ctx)


def _walk(directory: Path) -> list[Path]:
    out = []
    for base, dirs, names in os.walk(directory):
        dirs.sort()
        out += [Path(base) / n for n in sorted(names)]
    return out
