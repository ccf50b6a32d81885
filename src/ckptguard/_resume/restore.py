"""The resume side: decide which step (``resolve``), then load it exactly (``restore``).

Contract: the decision is made by every rank from what it sees on disk, then agreed;
ranks that see different steps, or a rank missing its files, make every rank raise
together. A guessed fresh start is never an outcome: a fresh start happens only when
the root does not exist, when the tracker says 0, or under ResumeMode.NEVER, and it is
logged as a warning. Restore checks versions, topology, contract and keys (both ways)
before reading any tensor, and the restored items' digests after.
"""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from .._context import Context
from .._disk import layout as _layout
from .._disk.digest import digest, file_digest
from .._dist import Wire, gather_decide, on_every_rank
from .._records import contract as _contract
from .._records import manifest as _manifest
from .._records import trust as _trust
from .._records.checks import files_needed, safe_member
from .._state import rng as _rng
from .._state import state as _state
from .._state.rng import RNG_ITEM
from ..config import ReshardRule, ResumeMode
from ..errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointIncompleteError,
    CheckpointNotFoundError,
    RankDisagreementError,
    ResumeError,
    StateMismatchError,
    TopologyMismatchError,
    UnsafeCheckpointError,
    error_payload,
    rebuild,
)
from ..storage._staging import release_host_cache
from . import layoutfree as _layoutfree
from . import reshard as _reshard

log = logging.getLogger("ckptguard")


@dataclass(frozen=True)
class Resolution:
    """Which checkpoint a restore would load, and why."""

    step: int
    """The step to resume from (0 for a fresh start)."""
    path: Path | None
    """The committed step directory, or None for a fresh start."""
    reason: str
    """One sentence: why this step."""
    mode: ResumeMode

    @property
    def fresh(self) -> bool:
        return self.path is None

    def describe(self) -> str:
        if self.fresh:
            return f"FRESH START at step 0: {self.reason}"
        return f"resume from step {self.step} at {self.path}: {self.reason}"


def resolve_local(
    root: Path,
    naming: _layout.StepNaming,
    mode: ResumeMode,
    path: Path | None,
    prefer: _trust.Prefer = _trust.Prefer.LATEST,
    *,
    read_manifest: Callable[[Path], Any] = _manifest.read,
) -> Resolution:
    """What this rank sees on disk; raises ResumeError rather than guessing.

    ``read_manifest`` reads a step's commit marker (an object with ``step``) or raises: a run
    of several roles passes its own, which also refuses a step missing a role (``ckptguard.run``)."""
    if path is not None:
        step_dir = Path(path)
        _layout.refuse_link(step_dir, "step directory")  # a link may lead outside every root
        if not step_dir.is_dir():
            raise CheckpointNotFoundError(
                f"restore(path={str(path)!r}): no such directory; pass a committed step directory"
            )
        manifest = read_manifest(step_dir)
        return Resolution(manifest.step, step_dir, "explicit path", mode)
    if mode is ResumeMode.NEVER:
        count = len(_layout.step_dirs(root, naming))
        return Resolution(0, None, f"ResumeMode.NEVER; {count} step directories under {root} ignored", mode)
    if not root.exists():
        if mode is ResumeMode.MUST:
            raise ResumeError(
                f"ResumeMode.MUST: checkpoint root {root} does not exist; "
                "check the path (it is never created by restore)"
            )
        return Resolution(
            0, None, f"checkpoint root {root} does not exist (it was not created; the first save creates it)", mode
        )
    tracker = _layout.read_tracker(root)
    dirs = _layout.step_dirs(root, naming)
    if tracker is None:
        if dirs:
            raise ResumeError(
                f"{root} holds step directories {sorted(dirs)[-3:]} but no tracker "
                f"{_layout.TRACKER_NAME}; ckptguard writes the tracker before any step, so "
                "something outside it removed the tracker or wrote these steps. Inspect the "
                "root, then restore(path=...) the step you trust or move the steps away."
            )
        if mode is ResumeMode.MUST:
            raise ResumeError(f"ResumeMode.MUST: {root} has no tracker and no checkpoint")
        return Resolution(0, None, f"{root} exists but holds no checkpoint and no tracker", mode)
    if tracker == 0:
        if mode is ResumeMode.MUST:
            raise ResumeError(f"ResumeMode.MUST: the tracker in {root} says 0 (no step committed yet)")
        orphans = f"; uncommitted step directories {sorted(dirs)} are ignored" if dirs else ""
        return Resolution(0, None, f"tracker in {root} says 0: fresh start declared by the first save{orphans}", mode)
    step_dir = root / naming.name(tracker)
    _layout.refuse_link(step_dir, f"step directory of the tracker's step {tracker}")
    try:
        manifest = read_manifest(step_dir)
    except UnsafeCheckpointError:
        raise  # a link or a FIFO in place of the manifest: refused as such, not as "not committed"
    except (CheckpointNotFoundError, CheckpointError) as exc:
        raise ResumeError(
            f"the tracker in {root} points at step {tracker}, but {step_dir} is not a committed "
            f"checkpoint ({exc}). ckptguard never moves the tracker before the commit, so the "
            "directory was changed afterwards (deleted, copied partially, node-local disk). "
            "Restore the files, or restore(path=...) an older committed step explicitly."
        ) from exc
    if manifest.step != tracker:
        raise ResumeError(f"{step_dir}/manifest.json says step {manifest.step} but the tracker says {tracker}")
    res = Resolution(tracker, step_dir, f"tracker {_layout.TRACKER_NAME} says {tracker}", mode)
    return _prefer_verified(root, naming, res, read_manifest) if prefer is _trust.Prefer.VERIFIED else res


