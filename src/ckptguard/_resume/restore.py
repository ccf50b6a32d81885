"""The resume side: decide which step (``resolve``), then load it exactly (``restore``).

Contract: the decision is made by every rank from what it sees on disk, then agreed;
ranks that see different steps, or a rank missing its files, make every rank raise
together. A guessed fresh start is never an outcome: a fresh start happens only when
the root does not exist, when the tracker says 0, or under ResumeMode.NEVER, and it is
logged as a warning. Restore checks versions, topology, contract and keys (both ways)
before reading any tensor, and the restored items' digests after.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.api import CheckpointException

from .._agree import gather_decide, on_every_rank
from .._context import Context
from .._disk import layout as _layout
from .._disk.digest import digest, file_digest, release_host_cache
from .._records import contract as _contract
from .._records import manifest as _manifest
from .._records.entries import FileEntry
from .._records.manifest import safe_member
from .._state import rng as _rng
from .._state import state as _state
from .._state.rng import RNG_ITEM
from .._types import JsonObject, StateDict
from ..errors import (
    CheckpointError,
    StateMismatchError,
)
from ..storage._pool import ReadAhead, default_limit
from ..storage.dcp import check_torch_version
from ..storage.streaming import StreamingStorage
from . import layoutcheck as _layoutcheck
from . import reshard as _reshard
from .refusals import (
    DAMAGED,
    changed_files,
    digests_differ,
    external_changed,
    external_missing,
    extras_foreign,
    extras_missing,
    extras_unsafe,
    kind_changed,
    plan_refused,
    read_failed,
    skeleton_differs,
    some,
    structure_only,
    unlisted_external,
)
from .resolve_agreed import Agreed, Problems, by_item, check_topology, source_rank
from .resolve_local import Resolution

log = logging.getLogger("ckptguard")


# ---------------------------------------------------------------- restore


def _check_keys(
    name: str, saved_keys: set[str], live_keys: set[str], ckpt_keys: set[str]
) -> list[str]:
    """Both ways: every live key must be stored (DCP has it, and this rank saved it), and
    every key this rank saved must be live. Keys of other ranks (per-rank or per-EP-rank
    names) are theirs, judged on their own rank."""
    problems = []
    if missing := sorted((live_keys - ckpt_keys) | (live_keys - saved_keys)):
        problems.append(
            f"item {name!r}: keys the model expects but the checkpoint lacks: {some(missing)}"
        )
    if unexpected := sorted(saved_keys - live_keys):
        problems.append(
            f"item {name!r}: keys in the checkpoint the model does not have: {some(unexpected)}"
        )
    return problems


def plan_targets(
    ctx: Context, state: StateDict, manifest: _manifest.Manifest, extras: StateDict
) -> tuple[_state.Targets, dict[str, torch.Tensor]]:
    """Compare items and keys both ways; return (targets, flat tensors for DCP)."""
    step_dir = manifest.path.parent
    problems = []
    if missing := sorted(set(state) - set(manifest.items)):
        problems.append(
            f"items requested but absent from the checkpoint: {missing} (there is never a "
            f"silent fresh start for them)"
        )
    if unexpected := sorted(set(manifest.items) - set(state)):
        problems.append(
            f"items in the checkpoint not given to restore: {unexpected} "
            f"(pass them, or they are lost)"
        )
    try:
        stepped = frozenset(n for n in manifest.items if _state.tensor_keys(extras["items"][n]))
        targets = _state.restore_targets(
            {k: v for k, v in state.items() if k in manifest.items}, ctx.keyfn(), stepped
        )
        ckpt_keys = set(ctx.storage.read_metadata(step_dir / _layout.STATE_DIR).state_dict_metadata)
    except CheckpointError as exc:  # the step's files, not the caller's objects: said as such below
        problems.append(f"{DAMAGED}{exc}")
        targets, ckpt_keys = {}, set()
    except Exception as exc:  # reported through the plan exchange below, like any mismatch
        problems.append(f"{type(exc).__name__}: {exc}")
        targets, ckpt_keys = {}, set()
    flat: dict[str, torch.Tensor] = {}
    for name, (kind, _sd, live) in targets.items():
        if kind.value != manifest.items[name]:
            problems.append(kind_changed(name, manifest.items[name], kind.value))
            continue
        saved_keys = _state.tensor_keys(extras["items"][name])
        problems += _check_keys(name, saved_keys, set(live), ckpt_keys)
        flat.update(live)

    def decide(views: list[Problems]) -> Agreed:
        bad = {r: v.problems for r, v in enumerate(views) if v.problems}
        if bad:
            raise plan_refused(manifest.step, step_dir, bad)
        return Agreed()

    gather_decide(ctx.agreement, "restore.plan", Problems(problems[:20]), decide, decision=Agreed)
    return targets, flat


@dataclass(frozen=True)
class Restored:
    step: int
    format_version: int
    # per rank (tensor items on the same layout: their skeleton; their tensors are in
    # layout_free_match); resharded: the extras items against their source rank
    digests_match: dict[str, bool]
    layout_free_match: dict[str, bool] = field(default_factory=dict)  # tensor items, any layout
    source_rank: int = 0  # whose extras (and RNG) this rank took
    saved_world_size: int = 0
    # resharded: old -> new world, rules, this rank's RNG digest
    reshard: dict[str, Any] | None = None
    # layoutcheck.replica_report of the restored state
    replicas: dict[str, Any] = field(default_factory=dict)


def precheck(
    ctx: Context,
    res: Resolution,
    state: StateDict,
    on_manifest: Callable[[_manifest.Manifest], None] | None = None,
) -> tuple[_manifest.Manifest, StateDict, _reshard.Plan | None]:
    """Everything decided before a byte of tensor state is read: versions, topology, chain,
    contract, and this rank's extras (loaded with weights_only; resharded under BY_ITEM: built
    by every item's rule, or refused naming the items without one). ``on_manifest``: called
    with the manifest as soon as it is read (the read-ahead starts there)."""
    assert res.path is not None
    manifest = _manifest.read(res.path)
    if on_manifest is not None:
        on_manifest(manifest)
    check_torch_version(
        manifest.versions.get("torch", "0"),
        manifest.path.parent,
        allow_newer=ctx.config.storage.allow_newer_torch,
    )
    check_topology(ctx, manifest)
    where = f"restore of step {manifest.step} from {res.path}"
    _contract.check_chain(ctx.root, manifest.chain_id, where=where)
    _contract.check(ctx.root, ctx.config.contract, where=where)
    _check_external_files(ctx, manifest)
    if by_item(ctx, manifest):
        plan = _reshard.prepare(
            ctx, manifest, state, lambda r: _load_extras(ctx, res.path, manifest, r)
        )
        return manifest, plan.extras, plan
    return manifest, _load_extras(ctx, res.path, manifest, source_rank(ctx, manifest)), None


class Extras(dict[str, Any]):
    """A rank's extras file as loaded; ``intact``: the bytes loaded had the size and xxh3 the
    manifest lists for the file (then the skeleton check may compare against it:
    ``_layout_free_items``)."""

    intact = False


def _listed_bytes(path: Path, entry: FileEntry | None) -> bytes | None:
    """The file's bytes when the manifest lists it and the sizes agree (read once, bounded by that
    size: loaded and hashed from memory), else None: a link, another size or an unlisted file is
    read by torch.load itself, and the full digests judge what it holds."""
    if entry is None:
        return None
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode) or st.st_size != entry.size:
        return None
    return _layout.read_small(path, limit=entry.size, what="extras file")


def _load_extras(
    ctx: Context, step_dir: Path | None, manifest: _manifest.Manifest, rank: int
) -> Extras:
    """Rank ``rank``'s extras file of the step, loaded with weights_only and checked against the
    manifest."""
    assert step_dir is not None
    extras_path = step_dir / _layout.extras_name(rank)
    entry = next((f for f in manifest.files if f.path == _layout.extras_name(rank)), None)
    try:
        data = _listed_bytes(extras_path, entry)
        extras = torch.load(
            extras_path if data is None else io.BytesIO(data), weights_only=True, map_location="cpu"
        )
        items = extras.get("items") if isinstance(extras, dict) else None
        items = items if isinstance(items, dict) else {}
        if not set(manifest.items) <= set(items):
            # Checked here, inside the precheck every rank agrees on: a KeyError later would strand
            # the others.
            raise extras_foreign(
                extras_path, ctx.rank, sorted(set(manifest.items) - set(items))[:4]
            )
        loaded = Extras(extras)
        loaded.intact = (
            data is not None
            and entry is not None
            and (len(data), xxhash.xxh3_64_hexdigest(data)) == (entry.size, entry.xxh3)
        )
        return loaded
    except FileNotFoundError:
        raise extras_missing(extras_path, ctx.rank) from None
    except (pickle.UnpicklingError, RuntimeError) as exc:
        raise extras_unsafe(extras_path, ctx.rank, exc) from None


def _check_external_files(ctx: Context, manifest: _manifest.Manifest) -> None:
    """Size and xxh3 of every file the manifest lists outside ``state/`` and the extras (a
    framework's own files, committed through ``ExternalFiles``), before the caller hands the
    directory to that framework: a changed byte in HF's ``optimizer.pt`` would otherwise load
    silently. The ranks split the files (shared storage); a failure reaches every rank through
    the precheck agreement, naming the file."""
    step_dir = manifest.path.parent
    ours = {_layout.extras_name(r) for r in range(manifest.world_size)}
    files = sorted(
        (
            f
            for f in manifest.files
            if not f.path.startswith(_layout.STATE_DIR + "/") and f.path not in ours
        ),
        key=lambda f: (-f.size, f.path),
    )
    mine = files[ctx.rank :: ctx.world]
    index = manifest.node_of(ctx.rank)
    if index is not None:  # node-local roots: this node's ranks check the files on this node's disk
        ranks = sorted(manifest.nodes[index].ranks) if manifest.nodes else [ctx.rank]
        here = {f.path for f in manifest.node_files(index)}
        mine = [f for f in files if f.path in here][ranks.index(ctx.rank) :: len(ranks)]
    _refuse_unlisted(step_dir, manifest, {f.path.split("/", 1)[0] for f in files if "/" in f.path})
    if not mine:
        return

    started = time.monotonic()
    for f in mine:
        path = safe_member(step_dir, f.path)
        where = (
            f"external file {path or f.path} of step {manifest.step} (checked on rank {ctx.rank})"
        )
        if path is None or not path.is_file():
            raise external_missing(where, path)
        size, xxh3 = file_digest(str(path))
        if size != f.size or xxh3 != f.xxh3:
            raise external_changed(where, size, xxh3, f)
    log.info(
        "ckptguard: rank %d checked %d external files of step %d (%d bytes) in %.2f s",
        ctx.rank,
        len(mine),
        manifest.step,
        sum(f.size for f in mine),
        time.monotonic() - started,
    )


def _refuse_unlisted(step_dir: Path, manifest: _manifest.Manifest, folders: set[str]) -> None:
    """The framework reads an external folder whole (HF's ``hf/``): a file planted there that the
    manifest does not list would be loaded unchecked, so the restore refuses it, naming it."""
    listed = {f.path for f in manifest.files}
    for folder in sorted(folders):
        for base, dirs, names in os.walk(step_dir / folder, followlinks=False):
            for name in sorted(names) + sorted(
                d for d in dirs if os.path.islink(os.path.join(base, d))
            ):
                rel = os.path.relpath(os.path.join(base, name), step_dir)
                if rel not in listed:
                    raise unlisted_external(step_dir, rel, folder, manifest.step)


def _read_ahead(ctx: Context, manifest: _manifest.Manifest, into: list[ReadAhead]) -> None:
    """This rank's data file read ahead while the checks and the plan run (``ReadAhead``); on the
    saving world size only, where the file a rank wrote is the file it reads first."""
    mine = [
        f
        for f in manifest.files
        if f.rank == ctx.rank and f.path.startswith(_layout.STATE_DIR + "/")
    ]
    big = max(mine, key=lambda f: f.size, default=None)
    path = (
        safe_member(manifest.path.parent, big.path)
        if big and manifest.world_size == ctx.world
        else None
    )
    # The streaming storage's read threads and page-cache choice (plain DCP's reader keeps the
    # cache).
    cfg = ctx.storage.config if isinstance(ctx.storage, StreamingStorage) else None
    if big is not None and path is not None:
        into.append(
            ReadAhead(
                path,
                limit=min(default_limit(), big.size),
                streams=cfg.read_threads if cfg else 4,
                drop=cfg.drop_page_cache if cfg else False,
            ).start()
        )


def restore(ctx: Context, state: StateDict, res: Resolution, on_verified: Any = None) -> Restored:
    ahead: list[ReadAhead] = []
    try:
        manifest, extras, plan = on_every_rank(
            ctx.agreement,
            "restore.precheck",
            lambda: precheck(ctx, res, state, partial(_read_ahead, ctx, into=ahead)),
        )
        assert res.path is not None
        targets, flat = plan_targets(ctx, state, manifest, extras)
        if flat:
            try:
                ctx.storage.read(res.path / _layout.STATE_DIR, flat, ctx.storage_ctx)
            except (Exception, CheckpointException) as exc:
                # DCP's CheckpointException is a BaseException; all ranks get it.
                raise read_failed(manifest.step, res.path, ctx.rank, exc) from exc
    finally:
        for a in ahead:
            a.close()

    def apply() -> None:
        for name, (kind, _sd, live) in targets.items():
            _state.apply(state, name, kind, extras["items"][name], live)
        if ctx.config.state.restore_rng and extras.get("rng") is not None:
            _rng.restore(extras["rng"], where=f"restore of step {manifest.step}, rank {ctx.rank}")

    on_every_rank(ctx.agreement, "restore.applied", apply)
    resharded = _resharded_record(ctx, manifest, plan)
    matches: dict[str, bool] = {}
    layout_free: dict[str, bool] = {}
    replicas: dict[str, Any] = {}
    source = source_rank(ctx, manifest)
    if ctx.config.state.verify_restored:
        # The live objects read once: every check compares it.
        now = _state.read_back(state, targets, ctx.keyfn())
        if manifest.world_size == ctx.world:
            matches = _verify_digests(ctx, now, manifest, extras, on_verified)
        # Any layout: tensor items through the layout-free digest; resharded: extras against their
        # source rank, or (BY_ITEM) against what their rule gives.
        expected = plan.expected if plan is not None else None
        same = manifest.world_size == ctx.world
        checked = _layoutcheck.verify(
            ctx,
            now,
            manifest,
            extras,
            source,
            on_verified,
            expected=expected,
            explain=(lambda: changed_files(manifest, ctx.rank)) if same else None,
        )
        matches.update(checked.items)
        layout_free, replicas = checked.layout_free, checked.replicas
        release_host_cache()  # digests of GPU tensors staged through pinned chunks
    return Restored(
        manifest.step,
        manifest.format_version,
        matches,
        layout_free,
        source,
        manifest.world_size,
        resharded,
        replicas,
    )


def _resharded_record(
    ctx: Context, manifest: _manifest.Manifest, plan: _reshard.Plan | None
) -> JsonObject | None:
    """The proof record's ``reshard`` field: old -> new world, the rules, and this rank's RNG
    streams. Under BY_ITEM the streams are checked distinct across ranks first (collective)."""
    # A plan exists whenever the world changed (BY_ITEM).
    if manifest.world_size == ctx.world or plan is None:
        return None
    return plan.record(_reshard.confirm(ctx, plan))


def _verify_digests(
    ctx: Context,
    now: dict[str, _state.Captured],
    manifest: _manifest.Manifest,
    extras: StateDict,
    on_verified: Any,
) -> dict[str, bool]:
    """Every item's digest from the live objects (``now``: read back once); all ranks raise if any
    differs."""
    saved = manifest.digests.get(str(ctx.rank), {})
    problems = []
    matches: dict[str, bool] = {}
    by_layout_free = _layout_free_items(ctx, manifest, now, extras)
    for name, item in now.items():
        kind = item.kind
        if name in by_layout_free:
            # Its tensors are compared by the layout-free pass that follows (on the GPU for GPU
            # tensors); here everything else: the structure, the keys and every non-tensor leaf,
            # against the extras file whose xxh3 matched the manifest.
            matches[name] = digest(item.skeleton) == digest(extras["items"][name])
            if not matches[name]:
                problems.append(
                    skeleton_differs(name, kind.value, extras["items"][name], item.skeleton)
                )
            continue
        structure = not manifest.digest_covers_bytes(name)
        if structure and manifest.layout_free is None:
            # Its saved digest does not cover the tensor bytes and nothing else recorded does: never
            # a pass.
            raise structure_only(manifest, name)
        try:
            # structure: the tensor bytes are compared by the layout-free pass that follows
            _state.check_restored(item, saved.get(name, ""), structure=structure)
            matches[name] = True
        except StateMismatchError as exc:
            problems.append(str(exc))
            matches[name] = False
    if extras.get("rng") is not None and RNG_ITEM in saved:
        matches["rng"] = digest(_rng.capture()) == saved[RNG_ITEM]
        # With restore_rng off the streams differ by choice: recorded for the proof, not raised.
        if not matches["rng"] and ctx.config.state.restore_rng:
            problems.append("the RNG streams differ from the saved ones after restore")
    if on_verified is not None:
        on_verified(matches)  # the proof record is written even when the restore then raises
    if problems:  # the files first: a damaged shard reads as "fix load_state_dict" otherwise
        problems = changed_files(manifest, ctx.rank) + problems

    def decide(views: list[Problems]) -> Agreed:
        bad = {r: v.problems for r, v in enumerate(views) if v.problems}
        if bad:
            raise digests_differ(manifest.step, bad)
        return Agreed()

    gather_decide(ctx.agreement, "restore.verify", Problems(problems), decide, decision=Agreed)
    return matches


_TENSOR_KINDS = (_state.ItemKind.MODULE, _state.ItemKind.OPTIMIZER, _state.ItemKind.TENSORS)


def _layout_free_items(
    ctx: Context, manifest: _manifest.Manifest, now: dict[str, _state.Captured], extras: StateDict
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
    if not lf or not getattr(extras, "intact", False):
        # the full digests below then say which items differ (the file was hashed as it was loaded)
        return set()
    return {
        name
        for name, item in now.items()
        if item.kind in _TENSOR_KINDS and name in lf and name in extras.get("items", {})
    }
