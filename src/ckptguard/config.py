"""Configuration: one frozen, keyword-only dataclass, validated on construction."""

from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from ._disk.layout import StepNaming
from ._records.contract import RunContract
from ._records.retention import RetentionPolicy, default_policy
from ._records.trust import HealthPolicy
from .errors import ConfigError


class ResumeMode(enum.Enum):
    """How ``resolve``/``restore`` pick the step to resume from."""

    AUTO = "auto"
    """The tracker's step; a missing root or tracker 0 is a declared fresh start."""
    MUST = "must"
    """Like AUTO, but raise instead of starting fresh."""
    NEVER = "never"
    """Always start fresh; existing checkpoints are listed in the log and left alone."""


class OnBusy(enum.Enum):
    """What a ``save_async`` requested while the previous one still commits does (every rank alike: rank 0
    decides from every rank's view, before any rank snapshots). Every save not committed is logged with its
    reason, counted, and recorded in the next committed step's cost block (``ckptguard verify`` shows it)."""

    SKIP = "skip"
    """Skip it: nothing is snapshotted, the caller is not held; the reason is logged (with the interval
    that fits the measured commit time), counted, and recorded in the next committed step's cost block."""
    WAIT = "wait"
    """Wait for the commit in flight, then save (the caller is held for the rest of that commit)."""
    COALESCE = "coalesce"
    """Snapshot it now into a second host staging set and queue it (not started); a later request while it is
    still queued replaces it (the newest wins; the replaced step is recorded as coalesced). The queued save
    starts only at an agreed point of the caller's thread, once every rank's commit ended: the next
    ``save_async`` (which then replaces it: the newest wins), ``poll()`` or ``wait()`` (which commits it too).
    A request whose snapshot the second set cannot hold whole in host memory (it never reads live tensors:
    they change before it starts) is skipped instead, with the reason. ``CheckpointManager`` only:
    ``RunCheckpoint`` and ``TieredCheckpoint`` refuse it (``ConfigError``)."""
    FAST_TIER = "fast_tier"
    """``TieredCheckpoint`` only (the others refuse it, ``ConfigError``): a save requested while only the
    persistent tier still commits is written to the fast tier alone (whatever the step's intervals), at once,
    beside that commit, and recorded as redirected; requested while the fast tier commits too, it is skipped.
    For recovery, a redirected step lives on node-local storage only (and on peers with ``replicas=1``): a
    restore on the same nodes resumes from it, one after a lost node falls back to the newest persistent step."""


class OverBudget(enum.Enum):
    """What a synchronous ``save`` whose estimated blocking exceeds its ``BlockingBudget`` does (every rank alike)."""

    WARN = "warn"
    """Save it synchronously and say so first (a warning naming the estimate, the budget and the timeout).
    ckptguard's own waits inside a save never enter the caller's group, so its watchdog cannot fire there;
    this is the default because ``save``'s callers expect the step directory back."""
    BACKGROUND = "background"
    """Commit it in the background, as ``save_async`` does: the caller is held only for the copies; ``save``
    returns None (logged as a warning), and ``wait()`` or the next save joins the commit."""
    REFUSE = "refuse"
    """Raise ``SaveBudgetError`` on every rank, naming the estimate and the timeout; nothing is written."""