def _prefer_verified(
    root: Path, naming: _layout.StepNaming, res: Resolution, read_manifest: Callable[[Path], Any] = _manifest.read
) -> Resolution:
    """prefer='verified': the newest verified committed step no newer than the tracker (module doc of trust)."""
    try:
        trust = _trust.read(root)
    except CheckpointCorruptError as exc:
        raise ResumeError(f"prefer='verified' under {root}: {exc}") from None
    for step in sorted((s for s in trust if s <= res.step), reverse=True):
        if _trust.state(trust[step]) is not _trust.Trust.VERIFIED:
            continue
        step_dir = root / naming.name(step)
        try:
            if step_dir.is_symlink() or read_manifest(step_dir).step != step:
                continue
        except CheckpointError:
            continue  # deleted or damaged since it was verified: the next older one
        newer = "" if step == res.step else (
            f"; the tracker's step {res.step} and the steps between are not verified: resuming here is a "
            "rollback (saving those steps again needs CheckpointConfig(overwrite=True))")
        return Resolution(step, step_dir, f"prefer='verified': step {step} is the newest verified step{newer}",
                          res.mode)
    entry = trust.get(res.step)
    if entry is not None and entry.get("unhealthy_after") is not None:
        raise ResumeError(
            f"prefer='verified' under {root}: no committed step is verified, and the tracker's step {res.step} was "
            f"followed by the unhealthy step {entry['unhealthy_after']}. Restore an older step with "
            "restore(path=...), or resume it anyway with prefer='latest'"
        )
    return Resolution(res.step, res.path, f"{res.reason}; prefer='verified': no step is verified yet, and no "
                      f"unhealthy step followed step {res.step} ({_trust.describe(entry)})", res.mode)


@dataclass(frozen=True)
class ResolveView(Wire):
    """What one rank resolved: step and directory, or its error."""

    step: int = 0
    path: str | None = None
    error: dict[str, Any] | None = None
    published: list[int] = field(default_factory=list)  # node-local: newer steps this node holds published


@dataclass(frozen=True)
class AgreedStep(Wire):
    """The step every rank restores; differs from a rank's own only on node-local roots whose
    trackers a killed save left apart (see ``_published_newer``)."""

    step: int = 0


@dataclass(frozen=True)
class FilesView(Wire):
    """The problems one rank found with the files it will read, or its error."""

    host: str
    problems: list[str] = field(default_factory=list)
    error: dict[str, Any] | None = None


@dataclass(frozen=True)
class Problems(Wire):
    problems: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Agreed(Wire):
    """Rank 0's verdict: every rank may go on (a disagreement is raised instead)."""


