"""ckptguard: checkpoints that commit atomically across ranks and resumes that are proven.

Public surface::

    # root: a directory or s3://bucket/prefix
    CheckpointManager(root, *, config=None, process_group=None, storage=None)
        .save(step, state, *, healthy=None, loss=None, grad_norm=None) -> Path | None
            (None: unhealthy, skipped)
        .restore(state, *, mode=ResumeMode.AUTO, path=None, prefer=None) -> int
        .record_step(step, *, sample_ids=None, batch=None, loss=None, grad_norm=None, **extra)
        .resolve(*, mode=..., path=None) -> Resolution
        .committed_steps() -> list[int]
        .declare_phase(reason, changes) -> Path
    open_step(root, step=None, *, ttl_s=600) -> context manager of a step dir that rotation keeps
    PreemptionGuard(mgr, grace_s=...).step_boundary(step, state)  # exits 75 after a save on SIGTERM
"""

import importlib as _importlib
import typing as _typing

from ._version import __version__

if (
    _typing.TYPE_CHECKING
):  # the names, for type checkers and the import graph; bound on first use below
    from ._commit.savehandle import PendingSave
    from ._core.door import Checkpointer, PendingCommit
    from ._core.roles import Role
    from ._core.tierrestore import Tier
    from ._records.contract import (
        RunContract,
        hash_data_files,
        hash_git_tree,
        hash_imported_files,
        hash_recipe,
    )
    from ._records.readers import open_step
    from ._records.retention import KeepAny, KeepEvery, KeepLast, RetentionPolicy
    from ._records.trust import HealthPolicy, Prefer
    from ._resume.resolve_local import Resolution
    from ._state.derived import DerivedState
    from ._state.expert import ExpertParallel
    from ._state.rng import GeneratorState
    from ._state.state import PerRank
    from .config import (
        AsyncOptions,
        BlockingBudget,
        CheckpointConfig,
        OnBusy,
        OverBudget,
        ParallelLayout,
        ProofPlan,
        ReshardOptions,
        ReshardRule,
        ResumeMode,
        StateOptions,
        StorageOptions,
    )
    from .cursor import CursorSampler, DataCursor
    from .environments import Environment, EnvKind
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
        SaveBudgetError,
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
    from .storage.s3 import Consistency, ObjectStoreOptions
    from .tiers import TieredCheckpoint, TieredSave
    from .turns import TurnLedger