@dataclass(frozen=True)
class BlockingBudget:
    """How long a synchronous ``save`` may hold the caller: ``fraction`` of the process group's collective
    timeout (``timeout_s`` declared, else read from the group). Applies with more than one rank."""

    fraction: float | None = 0.5
    """Of the collective timeout; None: no budget."""
    timeout_s: float | None = None
    """The collective timeout to plan against (seconds); None: the smallest of the process group's backends."""
    over: OverBudget = OverBudget.WARN
    """What a save estimated above the budget does."""

    def __post_init__(self) -> None:
        if self.fraction is not None and not 0 < self.fraction <= 1:
            raise ConfigError(f"BlockingBudget.fraction must be in (0, 1] or None, got {self.fraction!r}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ConfigError(f"BlockingBudget.timeout_s must be > 0 seconds or None, got {self.timeout_s!r}")
        if not isinstance(self.over, OverBudget):
            raise ConfigError(f"BlockingBudget.over must be an OverBudget (WARN, BACKGROUND, REFUSE): {self.over!r}")


class ReshardRule(enum.Enum):
    """What happens to per-rank state when the world size changes on restore."""

    REFUSE = "refuse"
    """A different world size or layout raises TopologyMismatchError."""
    BY_ITEM = "by_item"
    """DCP reshards tensors; every other item by its declared rule (a ``DataCursor`` is re-partitioned,
    ``replicated`` items are checked equal and copied, ``PerRank(value, reshard=f)`` runs ``f``, the RNG
    streams are re-derived from ``rng_seed``, step and new rank); an item without a rule refuses the restore."""
    EXTRAS_FROM_RANK0 = "extras_from_rank0"
    """Legacy, kept for old jobs: every rank takes rank 0's per-rank values and RNG streams (identical
    dropout and sampling on every rank); ``ckptguard prove`` fails such a resume. Use BY_ITEM."""
    EXTRAS_MODULO = "extras_modulo"
    """Legacy, kept for old jobs: rank r takes the extras of old rank r % old_world_size (growing duplicates
    streams; shrinking drops ranks' data positions). Use BY_ITEM."""


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
    """Which resume-proof gates apply to this job; recorded with every save and read by ``ckptguard prove``.

    A gate that applies and did not run leaves the resume NOT proven; a gate that does not
    apply is shown as N/A, so a plain training job is proven without faking exports.
    """

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
    (``record_step``); fewer is NOT RUN. ``ckptguard rehearse`` runs this many past a save."""
    total_steps: int | None = None
    """The step the job ends at. A resumed run that records no step before its process exits while
    the restored step is below it is a FAIL (``resumed run trained``); None: only the records tell
    whether steps were left (the killed run recorded steps past the restored one)."""

    def __post_init__(self) -> None:
        if self.deterministic is None:
            object.__setattr__(self, "deterministic", not self.rl if isinstance(self.rl, bool) else None)
        for name in ("rl", "deterministic"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"ProofPlan.{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.replay_steps, int) or isinstance(self.replay_steps, bool) or self.replay_steps < 1:
            raise ConfigError(f"ProofPlan.replay_steps must be an int >= 1, got {self.replay_steps!r}")
        total = self.total_steps
        if total is not None and (not isinstance(total, int) or isinstance(total, bool) or total < 1):
            raise ConfigError(f"ProofPlan.total_steps must be an int >= 1 or None, got {total!r}")

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"rl": self.rl, "deterministic": self.deterministic, "replay_steps": self.replay_steps}
        if self.total_steps is not None:  # older readers take ProofPlan(**plan): only a declared total is written
            out["total_steps"] = self.total_steps
        return out


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Settings of a CheckpointManager. Runtime objects (process group, storage) are
    passed to the manager directly, never here."""

    dir_template: str = "step_{step:08d}"
    """Step directory name; one {step} field. verl style: 'global_step_{step}'."""
    timeout_s: float = 600.0
    """Longest wait at any agreement point before raising with the missing ranks."""
    stage_dir: Path | None = None
    """Node-local directory to serialize into before copying to the root (None: write in place)."""
    capture_rng: bool = True
    """Save the CPU, CUDA, Python and NumPy RNG streams of every rank."""
    restore_rng: bool = True
    """Put the saved RNG streams back on restore (off only to show what breaks without it)."""
    verify_restored: bool = True
    """After restore, compare every item with the save and raise if it differs: tensor items by their
    layout-free digest (on the device for GPU tensors) and, on the same layout, their structure and
    non-tensor values; other items by their per-rank digest."""
    contract: RunContract | None = None
    """The run contract compared on save and restore; None means an empty contract."""
    layout: ParallelLayout | None = None
    """Parallel sizes; None means pure data parallel over the whole group."""
    reshard: ReshardRule = ReshardRule.REFUSE
    """Whether and how to restore onto a different world size."""
    rng_seed: int | None = None
    """The job's base seed, recorded with every save: a ``BY_ITEM`` resharded restore seeds new rank r's
    RNG streams from (this seed, the restored step, r). None: the RNG streams have no reshard rule."""
    replicated: tuple[str, ...] = ()
    """State items equal on every rank (a scheduler, a step counter): a ``BY_ITEM`` resharded restore checks
    that every saving rank saved the same value and gives it to every new rank."""
    allow_newer_torch: bool = False
    """Read checkpoints written by a newer torch (refused by default, before any read)."""
    overwrite: bool = False
    """Deprecated (a one-shot action that stayed set on every restart of the job passing this config):
    pass ``save(..., overwrite=True)`` to the one save that replaces a committed step."""
    stale_temp_age_s: float = 24 * 3600.0
    """Age after which another host's leftover temp directory is swept."""
    lease_ttl_s: float = 6 * 3600.0
    """A lease from another host not renewed (by a save) for this long counts as abandoned."""
    break_lease: bool = False
    """Deprecated (a one-shot action that stayed set on every restart of the job passing this config):
    pass ``save(..., break_lease=True)`` (and ``restore(..., break_lease=True)``) to the calls that take
    the root's write lease from a live owner."""
    async_gpu_bytes: int = 0
    """Spare GPU memory a ``save_async`` snapshot may take (bytes); 0: never snapshot into GPU memory."""
    async_host_bytes: int | None = None
    """Host memory a ``save_async`` snapshot may stage into (bytes, per rank); None: derived from the memory
    contract (cgroup memory.max x the Ray threshold, minus what is resident and a margin). What does not fit
    is read from the live tensors by the background writer, and the next optimizer step waits for it."""
    async_pool_idle_s: float | None = 600.0
    """Release the pinned staging pool after this many seconds without a ``save_async`` (None: keep it until
    ``close()``); the pool is reused by every save meanwhile and reported in each manifest's cost block."""
    on_busy: OnBusy = OnBusy.SKIP
    """A ``save_async`` requested while the previous commit is still running: skipped (the default), waited
    for, coalesced into one queued save, or written to a ``TieredCheckpoint``'s fast tier (``OnBusy``); decided
    alike on every rank, before any rank snapshots."""
    blocking: BlockingBudget = field(default_factory=BlockingBudget)
    """How long a synchronous ``save`` may hold the caller (a fraction of the collective timeout) and what a
    save estimated above it does (``BlockingBudget``): by default it warns and saves."""
    keep_failed: bool = False
    """Keep a failed save's temp directory (renamed .failed-...) as evidence instead of deleting it."""
    publish_checksums: bool | None = None
    """Before the commit, the publishing rank (rank 0, or each node's first rank on node-local roots)
    reads every reported file back and compares its xxh3 with the writer's; the sizes (and that each
    file is there) are always checked. None (the default): on node-local roots, where files are placed
    and copied per node, and not on a shared root, where the placement round has already shown every
    rank sees rank 0's temp directory. The read-back costs one read of the published bytes after the
    writer dropped them from the page cache: on a shared root, O(all ranks' bytes) on rank 0 at every
    save (a 6 GiB state at 1.9 GiB/s cold read: about +3 s on a 5 s save). True: always; False: never."""
    record_proof: bool = True
    """Append save/restore/step/export/logprob/update records to ROOT/proof for ``ckptguard prove``."""
    proof: ProofPlan = field(default_factory=ProofPlan)
    """Which proof gates apply (RL gates, bitwise replay, replayed steps); recorded with each save."""
    retention: RetentionPolicy | None = field(default_factory=default_policy)
    """Which committed steps survive rotation (default: last 3 + every 20th); None keeps all."""
    health: HealthPolicy = field(default_factory=HealthPolicy)
    """Which steps may be committed (finite loss and grad norm, a user check), when a committed step
    is verified, and whether AUTO resumes prefer the newest verified step (``ckptguard._records.trust``)."""

    def __post_init__(self) -> None:
        StepNaming(self.dir_template)  # raises ConfigError naming the field
        for action in ("overwrite", "break_lease"):
            if getattr(self, action):
                warnings.warn(
                    f"CheckpointConfig({action}=True) is deprecated: it acts on every save of every restart of the "
                    f"job that passes this config. Pass {action}=True to the call that needs it instead, e.g. "
                    f"mgr.save(step, state, {action}=True); the field goes in the next release",
                    DeprecationWarning, stacklevel=3,
                )
        if not self.timeout_s > 0:
            raise ConfigError(f"CheckpointConfig.timeout_s must be > 0 seconds, got {self.timeout_s!r}")
        if not isinstance(self.on_busy, OnBusy):
            raise ConfigError(f"CheckpointConfig.on_busy must be an OnBusy (SKIP, WAIT, COALESCE, FAST_TIER), "
                              f"got {self.on_busy!r}")
        if not isinstance(self.blocking, BlockingBudget):
            raise ConfigError(f"CheckpointConfig.blocking must be a BlockingBudget, got {self.blocking!r}")
        if not isinstance(self.reshard, ReshardRule):
            raise ConfigError(f"CheckpointConfig.reshard must be a ReshardRule, got {self.reshard!r}")
        if self.rng_seed is not None and (not isinstance(self.rng_seed, int) or isinstance(self.rng_seed, bool)
                                          or self.rng_seed < 0):
            raise ConfigError(f"CheckpointConfig.rng_seed must be an int >= 0 or None, got {self.rng_seed!r}")
        if isinstance(self.replicated, str) or not all(isinstance(n, str) for n in self.replicated):
            raise ConfigError(
                f"CheckpointConfig.replicated must be a tuple of state item names, got {self.replicated!r}")
        object.__setattr__(self, "replicated", tuple(self.replicated))
        if self.stage_dir is not None and not isinstance(self.stage_dir, Path):
            object.__setattr__(self, "stage_dir", Path(self.stage_dir))
        if self.contract is not None and not isinstance(self.contract, RunContract):
            raise ConfigError("CheckpointConfig.contract must be a RunContract or None")
        if self.retention is not None and not callable(getattr(self.retention, "keep", None)):
            raise ConfigError("CheckpointConfig.retention must be a policy (KeepLast, KeepEvery, a | b) or None")
        for name in ("async_gpu_bytes", "async_host_bytes"):
            value = getattr(self, name)
            if value is None and name == "async_host_bytes":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"CheckpointConfig.{name} must be an int >= 0 (bytes), got {value!r}")
        idle = self.async_pool_idle_s
        if idle is not None and (isinstance(idle, bool) or not isinstance(idle, (int, float)) or not idle > 0):
            raise ConfigError(f"CheckpointConfig.async_pool_idle_s must be > 0 seconds or None, got {idle!r}")
        if self.publish_checksums is not None and not isinstance(self.publish_checksums, bool):
            raise ConfigError(
                f"CheckpointConfig.publish_checksums must be True, False or None (auto), got {self.publish_checksums!r}"
            )
        if not isinstance(self.proof, ProofPlan):
            raise ConfigError(f"CheckpointConfig.proof must be a ProofPlan, got {self.proof!r}")
        if not isinstance(self.health, HealthPolicy):
            raise ConfigError(f"CheckpointConfig.health must be a HealthPolicy, got {self.health!r}")
        if self.stale_temp_age_s <= 0:
            raise ConfigError("CheckpointConfig.stale_temp_age_s must be > 0")
