"""Configuration: frozen, keyword-only option groups composed into one CheckpointConfig, validated
on construction."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._disk.layout import StepNaming
from ._records.contract import RunContract
from ._records.retention import RetentionPolicy, default_policy
from ._records.trust import HealthPolicy
from .errors import ConfigError
from .storage.s3 import ObjectStoreOptions


class ResumeMode(enum.Enum):
    """How ``resolve``/``restore`` pick the step to resume from."""

    AUTO = "auto"
    """The tracker's step; a missing root or tracker 0 is a declared fresh start."""
    MUST = "must"
    """Like AUTO, but raise instead of starting fresh."""
    NEVER = "never"
    """Always start fresh; existing checkpoints are listed in the log and left alone."""


class OnBusy(enum.Enum):
    """What a ``save_async`` requested while the previous one still commits does (every rank alike:
    rank 0 decides from every rank's view, before any rank snapshots). Every save not committed is
    logged with its reason, counted, and recorded in the next committed step's cost block
    (``ckptguard verify`` shows it)."""

    SKIP = "skip"
    """Skip it: nothing is snapshotted, the caller is not held; the reason is logged (with the
    interval that fits the measured commit time), counted, and recorded in the next committed step's
    cost block."""
    WAIT = "wait"
    """Wait for the commit in flight, then save (the caller is held for the rest of that commit)."""
    COALESCE = "coalesce"
    """Snapshot it now into a second host staging set and queue it (not started); a later request
    while it is still queued replaces it (the newest wins; the replaced step is recorded as
    coalesced). The queued save starts only at an agreed point of the caller's thread, once every
    rank's commit ended: the next ``save_async`` (which then replaces it: the newest wins),
    ``poll()`` or ``wait()`` (which commits it too). A request whose snapshot the second set cannot
    hold whole in host memory (it never reads live tensors: they change before it starts) is skipped
    instead, with the reason. ``CheckpointManager`` only: ``RunCheckpoint`` and ``TieredCheckpoint``
    refuse it (``ConfigError``)."""
    FAST_TIER = "fast_tier"
    """``TieredCheckpoint`` only (the others refuse it): a save requested while only the persistent
    tier still commits is written to the fast tier alone, at once, beside that commit, recorded as
    redirected (skipped if the fast tier commits too). A redirected step lives on node-local storage
    only (and peers with ``replicas=1``): a restore on the same nodes resumes from it, one after a
    lost node from the newest persistent step."""


class OverBudget(enum.Enum):
    """What a synchronous ``save`` whose estimated blocking exceeds its ``BlockingBudget`` does
    (every rank alike)."""

    WARN = "warn"
    """Save it synchronously and say so first (a warning naming the estimate, the budget and the
    timeout). ckptguard's own waits inside a save never enter the caller's group, so its watchdog
    cannot fire there; this is the default because ``save``'s callers expect the step directory
    back."""
    BACKGROUND = "background"
    """Commit it in the background, as ``save_async`` does: the caller is held only for the copies;
    ``save`` returns None (logged as a warning), and ``wait()`` or the next save joins the
    commit."""
    REFUSE = "refuse"
    """Raise ``SaveBudgetError`` on every rank, naming the estimate and the timeout; nothing is
    written."""


@dataclass(frozen=True)
class BlockingBudget:
    """How long a synchronous ``save`` may hold the caller: ``fraction`` of the process group's
    collective timeout (``timeout_s`` declared, else read from the group). Applies with more than
    one rank."""

    fraction: float | None = 0.5
    """Of the collective timeout; None: no budget."""
    timeout_s: float | None = None
    """The collective timeout to plan against (seconds); None: the smallest of the process group's
    backends."""
    over: OverBudget = OverBudget.WARN
    """What a save estimated above the budget does."""

    def __post_init__(self) -> None:
        if self.fraction is not None and not 0 < self.fraction <= 1:
            raise ConfigError(
                f"BlockingBudget.fraction must be in (0, 1] or None, got {self.fraction!r}"
            )
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ConfigError(
                f"BlockingBudget.timeout_s must be > 0 seconds or None, got {self.timeout_s!r}"
            )
        if not isinstance(self.over, OverBudget):
            raise ConfigError(
                f"BlockingBudget.over must be an OverBudget (WARN, "
                f"BACKGROUND, REFUSE): {self.over!r}"
            )