# Each public name is imported on first use (PEP 562), so ``import ckptguard`` (and every
# ``ckptguard`` command) costs no torch import until a name that needs torch is used: an
# operator's ``ckptguard list`` on a loaded node must answer at once, not after 20-60 s.
_WHERE = {
    "ChainMismatchError": ".errors",
    "CheckpointConfig": ".config",
    "CheckpointCorruptError": ".errors",
    "CheckpointError": ".errors",
    "CheckpointIncompleteError": ".errors",
    "CheckpointManager": ".manager",
    "CheckpointNotFoundError": ".errors",
    "CheckpointWriteError": ".errors",
    "Checkpointer": "._core.door",
    "CollectiveTimeoutError": ".errors",
    "ConfigError": ".errors",
    "Consistency": ".storage.s3",
    "ContractMismatchError": ".errors",
    "CursorSampler": ".cursor",
    "DCPStorage": ".storage",
    "DataCursor": ".cursor",
    "EnvKind": ".environments",
    "Environment": ".environments",
    "DerivedState": "._state.derived",
    "ExpertParallel": "._state.expert",
    "GeneratorState": "._state.rng",
    "HealthPolicy": "._records.trust",
    "IOStats": ".storage",
    "KeepAny": "._records.retention",
    "KeepEvery": "._records.retention",
    "KeepLast": "._records.retention",
    "LeaseHeldError": ".errors",
    "ObjectStoreOptions": ".storage.s3",
    "OnBusy": ".config",
    "PendingCommit": "._core.door",
    "OverBudget": ".config",
    "AsyncOptions": ".config",
    "BlockingBudget": ".config",
    "ReshardOptions": ".config",
    "StateOptions": ".config",
    "StorageOptions": ".config",
    "SaveBudgetError": ".errors",
    "ParallelLayout": ".config",
    "PendingSave": "._commit.savehandle",
    "PerRank": "._state.state",
    "PinnedMemoryUnavailableError": ".errors",
    "Preempted": ".preempt",
    "PreemptionGuard": ".preempt",
    "Prefer": "._records.trust",
    "ProofPlan": ".config",
    "RankDisagreementError": ".errors",
    "RecordFormatError": ".errors",
    "RehearsalError": ".errors",
    "ReplicatedDivergenceError": ".errors",
    "ReshardRule": ".config",
    "Resolution": "._resume.resolve_local",
    "ResumeError": ".errors",
    "ResumeMode": ".config",
    "RetentionPolicy": "._records.retention",
    "Role": "._core.roles",
    "RolloutLedger": ".rollout",
    "RunCheckpoint": ".run",
    "RunContract": "._records.contract",
    "RunStepError": ".errors",
    "SaveStillRunningError": ".errors",
    "StaleDerivedStateError": ".errors",
    "StateMismatchError": ".errors",
    "Storage": ".storage",
    "StorageContext": ".storage",
    "StorageFormatError": ".errors",
    "StorageStallError": ".errors",
    "StreamingConfig": ".storage",
    "StreamingStorage": ".storage",
    "Tier": "._core.tierrestore",
    "TieredCheckpoint": ".tiers",
    "TieredSave": ".tiers",
    "TopologyMismatchError": ".errors",
    "TurnLedger": ".turns",
    "UnsafeCheckpointError": ".errors",
    "VersionMismatchError": ".errors",
    "WriteFailure": ".errors",
    "WrittenFile": ".storage",
    "hash_data_files": "._records.contract",
    "hash_git_tree": "._records.contract",
    "hash_imported_files": "._records.contract",
    "hash_recipe": "._records.contract",
    "open_step": "._records.readers",
    "read_dcp_metadata": ".storage",
}


def __getattr__(name: str) -> _typing.Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(_WHERE[name], __name__), name)  # lazy: PEP 562
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "AsyncOptions",
    "BlockingBudget",
    "ChainMismatchError",
    "CheckpointConfig",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointIncompleteError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointWriteError",
    "Checkpointer",
    "CollectiveTimeoutError",
    "ConfigError",
    "Consistency",
    "ContractMismatchError",
    "CursorSampler",
    "DCPStorage",
    "DataCursor",
    "DerivedState",
    "EnvKind",
    "Environment",
    "ExpertParallel",
    "GeneratorState",
    "HealthPolicy",
    "IOStats",
    "KeepAny",
    "KeepEvery",
    "KeepLast",
    "LeaseHeldError",
    "ObjectStoreOptions",
    "OnBusy",
    "OverBudget",
    "ParallelLayout",
    "PendingCommit",
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
    "ReshardOptions",
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
    "SaveBudgetError",
    "SaveStillRunningError",
    "StaleDerivedStateError",
    "StateMismatchError",
    "StateOptions",
    "Storage",
    "StorageContext",
    "StorageFormatError",
    "StorageOptions",
    "StorageStallError",
    "StreamingConfig",
    "StreamingStorage",
    "Tier",
    "TieredCheckpoint",
    "TieredSave",
    "TopologyMismatchError",
    "TurnLedger",
    "UnsafeCheckpointError",
    "VersionMismatchError",
    "WriteFailure",
    "WrittenFile",
    "__version__",
    "hash_data_files",
    "hash_git_tree",
    "hash_imported_files",
    "hash_recipe",
    "open_step",
    "read_dcp_metadata",
]


if _typing.TYPE_CHECKING:  # mypy holds every front door to the one shape (ckptguard.Checkpointer)
    _DOORS: tuple[type[Checkpointer], ...] = (CheckpointManager, RunCheckpoint, TieredCheckpoint)
