"""ckptguard: checkpoints that commit atomically across ranks and resumes that are proven.

Public surface::

    CheckpointManager(root, *, config=None, process_group=None, storage=None)
        .save(step, state) -> Path
        .restore(state, *, mode=ResumeMode.AUTO, path=None) -> int
        .record_step(step, *, sample_ids=None, batch=None, loss=None, grad_norm=None, **extra)
        .resolve(*, mode=..., path=None) -> Resolution
        .committed_steps() -> list[int]
        .declare_phase(reason, changes) -> Path
"""

__version__ = "0.1.0"

from ._commit.pending import PendingSave
from ._commit.retention import KeepAny, KeepEvery, KeepLast, RetentionPolicy
from ._resume.contract import RunContract, hash_data_files, hash_git_tree, hash_imported_files, hash_recipe
from ._resume.derived import DerivedState
from ._resume.expert import ExpertParallel
from ._resume.restore import Resolution
from ._resume.rng import GeneratorState
from ._resume.state import PerRank
from .config import CheckpointConfig, ParallelLayout, ProofPlan, ReshardRule, ResumeMode
from .errors import (
    ChainMismatchError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointIncompleteError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    CollectiveTimeoutError,
    ConfigError,
    ContractMismatchError,
    LeaseHeldError,
    PinnedMemoryUnavailableError,
    RankDisagreementError,
    RecordFormatError,
    RehearsalError,
    ReplicatedDivergenceError,
    ResumeError,
    SaveStillRunningError,
    StaleDerivedStateError,
    StateMismatchError,
    StorageFormatError,
    StorageStallError,
    TopologyMismatchError,
    UnsafeCheckpointError,
    VersionMismatchError,
    WriteFailure,
)
from .manager import CheckpointManager
from .storage import (
    DCPStorage,
    IOStats,
    Storage,
    StorageContext,
    StreamingConfig,
    StreamingStorage,
    WrittenFile,
    read_dcp_metadata,
)
from .tiers import Tier, TieredCheckpoint

__all__ = [
    "ChainMismatchError",
    "CheckpointConfig",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointIncompleteError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointWriteError",
    "CollectiveTimeoutError",
    "ConfigError",
    "ContractMismatchError",
    "DCPStorage",
    "DerivedState",
    "ExpertParallel",
    "GeneratorState",
    "IOStats",
    "KeepAny",
    "KeepEvery",
    "KeepLast",
    "LeaseHeldError",
    "ParallelLayout",
    "PendingSave",
    "PerRank",
    "PinnedMemoryUnavailableError",
    "ProofPlan",
    "RankDisagreementError",
    "RecordFormatError",
    "RehearsalError",
    "ReplicatedDivergenceError",
    "ReshardRule",
    "Resolution",
    "ResumeError",
    "ResumeMode",
    "RetentionPolicy",
    "RunContract",
    "SaveStillRunningError",
    "StaleDerivedStateError",
    "StateMismatchError",
    "Storage",
    "StorageContext",
    "StorageFormatError",
    "StorageStallError",
    "StreamingConfig",
    "StreamingStorage",
    "Tier",
    "TieredCheckpoint",
    "TopologyMismatchError",
    "UnsafeCheckpointError",
    "VersionMismatchError",
    "WriteFailure",
    "WrittenFile",
    "__version__",
    "hash_data_files",
    "hash_git_tree",
    "hash_imported_files",
    "hash_recipe",
    "read_dcp_metadata",
]