class ReshardRule(enum.Enum):
    """What happens to per-rank state when the world size changes on restore."""

    REFUSE = "refuse"
    """A different world size or layout raises TopologyMismatchError."""
    BY_ITEM = "by_item"
    """DCP reshards tensors; every other item by its declared rule (a ``DataCursor`` is
    re-partitioned, ``replicated`` items are checked equal and copied, ``PerRank(value, reshard=f)``
    runs ``f``, the RNG streams are re-derived from ``rng_seed``, step and new rank); an item
    without a rule refuses the restore."""


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """Parallel sizes recorded in the manifest and compared on restore."""

    dp: int = 1
    """Data-parallel (incl. FSDP shard) size."""
    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    ep: int = 1
    """Expert-parallel size."""

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"ParallelLayout.{name} must be an int >= 1, got {value!r}")

    def as_dict(self) -> dict[str, int]:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "ep": self.ep}


@dataclass(frozen=True, kw_only=True)
class ProofPlan:
    """Which resume-proof gates apply to this job; recorded with every save and read by ``ckptguard
    prove``.

    A gate that applies and did not run leaves the resume NOT proven; a gate that does not
    apply is shown as N/A, so a plain training job is proven without faking exports.
    """

    record: bool = True
    """Append save/restore/step/export/logprob/update records to ROOT/proof for ``ckptguard prove``
    (not itself recorded: a plan read back from the records always comes from a recording run)."""
    rl: bool = False
    """An RL job: the first export and the first old-logprob after a restore are gates
    (``record_export``, ``record_logprobs``). Off: they are N/A unless such records exist. Rollouts
    sample across processes, which is not bitwise, so ``rl=True`` implies ``deterministic=False``
    unless it is given."""
    deterministic: bool | None = None
    """Replayed steps must reproduce ``loss``, ``grad_norm`` and every extra bitwise (the default,
    ``None``, means ``not rl``). ``False`` declares steps that are legitimately not bitwise: their
    differences are then INFO and the verdict says the numerics were not compared."""
    replay_steps: int = 1
    """Steps after the restored step that the killed run and the resumed run must both record
    (``record_step``); fewer is MISSING (not a FAIL). ``ckptguard rehearse`` runs this many past a
    save."""
    total_steps: int | None = None
    """The step the job ends at. A resumed run that records no step before its process exits while
    the restored step is below it is a FAIL (``resumed run trained``); None: only the records tell
    whether steps were left (the killed run recorded steps past the restored one)."""

    def __post_init__(self) -> None:
        if self.deterministic is None:
            object.__setattr__(
                self, "deterministic", not self.rl if isinstance(self.rl, bool) else None
            )
        for name in ("record", "rl", "deterministic"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"ProofPlan.{name} must be a bool, got {getattr(self, name)!r}")
        if (
            not isinstance(self.replay_steps, int)
            or isinstance(self.replay_steps, bool)
            or self.replay_steps < 1
        ):
            raise ConfigError(
                f"ProofPlan.replay_steps must be an int >= 1, got {self.replay_steps!r}"
            )
        total = self.total_steps
        if total is not None and (
            not isinstance(total, int) or isinstance(total, bool) or total < 1
        ):
            raise ConfigError(f"ProofPlan.total_steps must be an int >= 1 or None, got {total!r}")

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "rl": self.rl,
            "deterministic": self.deterministic,
            "replay_steps": self.replay_steps,
        }
        if (
            self.total_steps is not None
        ):  # older readers take ProofPlan(**plan): only a declared total is written
            out["total_steps"] = self.total_steps
        return out


