"""The storage seam: what a backend implements (see ``Storage``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # types only: the checks that read DCP_METADATA's name run without torch
    import torch
    from torch.distributed import ProcessGroup
    from torch.distributed.checkpoint.metadata import Metadata

DCP_METADATA = ".metadata"


@dataclass(frozen=True)
class WrittenFile:
    """One file a rank wrote, relative to the step directory."""

    path: str
    size: int
    xxh3: str


@dataclass(frozen=True)
class StorageContext:
    """What a storage call needs to know about the collective it runs in."""

    rank: int
    world_size: int
    process_group: ProcessGroup | None  # None: one process, no collectives


class Storage(Protocol):
    """How tensor state is written to and read from a step's ``state/`` directory."""

    def write(
        self, state_dir: Path, tensors: dict[str, torch.Tensor], ctx: StorageContext
    ) -> list[WrittenFile]:
        """Write this rank's part of ``tensors``; collective over ``ctx.process_group``."""
        ...

    def read_metadata(self, state_dir: Path) -> Metadata:
        """The DCP metadata, read without running pickled code."""
        ...

    def read(self, state_dir: Path, tensors: dict[str, torch.Tensor], ctx: StorageContext) -> None:
        """Fill ``tensors`` in place from ``state_dir``; collective over ``ctx.process_group``."""
        ...
