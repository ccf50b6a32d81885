"""ckptguard: checkpoints that commit atomically across ranks and resumes that are proven.

Public surface::

    CheckpointManager(root, *, config=None, process_group=None, storage=None)
        .save(step, state, *, healthy=None, loss=None, grad_norm=None) -> Path | None (None: unhealthy, skipped)
        .restore(state, *, mode=ResumeMode.AUTO, path=None, prefer=None) -> int
        .record_step(step, *, sample_ids=None, batch=None, loss=None, grad_norm=None, **extra)
        .resolve(*, mode=..., path=None) -> Resolution
        .committed_steps() -> list[int]
        .declare_phase(reason, changes) -> Path
    PreemptionGuard(mgr, grace_s=...).step_boundary(step, state)   # exits 75 after a save on SIGTERM
"""

from ._commit.pending import PendingSave
from ._core.roles import Role
from ._core.tierrestore import Tier
from ._records.contract import RunContract, hash_data_files, hash_git_tree, hash_imported_files, hash_recipe
from ._records.retention import KeepAny, KeepEvery, KeepLast, RetentionPolicy
from ._records.trust import HealthPolicy, Prefer
from ._resume.resolve import Resolution
from ._state.derived import DerivedState
from ._state.expert import ExpertParallel
from ._state.rng import GeneratorState
from ._state.state import PerRank
from ._version import __version__
from .config import CheckpointConfig, ParallelLayout, ProofPlan, ReshardRule, ResumeMode
from .cursor import CursorSampler, DataCursor
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
    RunStepError,
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
from .preempt import Preempted, PreemptionGuard
from .rollout import RolloutLedger
from .run import RunCheckpoint
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
from .tiers import TieredCheckpoint, TieredSave

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
    "CursorSampler",
    "DCPStorage",
    "DataCursor",
    "DerivedState",
    "ExpertParallel",
    "GeneratorState",
    "HealthPolicy",
    "IOStats",
    "KeepAny",
    "KeepEvery",
    "KeepLast",
    "LeaseHeldError",
    "ParallelLayout",
    "PendingSave",
    "PerRank",
    "PinnedMemoryUnavailableError",
    "Preempted",
    "PreemptionGuard",
    "Prefer",
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
    "Role",
    "RolloutLedger",
    "RunCheckpoint",
    "RunContract",
    "RunStepError",
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
    "TieredSave",
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