def _seconds(owner: str, name: str, value: object, *, none_ok: bool = False) -> None:
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(
            f"{owner}.{name} must be > 0 seconds{' or None' if none_ok else ''}, got {value!r}"
        )


def _byte_count(owner: str, name: str, value: object, *, none_ok: bool = False) -> None:
    if value is None and none_ok:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(
            f"{owner}.{name} must be an int >= 0 "
            f"(bytes){' or None' if none_ok else ''}, got {value!r}"
        )


@dataclass(frozen=True, kw_only=True)
class StorageOptions:
    """Where and how a step's files are written, published and cleaned up."""

    dir_template: str = "step_{step:08d}"
    """Step directory name; one {step} field. verl style: 'global_step_{step}'."""
    stage_dir: Path | None = None
    """Node-local directory to serialize into before copying to the root (None: write in place)."""
    keep_failed: bool = False
    """Keep a failed save's temp directory (renamed .failed-...) as evidence instead of deleting
    it."""
    publish_checksums: bool | None = None
    """Before the commit, the publishing rank (rank 0, or each node's first rank on node-local
    roots) reads every reported file back and compares its xxh3 with the writer's; the sizes (and
    that each file is there) are always checked. None (the default): on node-local roots, where
    files are placed and copied per node, and not on a shared root, where the placement round has
    already shown every rank sees rank 0's temp directory. The read-back costs one read of the
    published bytes after the writer dropped them from the page cache: on a shared root, O(all
    ranks' bytes) on rank 0 at every save (a 6 GiB state at 1.9 GiB/s cold read: about +3 s on a 5 s
    save). True: always; False: never."""
    allow_newer_torch: bool = False
    """Read checkpoints written by a newer torch (refused by default, before any read)."""
    stale_temp_age_s: float = 24 * 3600.0
    """Age after which another host's leftover temp directory is swept."""
    lease_ttl_s: float = 6 * 3600.0
    """A lease from another host not renewed (by a save) for this long counts as abandoned."""
    object_store: ObjectStoreOptions | None = None
    """How an ``s3://bucket/prefix`` root's store is talked to (endpoint, parts, lease,
    consistency); None: ``ObjectStoreOptions()`` (boto3's configuration). Unused for a filesystem
    root."""
    object_staging: Path | None = None
    """An ``s3://`` root's local root: each step is committed there before its upload and downloaded
    there before a restore (node-local or shared, the same path on every node, room for one step).
    None: ``$TMPDIR/ckptguard-staging-<uid>/<endpoint hash>/<bucket>/<prefix>`` (node-local). A
    directory that holds anything but this store's staging (an existing root, another store's
    staging) or is a link is refused (``ckptguard-staging.json`` names the store). Unused for a
    filesystem root."""

    def __post_init__(self) -> None:
        StepNaming(self.dir_template)  # raises ConfigError naming the field
        for name in ("stage_dir", "object_staging"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), Path):
                object.__setattr__(self, name, Path(getattr(self, name)))
        if self.object_store is not None and not isinstance(self.object_store, ObjectStoreOptions):
            raise ConfigError(
                f"StorageOptions.object_store must be an ObjectStoreOptions or None, got "
                f"{self.object_store!r}"
            )
        if self.publish_checksums is not None and not isinstance(self.publish_checksums, bool):
            raise ConfigError(
                f"StorageOptions.publish_checksums must be True, False or None (auto), got "
                f"{self.publish_checksums!r}"
            )
        for name in ("keep_failed", "allow_newer_torch"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    f"StorageOptions.{name} must be a bool, got {getattr(self, name)!r}"
                )
        _seconds("StorageOptions", "stale_temp_age_s", self.stale_temp_age_s)
        _seconds("StorageOptions", "lease_ttl_s", self.lease_ttl_s)


