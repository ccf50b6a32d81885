"""Which step a restore loads, agreed by every rank before anything is read (``resolve``).

Modes (``ResumeMode``): AUTO (the tracker's step; an absent or empty root is a declared fresh
start; steps without a tracker, or a tracker naming an uncommitted step, raise), MUST, NEVER,
or an explicit ``path``. Every rank resolves the same step and finds its own files, or every
rank raises (``agree_files``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._agree import Wire, gather_decide
from .._context import Context
from .._disk import layout as _layout
from .._records import manifest as _manifest
from .._records import trust as _trust
from .._records.manifest import files_needed, safe_member
from .._types import JsonObject
from ..config import ReshardRule, ResumeMode
from ..errors import (
    CheckpointError,
    RankDisagreementError,
    TopologyMismatchError,
    error_payload,
    rebuild,
)
from . import reshard as _reshard
from .resolve_local import Resolution, resolve_local

log = logging.getLogger("ckptguard")


@dataclass(frozen=True)
class ResolveView(Wire):
    """What one rank resolved: step and directory, or its error."""

    step: int = 0
    path: str | None = None
    error: dict[str, Any] | None = None
    published: list[int] = field(
        default_factory=list
    )  # node-local: newer steps this node holds published


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
    ctx: Context,
    mode: ResumeMode,
    path: Path | None,
    *,
    prefer: _trust.Prefer = _trust.Prefer.LATEST,
) -> Resolution:
    """resolve_local on every rank, then agreement on the step and on every rank's files."""
    res: Resolution | None = None
    try:
        res = resolve_local(ctx.root, ctx.naming, mode, path, prefer)
        # Only for the tracker's step: under prefer="verified" a node resolving an older verified
        # step holds newer committed steps by design, which are no sign of a save stopped between
        # trackers.
        latest = path is None and mode is not ResumeMode.NEVER and prefer is _trust.Prefer.LATEST
        newer = _published_newer(ctx, res) if latest else []
        view = ResolveView(res.step, str(res.path) if res.path else None, published=newer)
    except (
        Exception
    ) as exc:  # any local failure is shipped, so no rank waits for a peer that raised
        view = ResolveView(error=error_payload(exc))
    agreed = gather_decide(
        ctx.agreement, "resolve.step", view, same_checkpoint, decision=AgreedStep
    )
    assert res is not None
    if agreed.step != res.step:
        res = Resolution(
            agreed.step,
            ctx.root / ctx.naming.name(agreed.step),
            f"the other nodes' trackers say {agreed.step}; this node's says {res.step}, and it "
            f"holds step {agreed.step} published (a save was stopped between the nodes' trackers)",
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
            + ". Every rank must see the same root (shared storage, or the "
            "same files on each node)."
        )
    newest = max(v.step for v in views)
    if all(v.step == newest or newest in v.published for v in views) and any(
        v.step != newest for v in views
    ):
        return AgreedStep(newest)  # node-local roots: a save stopped between the nodes' trackers
    # Compare step and directory name: node-local roots may sit at different paths.
    if len({(v.step, v.path and Path(v.path).name) for v in views}) > 1:
        listing = "; ".join(f"rank {r}: step {v.step} at {v.path}" for r, v in enumerate(views))
        raise RankDisagreementError(
            f"ranks resolved different checkpoints ({listing}); fix the storage so every "
            f"rank sees the same tracker"
        )
    return AgreedStep(newest)


def _reraise_same(errors: dict[int, JsonObject]) -> CheckpointError:
    """Every rank raises the lowest failing rank's error (its class, message and fields)."""
    rank = min(errors)
    return rebuild(errors[rank], note=f"(rank {rank}) " if len(errors) < 2 or rank else "")