def resolve(
    ctx: Context, mode: ResumeMode, path: Path | None, *, prefer: _trust.Prefer = _trust.Prefer.LATEST
) -> Resolution:
    """resolve_local on every rank, then agreement on the step and on every rank's files."""
    res: Resolution | None = None
    try:
        res = resolve_local(ctx.root, ctx.naming, mode, path, prefer)
        # Only for the tracker's step: under prefer="verified" a node resolving an older verified step
        # holds newer committed steps by design, which are no sign of a save stopped between trackers.
        latest = path is None and mode is not ResumeMode.NEVER and prefer is _trust.Prefer.LATEST
        newer = _published_newer(ctx, res) if latest else []
        view = ResolveView(res.step, str(res.path) if res.path else None, published=newer)
    except Exception as exc:  # any local failure is shipped, so no rank waits for a peer that raised
        view = ResolveView(error=error_payload(exc))
    agreed = gather_decide(ctx.agreement, "resolve.step", view, same_checkpoint, decision=AgreedStep)
    assert res is not None
    if agreed.step != res.step:
        res = Resolution(
            agreed.step,
            ctx.root / ctx.naming.name(agreed.step),
            f"the other nodes' trackers say {agreed.step}; this node's says {res.step}, and it holds step "
            f"{agreed.step} published (a save was stopped between the nodes' trackers)",
            mode,
        )
    if not res.fresh:
        agree_files(ctx, res)
    return res


def _published_newer(ctx: Context, res: Resolution) -> list[int]:
    """Steps newer than this rank's tracker that its node holds published on node-local roots.

    Per-node publish writes the global manifest on a node only after every node confirmed its
    part, and moves the trackers one node after another; a kill between them leaves some
    trackers at the new step and the others' nodes holding it published. Such a step is the
    resume target only when another node's tracker names it (see ``same_checkpoint``)."""
    if not ctx.root.is_dir():
        return []
    try:
        tracker = _layout.read_tracker(ctx.root)
    except CheckpointError:
        tracker = None
    floor = res.step if tracker is None else tracker
    out = []
    for step, step_dir in sorted(_layout.step_dirs(ctx.root, ctx.naming).items()):
        if step <= floor:
            continue
        try:
            manifest = _manifest.read(step_dir)
        except CheckpointError:
            continue
        if manifest.nodes and manifest.step == step:
            out.append(step)
    return out


def same_checkpoint(views: list[ResolveView]) -> AgreedStep:
    errors = {r: v.error for r, v in enumerate(views) if v.error}
    if errors:
        if len(errors) == len(views):
            raise _reraise_same(errors)
        raise RankDisagreementError(
            "ranks could not all resolve a checkpoint: "
            + "; ".join(f"rank {r}: {e['message']}" for r, e in errors.items())
            + ". Every rank must see the same root (shared storage, or the same files on each node)."
        )
    newest = max(v.step for v in views)
    if all(v.step == newest or newest in v.published for v in views) and any(v.step != newest for v in views):
        return AgreedStep(newest)  # node-local roots: a save stopped between the nodes' trackers
    # Compare step and directory name: node-local roots may sit at different paths.
    if len({(v.step, v.path and Path(v.path).name) for v in views}) > 1:
        listing = "; ".join(f"rank {r}: step {v.step} at {v.path}" for r, v in enumerate(views))
        raise RankDisagreementError(
            f"ranks resolved different checkpoints ({listing}); fix the storage so every rank sees the same tracker"
        )
    return AgreedStep(newest)


def _reraise_same(errors: dict[int, dict[str, Any]]) -> CheckpointError:
    """Every rank raises the lowest failing rank's error (its class, message and fields)."""
    rank = min(errors)
    return rebuild(errors[rank], note=f"(rank {rank}) " if len(errors) < 2 or rank else "")


def _source_rank(ctx: Context, manifest: _manifest.Manifest) -> int:
    """Whose extras this rank reads (under BY_ITEM: whose skeletons of the tensor items)."""
    old = manifest.world_size
    if old == ctx.world or ctx.config.reshard is ReshardRule.REFUSE:
        return ctx.rank
    if ctx.config.reshard is ReshardRule.BY_ITEM:
        return _reshard.skeleton_rank(manifest, ctx.expert.rank if ctx.expert is not None else None)
    if ctx.config.reshard is ReshardRule.EXTRAS_FROM_RANK0:
        return 0
    return ctx.rank % old


def _by_item(ctx: Context, manifest: _manifest.Manifest) -> bool:
    return manifest.world_size != ctx.world and ctx.config.reshard is ReshardRule.BY_ITEM