@dataclass(frozen=True, kw_only=True)
class StateOptions:
    """What is captured with the state and checked when it is put back."""

    capture_rng: bool = True
    """Save the CPU, CUDA, Python and NumPy RNG streams of every rank."""
    restore_rng: bool = True
    """Put the saved RNG streams back on restore (off only to show what breaks without it)."""
    verify_restored: bool = True
    """After restore, compare every item with the save and raise if it differs: tensor items by
    their layout-free digest (on the device for GPU tensors) and, on the same layout, their
    structure and non-tensor values; other items by their per-rank digest."""

    def __post_init__(self) -> None:
        for name in ("capture_rng", "restore_rng", "verify_restored"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    f"StateOptions.{name} must be a bool, got {getattr(self, name)!r}"
                )


@dataclass(frozen=True, kw_only=True)
class AsyncOptions:
    """``save_async``: the memory its snapshot may take and what a save requested during a commit
    does."""

    gpu_bytes: int = 0
    """Spare GPU memory a ``save_async`` snapshot may take (bytes); 0: never snapshot into GPU
    memory."""
    host_bytes: int | None = None
    """Host memory a ``save_async`` snapshot may stage into (bytes, per rank); None: derived from
    the memory contract (cgroup memory.max x the Ray threshold, minus what is resident and a
    margin). What does not fit is read from the live tensors by the background writer, and the next
    optimizer step waits for it."""
    pool_idle_s: float | None = 600.0
    """Release the pinned staging pool after this many seconds without a ``save_async`` (None: keep
    it until ``close()``); the pool is reused by every save meanwhile and reported in each
    manifest's cost block."""
    on_busy: OnBusy = OnBusy.SKIP
    """A ``save_async`` requested while the previous commit is still running: skipped (the default),
    waited for, coalesced into one queued save, or written to a ``TieredCheckpoint``'s fast tier
    (``OnBusy``); decided alike on every rank, before any rank snapshots."""

    def __post_init__(self) -> None:
        _byte_count("AsyncOptions", "gpu_bytes", self.gpu_bytes)
        _byte_count("AsyncOptions", "host_bytes", self.host_bytes, none_ok=True)
        _seconds("AsyncOptions", "pool_idle_s", self.pool_idle_s, none_ok=True)
        if not isinstance(self.on_busy, OnBusy):
            raise ConfigError(
                f"AsyncOptions.on_busy must be an OnBusy ({', '.join(m.name for m in OnBusy)}), "
                f"got {self.on_busy!r}"
            )