def agree_files(ctx: Context, res: Resolution) -> None:
    """Each rank checks the files it will read; all raise together if any lacks one."""
    assert res.path is not None
    manifest = _manifest.read(res.path)
    src = source_rank(ctx, manifest)
    problems: list[str] = []
    error: dict[str, str] | None = None
    wanted = {f.path for f in manifest.files if f.path.startswith(_layout.STATE_DIR + "/")}
    wanted.add(_layout.extras_name(src))
    if by_item(ctx, manifest):  # a user rule reads every old rank's extras
        wanted |= {_layout.extras_name(r) for r in range(manifest.world_size)}
    if (
        manifest.world_size == ctx.world
    ):  # same layout: only this rank's shards (node-local storage)
        try:
            wanted = files_needed(res.path, manifest, src)
        except CheckpointError as exc:  # e.g. unsafe metadata: every rank raises this same error
            error = error_payload(exc)

    for f in [f for f in manifest.files if f.path in wanted]:
        p = safe_member(res.path, f.path)
        if p is None:
            problems.append(
                f"the manifest lists {f.path!r}, which leaves {res.path}; run `ckptguard verify`"
            )
        elif not p.exists():
            problems.append(f"missing {p}")
        elif p.stat().st_size != f.size:
            problems.append(f"{p} has {p.stat().st_size} bytes, manifest says {f.size}")
    view = FilesView(ctx.agreement.info.host, problems[:5], error)

    def decide(views: list[FilesView]) -> Agreed:
        errors = {r: v.error for r, v in enumerate(views) if v.error}
        if errors:
            raise _reraise_same(errors)
        bad = {r: v for r, v in enumerate(views) if v.problems}
        if bad:
            raise RankDisagreementError(
                f"step {res.step} at {res.path} is incomplete on some ranks: "
                + "; ".join(
                    f"rank {r} (host {v.host}): {', '.join(v.problems)}" for r, v in bad.items()
                )
                + ". With node-local checkpoints every rank's node needs its files: copy "
                "them there before launch."
            )
        return Agreed()

    gather_decide(ctx.agreement, "resolve.files", view, decide, decision=Agreed)


def source_rank(ctx: Context, manifest: _manifest.Manifest) -> int:
    """Whose extras this rank reads (under BY_ITEM: whose skeletons of the tensor items)."""
    old = manifest.world_size
    if old == ctx.world or ctx.config.reshard.rule is ReshardRule.REFUSE:
        return ctx.rank
    return _reshard.skeleton_rank(
        manifest, ctx.expert.rank if ctx.expert is not None else None
    )  # BY_ITEM


def by_item(ctx: Context, manifest: _manifest.Manifest) -> bool:
    return manifest.world_size != ctx.world and ctx.config.reshard.rule is ReshardRule.BY_ITEM


def check_topology(ctx: Context, manifest: _manifest.Manifest) -> None:
    """The saved topology against this run's: equal, or a change the reshard rule allows (logged);
    else raised."""
    saved = manifest.topology.shape()
    now = ctx.topology()
    if saved == now:
        return
    if saved.get("ep", 1) != now.get("ep", 1):
        raise TopologyMismatchError(
            f"{manifest.path.parent} was saved with {saved}; this run has {now}. The "
            f"expert-parallel size changed ({saved.get('ep', 1)} -> {now.get('ep', 1)}), which is "
            f"never resharded: experts are stored per EP rank (<key>#ep<r>), and a new EP size "
            f"would need a rule that regroups the experts of every old EP rank onto the new ones, "
            f"with their optimizer state, and re-derives the expert-parallel RNG. Restore with "
            f"ep={saved.get('ep', 1)} (the data-parallel size may change under "
            f"ReshardRule.BY_ITEM), or convert the checkpoint offline."
        )
    if ctx.config.reshard.rule is ReshardRule.REFUSE:
        raise TopologyMismatchError(
            f"{manifest.path.parent} was saved with {saved}; this run has {now}. Restore with the "
            f"same world size and layout, or set "
            f"CheckpointConfig(reshard=ReshardOptions(rule=ReshardRule.BY_ITEM)) to let DCP "
            f"reshard tensor state and every per-rank item follow its declared rule (a DataCursor, "
            f"replicated=..., PerRank(value, reshard=f), rng_seed=...)."
        )
    log.warning(
        "ckptguard: resharding %s -> %s: tensors through DCP, per-rank items by their rules",
        saved,
        now,
    )