def agree_files(ctx: Context, res: Resolution) -> None:
    """Each rank checks the files it will read; all raise together if any lacks one."""
    assert res.path is not None
    manifest = _manifest.read(res.path)
    src = _source_rank(ctx, manifest)
    problems: list[str] = []
    error: dict[str, str] | None = None
    wanted = {f["path"] for f in manifest.files if f["path"].startswith(_layout.STATE_DIR + "/")}
    wanted.add(_layout.extras_name(src))
    if _by_item(ctx, manifest):  # a user rule reads every old rank's extras
        wanted |= {_layout.extras_name(r) for r in range(manifest.world_size)}
    if manifest.world_size == ctx.world:  # same layout: only this rank's shards (node-local storage)

        try:
            wanted = files_needed(res.path, manifest, src)
        except CheckpointError as exc:  # e.g. unsafe metadata: every rank raises this same error
            error = error_payload(exc)

    for f in [f for f in manifest.files if f["path"] in wanted]:
        p = safe_member(res.path, f["path"])
        if p is None:
            problems.append(f"the manifest lists {f['path']!r}, which leaves {res.path}; run `ckptguard verify`")
        elif not p.exists():
            problems.append(f"missing {p}")
        elif p.stat().st_size != f["size"]:
            problems.append(f"{p} has {p.stat().st_size} bytes, manifest says {f['size']}")
    view = FilesView(ctx.agreement.info.host, problems[:5], error)

    def decide(views: list[FilesView]) -> Agreed:
        errors = {r: v.error for r, v in enumerate(views) if v.error}
        if errors:
            raise _reraise_same(errors)
        bad = {r: v for r, v in enumerate(views) if v.problems}
        if bad:
            raise RankDisagreementError(
                f"step {res.step} at {res.path} is incomplete on some ranks: "
                + "; ".join(f"rank {r} (host {v.host}): {', '.join(v.problems)}" for r, v in bad.items())
                + ". With node-local checkpoints every rank's node needs its files: copy them there before launch."
            )
        return Agreed()

    gather_decide(ctx.agreement, "resolve.files", view, decide, decision=Agreed)


# ---------------------------------------------------------------- restore


def _check_topology(ctx: Context, manifest: _manifest.Manifest) -> None:
    saved = {k: v for k, v in manifest.topology.items() if k not in ("rank_hosts", "ep_ranks")}
    now = ctx.topology()
    if saved == now:
        return
    if saved.get("ep", 1) != now.get("ep", 1):
        raise TopologyMismatchError(
            f"{manifest.path.parent} was saved with {saved}; this run has {now}. The expert-parallel size changed "
            f"({saved.get('ep', 1)} -> {now.get('ep', 1)}), which is never resharded: experts are stored per EP "
            "rank (<key>#ep<r>), and a new EP size would need a rule that regroups the experts of every old EP "
            "rank onto the new ones, with their optimizer state, and re-derives the expert-parallel RNG. "
            f"Restore with ep={saved.get('ep', 1)} (the data-parallel size may change under "
            "ReshardRule.BY_ITEM), or convert the checkpoint offline."
        )
    if ctx.config.reshard is ReshardRule.REFUSE:
        raise TopologyMismatchError(
            f"{manifest.path.parent} was saved with {saved}; this run has {now}. Restore with the "
            "same world size and layout, or set CheckpointConfig(reshard=ReshardRule.BY_ITEM) to let "
            "DCP reshard tensor state and every per-rank item follow its declared rule (a DataCursor, "
            "replicated=..., PerRank(value, reshard=f), rng_seed=...)."
        )
    if ctx.config.reshard is not ReshardRule.BY_ITEM:
        log.warning("ckptguard: resharding %s -> %s under the legacy %s: per-rank state is copied from other "
                    "ranks, and `ckptguard prove` will not prove this resume; use ReshardRule.BY_ITEM",
                    saved, now, ctx.config.reshard.value)
    else:
        log.warning("ckptguard: resharding %s -> %s: tensors through DCP, per-rank items by their rules", saved, now)


def _some(keys: list[str], n: int = 8) -> str:
    return f"{keys[:n]}{' ...' if len(keys) > n else ''}"


def _check_keys(name: str, saved_keys: set[str], live_keys: set[str], ckpt_keys: set[str]) -> list[str]:
    """Both ways: every live key must be stored (DCP has it, and this rank saved it), and
    every key this rank saved must be live. Keys of other ranks (per-rank or per-EP-rank
    names) are theirs, judged on their own rank."""
    problems = []
    if missing := sorted((live_keys - ckpt_keys) | (live_keys - saved_keys)):
        problems.append(f"item {name!r}: keys the model expects but the checkpoint lacks: {_some(missing)}")
    if unexpected := sorted(saved_keys - live_keys):
        problems.append(f"item {name!r}: keys in the checkpoint the model does not have: {_some(unexpected)}")
    return problems