@dataclass(frozen=True, kw_only=True)
class ReshardOptions:
    """The parallel layout recorded with each step, and what a restore onto another layout does."""

    rule: ReshardRule = ReshardRule.REFUSE
    """Whether and how to restore onto a different world size."""
    layout: ParallelLayout | None = None
    """Parallel sizes recorded in the manifest and compared on restore; None: pure data parallel."""
    rng_seed: int | None = None
    """The job's base seed, recorded with every save: a ``BY_ITEM`` resharded restore seeds new rank
    r's RNG streams from (this seed, the restored step, r). None: the RNG streams have no reshard
    rule."""
    replicated: tuple[str, ...] = ()
    """State items equal on every rank (a scheduler, a step counter): a ``BY_ITEM`` resharded
    restore checks that every saving rank saved the same value and gives it to every new rank."""

    def __post_init__(self) -> None:
        if not isinstance(self.rule, ReshardRule):
            raise ConfigError(f"ReshardOptions.rule must be a ReshardRule, got {self.rule!r}")
        if self.layout is not None and not isinstance(self.layout, ParallelLayout):
            raise ConfigError(
                f"ReshardOptions.layout must be a ParallelLayout or None, got {self.layout!r}"
            )
        seed = self.rng_seed
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
            raise ConfigError(f"ReshardOptions.rng_seed must be an int >= 0 or None, got {seed!r}")
        if isinstance(self.replicated, str) or not all(isinstance(n, str) for n in self.replicated):
            raise ConfigError(
                f"ReshardOptions.replicated must be a tuple of state item "
                f"names, got {self.replicated!r}"
            )
        object.__setattr__(self, "replicated", tuple(self.replicated))


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Settings of a CheckpointManager, a RunCheckpoint or a TieredCheckpoint, in groups of options.
    Runtime objects (process group, storage) are passed to the front door directly, never here;
    one-shot actions (``overwrite``, ``break_lease``) are arguments of the call that needs them.

    ``CheckpointConfig(timeout_s=60, storage=StorageOptions(stage_dir=...), reshard=ReshardOptions(
    rule=ReshardRule.BY_ITEM, rng_seed=0), retention=KeepLast(2))``.
    """

    timeout_s: float = 600.0
    """Longest wait at any agreement point before raising with the missing ranks."""
    storage: StorageOptions = field(default_factory=StorageOptions)
    """Where and how a step's files are written, published and cleaned up."""
    state: StateOptions = field(default_factory=StateOptions)
    """RNG capture and the check of what a restore put back."""
    async_save: AsyncOptions = field(default_factory=AsyncOptions)
    """``save_async``: its memory and what a save requested during a commit does."""
    blocking: BlockingBudget = field(default_factory=BlockingBudget)
    """How long a synchronous ``save`` may hold the caller (a fraction of the collective timeout)
    and what a save estimated above it does (``BlockingBudget``): by default it warns and saves."""
    reshard: ReshardOptions = field(default_factory=ReshardOptions)
    """The recorded parallel layout and what a restore onto another one does."""
    proof: ProofPlan = field(default_factory=ProofPlan)
    """Whether proof records are written and which gates apply (RL gates, bitwise replay, replayed
    steps)."""
    health: HealthPolicy = field(default_factory=HealthPolicy)
    """Which steps may be committed (finite loss and grad norm, a user check), when a committed step
    is verified, and whether AUTO resumes prefer the newest verified step
    (``ckptguard._records.trust``)."""
    retention: RetentionPolicy | None = field(default_factory=default_policy)
    """Which committed steps survive rotation (default: last 3 + every 20th); None keeps all."""
    contract: RunContract | None = None
    """The run contract compared on save and restore; None means an empty contract."""

    def __post_init__(self) -> None:
        _seconds("CheckpointConfig", "timeout_s", self.timeout_s)
        for name, cls in _GROUPS.items():
            value = getattr(self, name)
            if not isinstance(value, cls):
                raise ConfigError(
                    f"CheckpointConfig.{name} must be a {cls.__name__}, got {value!r}"
                )
        if self.contract is not None and not isinstance(self.contract, RunContract):
            raise ConfigError("CheckpointConfig.contract must be a RunContract or None")
        if self.retention is not None and not callable(getattr(self.retention, "keep", None)):
            raise ConfigError(
                "CheckpointConfig.retention must be a policy (KeepLast, KeepEvery, a | b) or None"
            )


# Every option group and its type: a group given as anything else (a flat value, a bare ReshardRule)
# is refused naming the group, not read as an option group later.
_GROUPS: dict[str, type[Any]] = {
    "storage": StorageOptions,
    "state": StateOptions,
    "async_save": AsyncOptions,
    "blocking": BlockingBudget,
    "reshard": ReshardOptions,
    "proof": ProofPlan,
    "health": HealthPolicy,
}


def with_dir_template(template: str, options: Mapping[str, Any]) -> CheckpointConfig:
    """A config of ``options`` (``CheckpointConfig`` keywords) whose steps are named by
    ``template``: an integration's directory names, kept whatever ``StorageOptions`` the caller
    passed."""
    options = dict(options)
    storage = options.pop("storage", None) or StorageOptions()
    if not isinstance(storage, StorageOptions):
        raise ConfigError(f"CheckpointConfig.storage must be a StorageOptions, got {storage!r}")
    return CheckpointConfig(storage=dataclasses.replace(storage, dir_template=template), **options)
