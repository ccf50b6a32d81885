"""ckptguard: checkpoints that commit atomically across ranks and resumes that are proven.

Public surface::

    CheckpointManager(root, *, config=None, process_group=None, storage=None)
        .save(step, state) -> Path
        .restore(state, *, mode=ResumeMode.AUTO, path=None) -> int
        .resolve(*, mode=..., path=None) -> Resolution
        .committed_steps() -> list[int]
        .declare_phase(reason, changes) -> Path
"""

__version__ = "0.1.0"

from ._async import PendingSave
from ._restore import Resolution
from ._state import PerRank
from ._storage import DCPStorage, Storage, StorageContext, WrittenFile, read_dcp_metadata
from .config import CheckpointConfig, ParallelLayout, ReshardRule, ResumeMode
from .contract import (
    RunContract,
    hash_data_files,
    hash_git_tree,
    hash_imported_files,
    hash_recipe,
)
from .derived import DerivedState, StaleDerivedStateError
from .errors import *  # noqa: F403  (errors.__all__ is the exception tree)
from .errors import __all__ as _error_names
from .expert import ExpertParallel
from .fastio import IOStats, StreamingConfig, StreamingStorage
from .manager import CheckpointManager
from .retention import KeepAny, KeepEvery, KeepLast, RetentionPolicy

__all__ = [
    "CheckpointConfig",
    "CheckpointManager",
    "DCPStorage",
    "DerivedState",
    "ExpertParallel",
    "IOStats",
    "StreamingConfig",
    "StreamingStorage",
    "KeepAny",
    "KeepEvery",
    "KeepLast",
    "RetentionPolicy",
    "StaleDerivedStateError",
    "ParallelLayout",
    "PendingSave",
    "PerRank",
    "ReshardRule",
    "Resolution",
    "ResumeMode",
    "RunContract",
    "Storage",
    "StorageContext",
    "WrittenFile",
    "__version__",
    "hash_data_files",
    "hash_git_tree",
    "hash_imported_files",
    "hash_recipe",
    "read_dcp_metadata",
    *_error_names,
]