def plan_targets(
    ctx: Context, state: dict[str, Any], manifest: _manifest.Manifest, extras: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Compare items and keys both ways; return (targets, flat tensors for DCP)."""
    step_dir = manifest.path.parent
    problems = []
    if missing := sorted(set(state) - set(manifest.items)):
        problems.append(
            f"items requested but absent from the checkpoint: {missing} (there is never a silent fresh start for them)"
        )
    if unexpected := sorted(set(manifest.items) - set(state)):
        problems.append(f"items in the checkpoint not given to restore: {unexpected} (pass them, or they are lost)")
    try:
        targets = _state.restore_targets({k: v for k, v in state.items() if k in manifest.items}, ctx.keyfn())
        ckpt_keys = set(ctx.storage.read_metadata(step_dir / _layout.STATE_DIR).state_dict_metadata)
    except Exception as exc:  # reported through the plan exchange below, like any mismatch
        problems.append(f"{type(exc).__name__}: {exc}")
        targets, ckpt_keys = {}, set()
    flat: dict[str, torch.Tensor] = {}
    for name, (kind, _sd, live) in targets.items():
        if kind.value != manifest.items[name]:
            saved_kind = manifest.items[name]
            if "value" in (kind.value, saved_kind):
                # A plain value is a snapshot: the caller passes one of the type it saved and reads
                # the restored one back from the state dict (a float does not become a tensor).
                problems.append(
                    f"item {name!r} was saved as a {saved_kind} and is passed as a {kind.value} now: pass the "
                    "same type the run saved (e.g. a float for a float) and read it back from the state after restore"
                )
            else:
                problems.append(f"item {name!r} is a {kind.value} now but was saved as a {saved_kind}")
            continue
        saved_keys = _state.tensor_keys(extras["items"][name])
        problems += _check_keys(name, saved_keys, set(live), ckpt_keys)
        flat.update(live)
    def decide(views: list[Problems]) -> Agreed:
        bad = {r: v.problems for r, v in enumerate(views) if v.problems}
        if bad:
            r0 = min(bad)
            raise StateMismatchError(
                f"restore of step {manifest.step} from {step_dir}: the state does not match the "
                f"checkpoint (rank {r0}: {'; '.join(bad[r0])}). Restore into objects like the saving run's "
                "(modules and optimizers built the same way, plain values of the same type)."
            )
        return Agreed()

    gather_decide(ctx.agreement, "restore.plan", Problems(problems[:20]), decide, decision=Agreed)
    return targets, flat


@dataclass(frozen=True)
class Restored:
    step: int
    format_version: int
    # per rank (tensor items on the same layout: their skeleton; their tensors are in layout_free_match);
    # resharded: the extras items against their source rank
    digests_match: dict[str, bool]
    layout_free_match: dict[str, bool] = field(default_factory=dict)  # tensor items, any layout
    source_rank: int = 0  # whose extras (and RNG) this rank took
    saved_world_size: int = 0
    reshard: dict[str, Any] | None = None  # resharded: old -> new world, rules, this rank's RNG digest


def precheck(
    ctx: Context, res: Resolution, state: dict[str, Any]
) -> tuple[_manifest.Manifest, dict[str, Any], _reshard.Plan | None]:
    """Everything decided before a byte of tensor state is read: versions, topology, chain,
    contract, and this rank's extras (loaded with weights_only; resharded under BY_ITEM: built
    by every item's rule, or refused naming the items without one)."""
    assert res.path is not None
    manifest = _manifest.read(res.path)
    _manifest.check_torch_version(manifest, allow_newer=ctx.config.allow_newer_torch)
    _check_topology(ctx, manifest)
    where = f"restore of step {manifest.step} from {res.path}"
    _contract.check_chain(ctx.root, manifest.chain_id, where=where)
    _contract.check(ctx.root, ctx.config.contract, where=where)
    _check_external_files(ctx, manifest)
    if _by_item(ctx, manifest):
        plan = _reshard.prepare(ctx, manifest, state, lambda r: _load_extras(ctx, res.path, manifest, r))
        return manifest, plan.extras, plan
    return manifest, _load_extras(ctx, res.path, manifest, _source_rank(ctx, manifest)), None


def _load_extras(ctx: Context, step_dir: Path | None, manifest: _manifest.Manifest, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s extras file of the step, loaded with weights_only and checked against the manifest."""
    assert step_dir is not None
    extras_path = step_dir / _layout.extras_name(rank)
    try:
        extras = torch.load(extras_path, weights_only=True, map_location="cpu")
        items = extras.get("items") if isinstance(extras, dict) else None
        items = items if isinstance(items, dict) else {}
        if not set(manifest.items) <= set(items):
            # Checked here, inside the precheck every rank agrees on: a KeyError later would strand the others.
            raise CheckpointCorruptError(
                f"{extras_path} (rank {ctx.rank}) is not the extras file ckptguard wrote for this step (its "
                f"'items' table lacks {sorted(set(manifest.items) - set(items))[:4]}); "
                "restore an earlier step"
            )
        loaded: dict[str, Any] = extras
        return loaded
    except FileNotFoundError:
        raise CheckpointIncompleteError(
            f"{extras_path} is missing (rank {ctx.rank}); restore an earlier step"
        ) from None
    except (pickle.UnpicklingError, RuntimeError) as exc:
        raise UnsafeCheckpointError(
            f"{extras_path} (rank {ctx.rank}) does not load with torch.load(weights_only=True): {exc}. "
            "It was not written by ckptguard or was changed; do not load it unsafely: restore an earlier step."
        ) from None


def _check_external_files(ctx: Context, manifest: _manifest.Manifest) -> None:
    """Size and xxh3 of every file the manifest lists outside ``state/`` and the extras (a
    framework's own files, committed through ``ExternalFiles``), before the caller hands the
    directory to that framework: a changed byte in HF's ``optimizer.pt`` would otherwise load
    silently. The ranks split the files (shared storage); a failure reaches every rank through
    the precheck agreement, naming the file."""
    step_dir = manifest.path.parent
    ours = {_layout.extras_name(r) for r in range(manifest.world_size)}
    files = sorted(
        (f for f in manifest.files if not f["path"].startswith(_layout.STATE_DIR + "/") and f["path"] not in ours),
        key=lambda f: (-int(f["size"]), f["path"]),
    )
    mine = files[ctx.rank :: ctx.world]
    index = manifest.node_of(ctx.rank)
    if index is not None:  # node-local roots: this node's ranks check the files on this node's disk
        ranks = sorted(manifest.nodes[index]["ranks"]) if manifest.nodes else [ctx.rank]
        here = {f["path"] for f in manifest.node_files(index)}
        mine = [f for f in files if f["path"] in here][ranks.index(ctx.rank) :: len(ranks)]
    if not mine:
        return

    started = time.monotonic()
    for f in mine:
        path = safe_member(step_dir, f["path"])
        where = f"external file {path or f['path']} of step {manifest.step} (checked on rank {ctx.rank})"
        if path is None or not path.is_file():
            raise CheckpointIncompleteError(
                f"{where} is listed in the manifest but {'leaves the step directory' if path is None else 'absent'}; "
                "restore an earlier step (restore(path=...)) or copy the file back, then run `ckptguard verify`"
            )
        size, xxh3 = file_digest(str(path))
        if size != f["size"] or xxh3 != f["xxh3"]:
            raise CheckpointCorruptError(
                f"{where} has {size} bytes and xxh3 {xxh3}, the manifest says {f['size']} bytes and xxh3 "
                f"{f['xxh3']}: it changed after the commit and is not handed to the framework. Restore an earlier "
                "step (restore(path=...)) or copy the file back from where it was written"
            )
    log.info(
        "ckptguard: rank %d checked %d external files of step %d (%d bytes) in %.2f s",
        ctx.rank, len(mine), manifest.step, sum(int(f["size"]) for f in mine), time.monotonic() - started,
    )


def restore(ctx: Context, state: dict[str, Any], res: Resolution, on_verified: Any = None) -> Restored:
    manifest, extras, plan = on_every_rank(ctx.agreement, "restore.precheck", lambda: precheck(ctx, res, state))
    assert res.path is not None
    targets, flat = plan_targets(ctx, state, manifest, extras)
    if flat:
        try:
            ctx.storage.read(res.path / _layout.STATE_DIR, flat, ctx.storage_ctx)
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException; all ranks get it
            detail = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise CheckpointCorruptError(
                f"reading the tensor state of step {manifest.step} from {res.path} failed on rank {ctx.rank}: "
                f"{detail}. If shapes differ, restore into objects built like the saving run's; otherwise "
                "run `ckptguard verify --deep` on the step."
            ) from exc
    def apply() -> None:
        for name, (kind, _sd, live) in targets.items():
            _state.apply(state, name, kind, extras["items"][name], live)
        if ctx.config.restore_rng and extras.get("rng") is not None:
            _rng.restore(extras["rng"], where=f"restore of step {manifest.step}, rank {ctx.rank}")

    on_every_rank(ctx.agreement, "restore.applied", apply)
    resharded = _resharded_record(ctx, manifest, plan)
    matches: dict[str, bool] = {}
    layout_free: dict[str, bool] = {}
    source = _source_rank(ctx, manifest)
    if ctx.config.verify_restored:
        if manifest.world_size == ctx.world:
            matches = _verify_digests(ctx, state, manifest, targets, extras, on_verified)
        # Any layout: tensor items through the layout-free digest; resharded: extras against their source
        # rank, or (BY_ITEM) against what their rule gives.
        expected = plan.expected if plan is not None else None
        same = manifest.world_size == ctx.world
        checked = _layoutfree.verify(
            ctx, state, manifest, targets, extras, source, on_verified, expected=expected,
            explain=(lambda: _changed_files(manifest, ctx.rank)) if same else None,
        )
        matches.update(checked.items)
        layout_free = checked.layout_free
        release_host_cache()  # digests of GPU tensors staged through pinned chunks
    return Restored(
        manifest.step, manifest.format_version, matches, layout_free, source, manifest.world_size, resharded
    )


def _resharded_record(ctx: Context, manifest: _manifest.Manifest, plan: _reshard.Plan | None) -> dict[str, Any] | None:
    """The proof record's ``reshard`` field: old -> new world, the rules, and this rank's RNG streams.
    Under BY_ITEM the streams are checked distinct across ranks first (collective)."""
    if manifest.world_size == ctx.world:
        return None
    if plan is not None:
        return plan.record(_reshard.confirm(ctx, plan))

    rng = digest(_rng.capture()) if ctx.config.restore_rng and RNG_ITEM in manifest.digests.get("0", {}) else None
    src = "rank 0" if ctx.config.reshard is ReshardRule.EXTRAS_FROM_RANK0 else f"rank r % {manifest.world_size}"
    return {"mode": ctx.config.reshard.value, "from": manifest.world_size, "to": ctx.world,
            "rules": {"(every per-rank item)": f"copied from old {src}"}, "rng": rng}


def _verify_digests(
    ctx: Context,
    state: dict[str, Any],
    manifest: _manifest.Manifest,
    targets: dict[str, Any],
    extras: dict[str, Any],
    on_verified: Any,
) -> dict[str, bool]:
    """Recompute every item's digest from the live objects; all ranks raise if any differs."""
    saved = manifest.digests.get(str(ctx.rank), {})
    problems = []
    matches: dict[str, bool] = {}
    by_layout_free = _layout_free_items(ctx, manifest, targets, extras)
    for name, (kind, _sd, _live) in targets.items():
        if name in by_layout_free:
            # Its tensors are compared by the layout-free pass that follows (on the GPU for GPU tensors);
            # here everything else: the structure, the keys and every non-tensor leaf, against the
            # extras file whose xxh3 matched the manifest.
            matches[name] = _skeleton_digest(ctx, name, kind, state) == digest(extras["items"][name])
            if not matches[name]:
                problems.append(
                    f"state item {name!r} ({kind.value}) differs after restore from what was saved (its structure "
                    "or a non-tensor value such as a hyperparameter). Do not train on: fix the object's "
                    "load_state_dict, or restore into an object built with the saved configuration."
                )
            continue
        structure = not manifest.digest_covers_bytes(name)
        if structure and manifest.layout_free is None:
            # Its saved digest does not cover the tensor bytes and nothing else recorded does: never a pass.
            raise CheckpointCorruptError(
                f"restore of step {manifest.step} from {manifest.path.parent}: item {name!r} records only a "
                "structure digest (format 3) and the manifest has no layout-free digests for its tensors, so "
                "its bytes cannot be compared; the manifest was edited: restore an earlier step"
            )
        try:
            # structure: the tensor bytes are compared by the layout-free pass that follows
            _state.check_restored(name, kind, state[name], state, saved.get(name, ""), structure=structure)
            matches[name] = True
        except StateMismatchError as exc:
            problems.append(str(exc))
            matches[name] = False
    if extras.get("rng") is not None and RNG_ITEM in saved:
        matches["rng"] = digest(_rng.capture()) == saved[RNG_ITEM]
        # With restore_rng off the streams differ by choice: recorded for the proof, not raised.
        if not matches["rng"] and ctx.config.restore_rng:
            problems.append("the RNG streams differ from the saved ones after restore")
    if on_verified is not None:
        on_verified(matches)  # the proof record is written even when the restore then raises
    if problems:  # the files first: a damaged shard reads as "fix load_state_dict" otherwise
        problems = _changed_files(manifest, ctx.rank) + problems

    def decide(views: list[Problems]) -> Agreed:
        bad = {r: v.problems for r, v in enumerate(views) if v.problems}
        if bad:
            raise StateMismatchError(
                f"restore of step {manifest.step}: " + " | ".join(f"rank {r}: {'; '.join(p)}" for r, p in bad.items())
            )
        return Agreed()

    gather_decide(ctx.agreement, "restore.verify", Problems(problems), decide, decision=Agreed)
    return matches


_TENSOR_KINDS = (_state.ItemKind.MODULE, _state.ItemKind.OPTIMIZER, _state.ItemKind.TENSORS)


def _layout_free_items(
    ctx: Context, manifest: _manifest.Manifest, targets: dict[str, Any], extras: dict[str, Any]
) -> set[str]:
    """Tensor items whose per-rank xxh3 pass the restore may skip (same layout only).

    The xxh3 digest of an item hashes every tensor byte again after the read, through a D2H
    copy for GPU tensors: on a 6 GiB state a second of restore. The layout-free pass that runs
    anyway covers each tensor's dtype, global shape and bytes by DCP key (a missing or extra key
    differs too); what it does not cover, the skeleton (structure and non-tensor leaves), came
    from this rank's extras file. So an item qualifies when the save recorded its layout-free
    digests and that extras file's size and xxh3 still match the manifest (a changed
    hyperparameter in the file would otherwise be applied and compared with itself). Otherwise
    the full xxh3 digest is compared, as before."""
    lf = manifest.layout_free
    if not lf:
        return set()

    rel = _layout.extras_name(_source_rank(ctx, manifest))
    entry = next((f for f in manifest.files if f.get("path") == rel), None)
    path = safe_member(manifest.path.parent, rel)
    if entry is None or path is None or not path.is_file():
        return set()
    if file_digest(str(path)) != (entry.get("size"), entry.get("xxh3")):
        return set()  # the full digests below then say which items differ
    return {
        name for name, (kind, _sd, _flat) in targets.items()
        if kind in _TENSOR_KINDS and name in lf and name in extras.get("items", {})
    }


def _skeleton_digest(ctx: Context, name: str, kind: _state.ItemKind, state: dict[str, Any]) -> str:
    """The item as it is now with each tensor replaced by its DCP key, as the save's skeleton holds it."""
    skeleton = _state.flatten(_state.current_state(name, state[name], kind, state), name, {}, ctx.keyfn())
    return digest(skeleton)


def _changed_files(manifest: _manifest.Manifest, rank: int) -> list[str]:
    """When an item's digest differs, say whether the bytes on disk changed since the save.

    A flipped byte in a shard otherwise reads as "fix load_state_dict"; the files' xxh3 tell
    the two apart. Only this rank's files and the shared ones are hashed (what it read)."""

    step_dir = manifest.path.parent
    changed = []
    for entry in manifest.files:
        if entry.get("rank") not in (None, rank) and not str(entry.get("path", "")).startswith("state/"):
            continue
        path = safe_member(step_dir, str(entry.get("path", "")))
        if path is None or not path.is_file():
            continue
        if file_digest(str(path))[1] != entry.get("xxh3"):
            changed.append(str(path))
    if not changed:
        return ["the files' checksums still match the manifest, so the difference comes from the restore path"]
    return [
        f"file(s) changed on disk since the save (xxh3 differs from the manifest): {', '.join(changed[:5])}; "
        f"the checkpoint is damaged, not the code: run `ckptguard verify --deep {step_dir}` and "
        "restore(path=<an older committed step>)"
    ]
