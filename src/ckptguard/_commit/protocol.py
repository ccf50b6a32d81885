"""The save side of the File contract: write everything, agree, then publish.

Protocol (DESIGN.md, "Commit protocol"):

1. Rank 0 prepares: the root and, on a new root, tracker 0 and contract phase 0; it sweeps
   temp directories whose owner died and creates ``.tmp-<step>-<nonce>/``.
2. Every rank writes its DCP shards and its extras there (or into ``stage_dir`` first,
   then copies with checksum verification) and reports success or its first error.
3. If any rank failed, every rank raises the same CheckpointWriteError; the tracker
   does not move.
4. Rank 0 writes ``manifest.json`` (temp, fsync, rename), uncommits an orphan or
   overwritten directory of the same step, renames the temp directory, fsyncs the root
   and replaces the tracker. Every rank learns the outcome before returning.
"""

from __future__ import annotations

import errno as _errno
import logging
import os
import secrets
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.api import CheckpointException

from .. import _faults
from .._dist import Agreement, Wire, gather_decide, on_every_rank
from .._resume import contract as _contract
from .._resume import rng as _rng
from .._resume.digest import combine_layout_free, digest, file_digest
from .._resume.expert import ExpertParallel
from .._resume.state import Captured, capture, digest_kind, digests_and_layout_free
from ..config import CheckpointConfig
from ..errors import (
    CheckpointError,
    CheckpointWriteError,
    ConfigError,
    ReplicatedDivergenceError,
    StateMismatchError,
    WriteFailure,
)
from ..storage.base import Storage, StorageContext, WrittenFile
from ..storage.unpickler import read_dcp_metadata
from . import layout as _layout
from . import lease as _lease
from . import manifest as _manifest
from . import p2p as _p2p

log = logging.getLogger("ckptguard")

RNG_ITEM = "_rng"
FAILED_PREFIX = ".failed-"


@dataclass
class Context:
    """Everything a save or restore needs, resolved once by the manager."""

    root: Path
    config: CheckpointConfig
    naming: _layout.StepNaming
    agreement: Agreement
    storage: Storage
    storage_ctx: StorageContext
    expert: ExpertParallel | None = None
    last_save: tuple[int, float] | None = None  # (step, monotonic end) of this process's last save
    node_publisher: bool = False  # the last save was on node-local roots and this rank published its node's part

    @property
    def rank(self) -> int:
        return self.agreement.info.rank

    @property
    def world(self) -> int:
        return self.agreement.info.world_size

    def topology(self) -> dict[str, Any]:
        layout = self.config.layout.as_dict() if self.config.layout else {"dp": self.world, "tp": 1, "pp": 1, "ep": 1}
        if self.expert is not None:
            layout["ep"] = self.expert.size
        return {"world_size": self.world, **layout}

    def keyfn(self) -> Any:
        return self.expert.key if self.expert is not None else (lambda key: key)


# ---------------------------------------------------------------- messages between ranks


@dataclass(frozen=True)
class ChunkDigests(Wire):
    """One rank's digest of every tensor chunk it holds, keyed ``key@offset``."""

    chunks: dict[str, str]
    kinds: dict[str, str] = field(default_factory=dict)  # item -> ItemKind value


@dataclass(frozen=True)
class ChunkVerdict(Wire):
    """Chunks held by several ranks with different bytes: ``[chunk, [[ranks alike], ...]]``, and
    items whose kind differs across ranks: ``[item, {kind: [ranks]}]``."""

    bad: list[list[Any]]
    kinds: list[list[Any]] = field(default_factory=list)


@dataclass(frozen=True)
class PrepareRequest(Wire):
    step: int
    root: str = ""
    node: str = ""


@dataclass(frozen=True)
class Prepared(Wire):
    """Rank 0's reply to prepare: the temp directory and the contract phase in force, or its failure."""

    tmp: str = ""
    chain_id: str = ""
    phase: int = 0
    contract_hash: str = ""
    failure: dict[str, Any] | None = None
    nodes: list[list[int]] = field(default_factory=list)  # node-local roots: each node's ranks; empty: shared


@dataclass(frozen=True)
class RankReport(Wire):
    """What one rank wrote (files with sizes and checksums, per-item digests), or its first error."""

    host: str
    files: list[dict[str, Any]] = field(default_factory=list)
    digests: dict[str, str] = field(default_factory=dict)
    ep_rank: int | None = None
    failure: dict[str, Any] | None = None
    layout_free: dict[str, list[str]] = field(default_factory=dict)  # item -> partials (see digest.layout_free)
    reshard: dict[str, dict[str, Any]] = field(default_factory=dict)  # item -> declared reshard rule


@dataclass(frozen=True)
class Outcome(Wire):
    """Rank 0's publish outcome: no failures means committed."""

    failures: list[dict[str, Any]] = field(default_factory=list)
    phase: str = "write"
    consequence: str = ""  # where the resume target stands after the failure, when not NOT_MOVED


def failure_from(exc: BaseException, *, rank: int, phase: str) -> WriteFailure:
    """The first error of this rank with errno and path, digging through DCP's wrapper."""
    collateral = False
    if isinstance(exc, CheckpointException):
        mine = exc.failures.get(rank)
        if mine is None:
            collateral = True
        else:
            exc = mine[0] if isinstance(mine, tuple) else mine  # DCP wraps (exc, traceback)
    root = exc
    while root.__cause__ is not None and not isinstance(root, OSError):
        root = root.__cause__
    oserr = root if isinstance(root, OSError) else None
    return WriteFailure(
        rank=rank,
        phase=phase + (" (another rank failed first)" if collateral else ""),
        exc_type=type(root).__name__,
        message=str(root)[:2000],
        errno=oserr.errno if oserr else None,
        path=str(oserr.filename) if oserr and oserr.filename else None,
        offset=getattr(root, "offset", None),
        requested_bytes=getattr(root, "requested_bytes", None),
        returned_bytes=getattr(root, "returned_bytes", None),
        time_ns=time.time_ns() + (10**18 if collateral else 0),
    )


NOT_MOVED = (
    "the tracker was not moved, so the previous committed step stays the resume target. Fix the cause (disk "
    "space, permissions, storage health) and save again."
)


def _raise_if_failed(
    ctx: Context, shipped: list[dict[str, Any]], *, step: int, phase: str, consequence: str = NOT_MOVED
) -> None:
    failures = [WriteFailure.from_json(f) for f in shipped]
    if not failures:
        return
    first = min(failures, key=lambda f: (f.time_ns, f.rank))
    raise CheckpointWriteError(
        f"save of step {step} under {ctx.root} failed at {phase}; first error: {first.describe()}. "
        f"All {ctx.world} ranks raise this together; {consequence}",
        step=step,
        failures=failures,
    )


# ---------------------------------------------------------------- step 0: guard


def _chunk_id(key: str, t: torch.Tensor) -> str:
    """Where DCP files this rank's piece of ``key``: the key and the chunk's global offset."""
    if hasattr(t, "device_mesh") and hasattr(t, "placements"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)[1]
        return f"{key}@{tuple(int(o) for o in offsets)}"
    return f"{key}@{(0,) * t.dim()}"


def _divergent_chunks(views: list[ChunkDigests]) -> ChunkVerdict:
    holders: dict[str, dict[str, list[int]]] = {}
    for rank, view in enumerate(views):
        for chunk, dig in view.chunks.items():
            holders.setdefault(chunk, {}).setdefault(dig, []).append(rank)
    kinds: dict[str, dict[str, list[int]]] = {}
    for rank, view in enumerate(views):
        for item, kind in view.kinds.items():
            kinds.setdefault(item, {}).setdefault(kind, []).append(rank)
    for item in kinds:
        absent = [r for r, v in enumerate(views) if item not in v.kinds]
        if absent:
            kinds[item]["absent"] = absent
    return ChunkVerdict(
        [[c, sorted(g.values())] for c, g in sorted(holders.items()) if len(g) > 1],
        [[item, by_kind] for item, by_kind in sorted(kinds.items()) if len(by_kind) > 1],
    )


def check_replicated(ctx: Context, items: dict[str, Captured], step: int) -> None:
    """Refuse two ranks holding the same (key, offset) chunk with different bytes.

    DCP keeps one copy per (key, offset): a plain tensor that differs per rank, or an
    expert shard whose FSDP offset repeats in another EP group, would come back as some
    other rank's bytes, silently.
    """
    if ctx.world == 1:
        return
    mine = ChunkDigests(
        {_chunk_id(k, t): digest(t) for c in items.values() for k, t in c.tensors.items()},
        {name: c.kind.value for name, c in items.items()},
    )
    verdict = gather_decide(ctx.agreement, "save.chunks", mine, _divergent_chunks, decision=ChunkVerdict)
    if verdict.kinds:
        # Committed, such a step could not be restored by any fresh process: one rank's
        # extras hold a value where the DCP files hold a tensor.
        listing = "; ".join(
            f"{item!r}: "
            + ", ".join(f"{kind} on rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}" for kind, r in by.items())
            for item, by in verdict.kinds
        )
        raise StateMismatchError(
            f"save of step {step}: state items differ in kind across ranks ({listing}); every rank must pass "
            "the same items with the same kinds (wrap per-rank values in ckptguard.PerRank(...))"
        )
    bad = [(c, g) for c, g in verdict.bad]
    if not bad:
        return
    plain = [
        f"{c.rsplit('@', 1)[0]} (ranks grouped by content: {g})"
        for c, g in bad
        if c.endswith("@()") or set(c.rsplit("@", 1)[1].strip("(),").replace(" ", "").split(",")) <= {"0", ""}
    ]
    shown = plain if len(plain) == len(bad) else [f"{c} (ranks grouped by content: {g})" for c, g in bad]
    raise ReplicatedDivergenceError(
        f"save of step {step}: {len(bad)} tensor chunk(s) are held by several ranks with different bytes, and DCP "
        f"stores one copy per key and offset, so restore would hand them one rank's copy: {'; '.join(shown[:10])}"
        f"{' ...' if len(bad) > 10 else ''}. Wrap per-rank values in ckptguard.PerRank(...), make them DTensors, "
        "or, for expert-parallel state, pass CheckpointManager(expert_parallel=ExpertParallel(group=ep_group)) "
        "so expert keys carry the EP rank."
    )


# ---------------------------------------------------------------- step 1: prepare


def _prepare_root(ctx: Context, step: int, *, like: Prepared | None = None) -> Prepared:
    """Rank 0 (or, on node-local roots, each node's publishing rank, ``like`` rank 0's outcome):
    root, tracker 0, phase 0, sweep, existing-step check, temp directory."""
    root = ctx.root
    root.mkdir(parents=True, exist_ok=True)
    # The lease first: a second writer is refused before it changes anything in the root.
    note = _lease.acquire(root, ttl_s=ctx.config.lease_ttl_s, override=ctx.config.break_lease)
    if note:
        log.warning("ckptguard: %s: %s", root, note)
    if _layout.read_tracker(root) is None:
        # Declared fresh start first: "steps but no tracker" then never comes from us.
        _layout.write_tracker(root, 0)
    phases = _contract.read_phases(root)
    if not phases:
        # Every node's root carries rank 0's chain: one run, one chain id on every disk.
        chain = like.chain_id if like is not None else uuid.uuid4().hex
        _contract.write_phase(root, 0, _contract.initial_phase(chain, ctx.config.contract))
    phase = _contract.check(root, ctx.config.contract, where=f"save of step {step}")
    if like is not None and (phase["chain_id"], phase["phase"]) != (like.chain_id, like.phase):
        raise ConfigError(
            f"save of step {step}: this node's root {root} is at run chain {phase['chain_id']} phase {phase['phase']}, "
            f"rank 0's at chain {like.chain_id} phase {like.phase}: the node-local roots belong to different runs. "
            "Give every node of this run the root of this run (or empty ones for a new run)."
        )
    _layout.sweep_temp_dirs(root, max_age_s=ctx.config.stale_temp_age_s)
    name = ctx.naming.name(step)
    existing = root / name
    tracker = _layout.read_tracker(root) or 0
    if step < tracker and not ctx.config.overwrite:
        raise ConfigError(
            f"save of step {step} under {root}: the tracker is at step {tracker}; saving an older step would "
            "move it back and orphan the newer ones. If this is a deliberate rollback, set "
            "CheckpointConfig(overwrite=True); otherwise check the step counter after restore."
        )
    committed = existing.exists() and step <= tracker and (existing / _layout.MANIFEST_NAME).exists()
    if committed and not ctx.config.overwrite:
        raise ConfigError(
            f"step {step} is already committed at {existing}; saving it again would replace "
            "it. Save a different step, or set CheckpointConfig(overwrite=True) to replace it "
            "(it is uncommitted first, then rewritten)."
        )
    # Node-local roots: every node's temp directory has rank 0's name (and, once published, the step's).
    tmp = root / (Path(like.tmp).name if like is not None else _layout.temp_dir_name(name, secrets.token_hex(6)))
    tmp.mkdir()
    (tmp / _layout.STATE_DIR).mkdir()
    _layout.write_owner(tmp, node=ctx.agreement.info.host)
    return Prepared(
        tmp=str(tmp), chain_id=phase["chain_id"], phase=phase["phase"], contract_hash=phase["contract_hash"]
    )


@dataclass(frozen=True)
class PlaceView(Wire):
    """Whether this rank finds rank 0's temp directory at its own root: the same disk, or another."""

    sees: bool


@dataclass(frozen=True)
class NodeReport(Wire):
    """One node's publishing rank's outcome of a per-node phase (others send an empty one)."""

    failure: dict[str, Any] | None = None
    tracker: int | None = None  # the publishing rank's tracker on its node's root (at prepare; after the tracker round)
    tracker_error: str = ""  # after the tracker round: why the tracker could not be read back


@dataclass(frozen=True)
class NodesSeen(Wire):
    """Rank 0's verdict on the node placement: failures, or the newest tracker of any node."""

    failures: list[dict[str, Any]] = field(default_factory=list)
    newest: int = 0


def _prepare(ctx: Context, step: int) -> Prepared:
    nodes: dict[str, list[int]] = {}  # rank 0 only: node -> ranks, from the requests

    def decide(requests: list[PrepareRequest]) -> Prepared:
        steps = [r.step for r in requests]
        if len(set(steps)) > 1:
            raise ConfigError(
                f"ranks called save with different steps {steps} (index = rank); every rank must save the same step"
            )
        for rank, r in enumerate(requests):
            nodes.setdefault(r.node, []).append(rank)
        for node, ranks in nodes.items():
            roots = {requests[r].root for r in ranks}
            if len(roots) > 1:
                # One node, one disk: ranks of a node write into the one temp directory of that node.
                listing = "; ".join(f"rank {r}: {requests[r].root}" for r in ranks)
                raise ConfigError(
                    f"save of step {step}: ranks of node {node} passed different checkpoint roots ({listing}). "
                    "Every rank of a node must pass the same root: storage they all share, or the node's own "
                    "node-local disk (each node then publishes its own ranks' files)"
                )
        try:
            return _prepare_root(ctx, step)
        except CheckpointError:
            raise
        except Exception as exc:  # an OSError of the root: reported like a write failure, with errno and path
            return Prepared(failure=failure_from(exc, rank=0, phase="prepare").to_json())

    request = PrepareRequest(step, str(ctx.root.absolute()), ctx.agreement.info.host)
    prep = gather_decide(ctx.agreement, "save.prepare", request, decide, decision=Prepared)
    _raise_if_failed(ctx, [prep.failure] if prep.failure else [], step=step, phase="prepare")
    if ctx.world == 1:
        return prep
    prep = _place(ctx, step, prep, nodes)
    if prep.nodes:
        _prepare_nodes(ctx, step, prep)
    return prep


def _place(ctx: Context, step: int, prep: Prepared, nodes: dict[str, list[int]]) -> Prepared:
    """Shared root (every rank sees rank 0's temp directory) or node-local roots (each node's
    ranks see their node's disk, none sees another's); anything in between is refused."""
    name = Path(prep.tmp).name

    def decide(views: list[PlaceView]) -> Prepared:
        if all(v.sees for v in views):
            return prep
        order = sorted(nodes.values(), key=min)  # rank 0's node first; ranks ascending, the first publishes
        problems = []
        for ranks in order:
            seeing = [r for r in ranks if views[r].sees]
            node = ctx.agreement.info.host if 0 in ranks else _node_of(nodes, ranks[0])
            if seeing and len(seeing) < len(ranks):
                blind = [r for r in ranks if not views[r].sees]
                problems.append(
                    f"{_ranks(blind)} of node {node} cannot see rank 0's temp directory {name} under its root, "
                    f"which {_ranks(seeing)} of the same node see: node-local storage (a separate disk per "
                    "process at one path) under one node identity, so no node would hold its ranks' files. Give "
                    "each node its own identity (its host name) and its ranks one disk, or use one shared root"
                )
            elif seeing and 0 not in ranks:
                problems.append(
                    f"node {node} (ranks {ranks}) shares rank 0's disk while other nodes do not: a mix of shared "
                    "and node-local roots; give every node its own disk, or every rank the same shared root"
                )
        if problems:
            _discard(ctx, Path(prep.tmp))
            failure = WriteFailure(
                rank=0, phase="placement", exc_type="ConfigError", message="; ".join(problems),
                path=prep.tmp, time_ns=time.time_ns(),
            )
            return Prepared(failure=failure.to_json())
        return Prepared(prep.tmp, prep.chain_id, prep.phase, prep.contract_hash, nodes=order)

    sees = (ctx.root.absolute() / name).is_dir()
    placed = gather_decide(ctx.agreement, "save.place", PlaceView(sees), decide, decision=Prepared)
    _raise_if_failed(ctx, [placed.failure] if placed.failure else [], step=step, phase="placement")
    return placed


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _node_of(nodes: dict[str, list[int]], rank: int) -> str:
    return next(node for node, ranks in nodes.items() if rank in ranks)


def _my_node(ctx: Context, prep: Prepared) -> list[int]:
    return next(ranks for ranks in prep.nodes if ctx.rank in ranks)


def _prepare_nodes(ctx: Context, step: int, prep: Prepared) -> None:
    """Every other node's publishing rank prepares its own root like rank 0 did; all raise on a failure."""
    mine = _my_node(ctx, prep)
    leader = mine[0] == ctx.rank and ctx.rank != 0
    report = NodeReport()
    if leader:
        try:
            _prepare_root(ctx, step, like=prep)
        except Exception as exc:
            report = NodeReport(failure_from(exc, rank=ctx.rank, phase="prepare").to_json())
    outcome = gather_decide(
        ctx.agreement, "save.prepare_nodes", report, lambda rs: Outcome([r.failure for r in rs if r.failure],
                                                                        "prepare"),
        decision=Outcome,
    )
    tmp = ctx.root.absolute() / Path(prep.tmp).name
    if not outcome.failures:
        # Every rank of a node must see the temp directory its node's first rank created on the node's
        # disk; one that does not (two disks under one node identity) would write where nobody publishes.
        owner = _layout.read_owner(tmp) or {}
        seen = NodeReport()
        if owner.get("node") != ctx.agreement.info.host:
            found = f"node {owner['node']}'s" if owner.get("node") else "no"
            seen = NodeReport(WriteFailure(
                rank=ctx.rank, phase="placement", exc_type="ConfigError", path=str(tmp), time_ns=time.time_ns(),
                message=f"rank {ctx.rank} of node {ctx.agreement.info.host} finds {found} temp directory at {tmp}, "
                f"not the one rank {mine[0]} of its node created: node-local storage (a separate disk per process "
                "at one path) under one node identity. Give each node its own identity (its host name) and its "
                "ranks one disk",
            ).to_json())
        if mine[0] == ctx.rank:
            seen = NodeReport(seen.failure, _layout.read_tracker(ctx.root) or 0)
        verdict = gather_decide(
            ctx.agreement, "save.node_seen", seen,
            lambda rs: NodesSeen(
                [r.failure for r in rs if r.failure], max(r.tracker for r in rs if r.tracker is not None)
            ),
            decision=NodesSeen,
        )
        outcome = Outcome(verdict.failures, "placement")
        if not verdict.failures and mine[0] == ctx.rank:
            _sweep_unagreed(ctx, verdict.newest, step)
    if outcome.failures and mine[0] == ctx.rank and report.failure is None:
        _discard(ctx, tmp)
    _raise_if_failed(ctx, outcome.failures, step=step, phase=outcome.phase)


def _sweep_unagreed(ctx: Context, newest: int, step: int) -> None:
    """Remove this node's step directories newer than every node's tracker: a per-node save killed
    after some nodes published and before any tracker moved left them; no node resumes from them.
    A step some node's tracker reached is kept (a node whose own tracker lags still holds it: the
    resume target). The step being saved is left to the publish, which replaces it."""
    for found, path in sorted(_layout.step_dirs(ctx.root, ctx.naming).items()):
        if found <= newest or found == step:
            continue
        try:
            _layout.remove_step_dir(path)
        except OSError as exc:  # never fatal: it stays uncommitted, newer than every tracker
            log.warning("ckptguard: could not remove %s (%s); it is not a resume target", path, exc)
            continue
        log.warning(
            "ckptguard: removed %s: published on this node by a save that no node's tracker reached (killed "
            "between the nodes' publish and their trackers)", path,
        )


# ---------------------------------------------------------------- step 2: write


def _write_extras(path: Path, extras: dict[str, Any]) -> WrittenFile:
    with open(path, "wb") as f:
        torch.save(extras, f)
        f.flush()
        os.fsync(f.fileno())
    size, xxh = file_digest(str(path))
    return WrittenFile(path=path.name, size=size, xxh3=xxh)


def _copy_verified(src: Path, dst: Path, *, expect: str | None = None) -> str:
    """Copy to a temp name on the target, fsync, re-read and compare, then rename.

    The source is hashed while it is copied; the copy is hashed again from disk. ``expect``
    (a recorded xxh3) must match too. Returns the xxh3 of what was published."""
    part = dst.with_name(f"{dst.name}.part-{secrets.token_hex(4)}")
    h = xxhash.xxh3_64()
    with open(src, "rb") as fin, open(part, "wb") as fout:
        while block := fin.read(8 << 20):
            h.update(block)
            view = memoryview(block)
            while view:
                n = fout.write(view)
                view = view[n:]  # a short write continues where it stopped
        fout.flush()
        os.fsync(fout.fileno())
    copied = file_digest(str(part))[1]
    if copied != h.hexdigest() or (expect is not None and copied != expect):
        raise OSError(_errno.EIO, f"copy differs from its source or record after fsync: {src} -> {part}", str(part))
    os.replace(part, dst)
    return copied


def _write_rank(ctx: Context, step: int, tmp: Path, items: dict[str, Captured], rng: Any) -> list[WrittenFile]:
    extras = {
        "format_version": _manifest.FORMAT_VERSION,
        "step": step,
        "rank": ctx.rank,
        "kinds": {n: c.kind.value for n, c in items.items()},
        "items": {n: c.skeleton for n, c in items.items()},
        "rng": rng,
    }
    tensors = {k: t for c in items.values() for k, t in c.tensors.items()}
    stage = ctx.config.stage_dir
    if stage is None:
        files = ctx.storage.write(tmp / _layout.STATE_DIR, tensors, ctx.storage_ctx)
        files.append(_write_extras(tmp / _layout.extras_name(ctx.rank), extras))
        return files
    local = stage / tmp.name
    (local / _layout.STATE_DIR).mkdir(parents=True, exist_ok=True)
    try:
        files = ctx.storage.write(local / _layout.STATE_DIR, tensors, ctx.storage_ctx)
        files.append(_write_extras(local / _layout.extras_name(ctx.rank), extras))
        for f in files:
            _copy_verified(local / f.path, tmp / f.path)
        return files
    finally:
        shutil.rmtree(local, ignore_errors=True)


def _write_and_digest(
    ctx: Context, step: int, tmp: Path, items: dict[str, Captured], rng: Any
) -> tuple[list[WrittenFile], tuple[dict[str, str], dict[str, list[str]]]]:
    """The write and the digest pass over the same bytes, overlapped: digests in a second thread.

    Run one after the other, the digest pass added its whole time to every save; the two read
    the same (staged or live) tensors and neither changes them."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            # Both digests in one pass over the bytes: the per-rank one and the one no sharding changes.
            box["digests"] = digests_and_layout_free(items)
        except BaseException as exc:  # raised below, in the commit's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name=f"ckptguard-digest-{step}", daemon=True)
    thread.start()
    try:
        written = _write_rank(ctx, step, tmp, items, rng)
    finally:
        thread.join()
    if "error" in box:
        raise box["error"]
    return written, box["digests"]


# ---------------------------------------------------------------- step 4: publish


def _cost(ctx: Context, step: int, started: float, files: list[dict[str, Any]]) -> dict[str, Any]:
    """Size and save time, and the save as a fraction of step time (the guide's section 7)."""
    now = time.monotonic()
    step_s = None
    if ctx.last_save is not None and step > ctx.last_save[0]:
        step_s = (started - ctx.last_save[1]) / (step - ctx.last_save[0])
    return {
        "bytes": sum(int(f["size"]) for f in files),
        "save_seconds": round(now - started, 3),
        "step_seconds": round(step_s, 3) if step_s else None,
        "save_fraction_of_step": round((now - started) / step_s, 4) if step_s else None,
    }


def _build_manifest(
    ctx: Context, step: int, path: Path, prep: Prepared, started: float, reports: list[RankReport],
    kinds: dict[str, str], nodes: list[dict[str, Any]] | None = None, extra_cost: dict[str, Any] | None = None,
) -> _manifest.Manifest:
    files = [dict(f, rank=r) for r, rep in enumerate(reports) for f in rep.files]
    cost = {**_cost(ctx, step, started, files), **(extra_cost or {})}
    return _manifest.build(
        path=path,
        step=step,
        chain_id=prep.chain_id,
        dir_template=ctx.naming.template,
        topology={
            **ctx.topology(),
            "rank_hosts": [rep.host for rep in reports],
            **({"ep_ranks": [rep.ep_rank for rep in reports]} if ctx.expert is not None else {}),
        },
        items=kinds,
        files=files,
        digests={str(r): rep.digests for r, rep in enumerate(reports)},
        contract={"phase": prep.phase, "hash": prep.contract_hash},
        cost=cost,  # optional in format 1: absent in manifests written before it
        # Optional in format 1 too: per item and key, the digest no sharding changes (a resharded restore compares it).
        layout_free=combine_layout_free([rep.layout_free for rep in reports]),
        reshard=reports[0].reshard or None,  # optional in format 1: how each item crosses a world-size change
        nodes=nodes,
        # Format 3: tensor items' per-rank digests cover their structure; their bytes, layout_free above.
        digest_kind={name: digest_kind(kind) for name, kind in kinds.items()},
    )


def _publish(
    ctx: Context, step: int, tmp: Path, prep: Prepared, started: float, reports: list[RankReport],
    kinds: dict[str, str], extra_cost: dict[str, Any] | None = None, *, part: bool = False,
) -> None:
    _faults.reached("commit.before_manifest")
    manifest = _build_manifest(
        ctx, step, tmp / _layout.MANIFEST_NAME, prep, started, reports, kinds, extra_cost=extra_cost
    )
    _layout.atomic_write_json(
        manifest.path, manifest.to_json(), before_rename=lambda: _faults.reached("commit.manifest_tmp_written")
    )
    if part:  # one role's part of a run step: the run commit renames and moves the tracker (ckptguard.run)
        return
    _faults.reached("commit.before_rename")
    publish_dir(ctx, step, tmp)


def publish_dir(ctx: Context, step: int, tmp: Path) -> None:
    """Rename a temp directory whose commit marker is in place to its step name, then move the tracker."""
    trash = _rename_in(ctx, step, tmp)
    _faults.reached("commit.before_tracker")
    _layout.write_tracker(ctx.root, step)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)  # what is left is retried by empty_trash


def _rename_in(ctx: Context, step: int, tmp: Path) -> Path | None:
    """Publish ``tmp`` (its manifest in place) as the step directory; returns the trash to delete
    after the tracker moved, if a directory of this step was there."""
    _check_publish(ctx, step)
    final = ctx.root / ctx.naming.name(step)
    trash = None
    if final.exists():
        # An orphan (crash between rename and tracker) or an explicit overwrite: its old
        # files must never pair with the new ones, so it is uncommitted and moved aside
        # first; deleting it waits until after the tracker (a slow delete must not hold
        # the other ranks at the publish agreement).
        trash = _layout.uncommit_to_trash(final)
    os.rename(tmp, final)
    (final / _layout.OWNER_NAME).unlink()  # kept until now so a crash leaves a sweepable temp dir
    _layout.fsync_dir(ctx.root)
    return trash


def _check_publish(ctx: Context, step: int) -> None:
    """Right before the rename: this run still holds the lease, and no other writer moved the
    tracker past this step since prepare, so a publish never moves the tracker backwards
    (which would orphan a committed newer step) unless ``overwrite`` asked for a rollback."""
    _lease.confirm(ctx.root, step=step)
    tracker = _layout.read_tracker(ctx.root) or 0
    taken = tracker == step and (ctx.root / ctx.naming.name(step)).exists()
    if (tracker > step or taken) and not ctx.config.overwrite:
        raise ConfigError(
            f"save of step {step} under {ctx.root} is not published: the tracker moved to step {tracker} while "
            "it was written (another writer on this root); publishing would move it back and orphan the newer "
            "step. Stop the other writer; for a deliberate rollback set CheckpointConfig(overwrite=True)."
        )


def _publish_or_fail(
    ctx: Context, step: int, tmp: Path, prep: Prepared, started: float, reports: list[RankReport],
    items: dict[str, Any], extra_cost: dict[str, Any] | None = None, *, part: bool = False,
) -> Outcome:
    """Rank 0: publish if every rank wrote its part, else discard; the outcome every rank raises on."""
    # A shared root: sizes unless asked (publish_checksums None: the placement round already showed
    # every rank sees this temp directory, and a read-back of every rank's bytes on rank 0 would cost
    # one more read of the whole state per save).
    failures = [r.failure for r in reports if r.failure] or _unseen_files(
        tmp, reports, checksums=ctx.config.publish_checksums is True
    )
    if failures:
        _discard(ctx, tmp)
        return Outcome(failures, "write")
    try:
        _publish(
            ctx, step, tmp, prep, started, reports, {n: c.kind.value for n, c in items.items()}, extra_cost, part=part
        )
    except Exception as exc:
        if tmp.exists():  # refused or failed before the rename: nothing of it may linger
            _discard(ctx, tmp)
        return Outcome([failure_from(exc, rank=0, phase="publish").to_json()], "publish")
    return Outcome()


def _unseen_files(
    tmp: Path, reports: list[RankReport], *, publisher: int = 0, checksums: bool = True
) -> list[dict[str, Any]]:
    """Every file a rank reported must be where ``publisher`` publishes, with its size and checksum.

    A rank's report is what its writer saw; the publisher reads the files back from its own
    view of the temp directory. With a separate disk per node at the same path (and ranks
    that claim one node), the publisher would otherwise commit a manifest listing files that
    sit on another disk; and a file changed or truncated between its write and the publish
    (a second writer, a storage fault) would be committed under its recorded checksum."""
    out = []
    for rank, rep in enumerate(reports):
        if not rep.files:
            continue
        bad = _file_problems(tmp, rep.files, checksums=checksums)
        if bad:
            rel, why = bad[0]
            missing = all(w == "absent" for _r, w in bad)
            where = (
                "the root is node-local storage (a separate disk per node) but the ranks report one node: "
                "give each node its own identity (its host name), or use a root on storage every rank shares"
                if missing
                else "the bytes on disk are not what the rank wrote (another writer, or a storage fault): check "
                "the storage, then save again"
            )
            out.append(
                WriteFailure(
                    rank=rank,
                    phase="publish check",
                    exc_type="FileNotFoundError" if missing else "CheckpointCorruptError",
                    message=(
                        f"rank {rank} (node {rep.host}) reported {len(rep.files)} file(s) of which {len(bad)} are not "
                        f"under {tmp} as rank {publisher} (the publishing rank) reads them, e.g. {rel}: {why}; {where}"
                    ),
                    errno=_errno.ENOENT if missing else _errno.EIO,
                    path=str(tmp / rel),
                    time_ns=time.time_ns(),
                ).to_json()
            )
    return out


def _file_problems(base: Path, files: list[dict[str, Any]], *, checksums: bool = True) -> list[tuple[str, str]]:
    """(path, why) for each reported file that is not under ``base`` with its size and xxh3.

    The sizes first (one stat each), then (``checksums``) the xxh3 read back, hashed in
    parallel threads (the hash and the reads release the GIL)."""
    problems: list[tuple[str, str]] = []
    sized = []
    for f in files:
        path = base / f["path"]
        try:
            size = path.stat().st_size
        except OSError:
            problems.append((f["path"], "absent"))
            continue
        if size != int(f["size"]):
            problems.append((f["path"], f"{size} bytes, reported {f['size']}"))
        else:
            sized.append(f)
    if not sized or not checksums:
        return problems

    def hashed(f: dict[str, Any]) -> tuple[str, str] | None:
        try:
            xxh = file_digest(str(base / f["path"]))[1]
        except OSError as exc:
            return (f["path"], f"unreadable ({exc.strerror or exc})")
        return None if xxh == f["xxh3"] else (f["path"], f"xxh3 {xxh}, reported {f['xxh3']}")

    with ThreadPoolExecutor(max_workers=min(4, len(sized))) as pool:
        problems += [p for p in pool.map(hashed, sized) if p is not None]
    return problems


def _discard(ctx: Context, tmp: Path) -> None:
    """Delete a failed save's temp directory (frees what an ENOSPC needs), or keep it as
    the scene of the failure when ``keep_failed`` is set."""
    if ctx.config.keep_failed:
        try:
            os.rename(tmp, tmp.with_name(tmp.name.replace(_layout.TMP_PREFIX, FAILED_PREFIX, 1)))
            return
        except OSError:
            pass
    shutil.rmtree(tmp, ignore_errors=True)


def _release_host_cache() -> None:
    """Hand the caching host allocator's free pinned blocks back after a save (the guide:
    D2H staging stays in the pinned pool unless emptied)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
        if empty is not None:
            empty()


@dataclass
class Snapshot:
    """What a save writes, taken in the caller's thread: the blocking part of a save."""

    step: int
    items: dict[str, Captured]
    rng: Any
    started: float
    staged_bytes: int = 0
    reshard: dict[str, dict[str, Any]] = field(default_factory=dict)
    cost: dict[str, Any] = field(default_factory=dict)
    """Figures of the staging (async saves) added to the manifest's cost block."""
    read_done: Callable[[], None] | None = None
    """Called once the write and the digest pass no longer read the snapshot's tensors."""
    resumed: float | None = None
    """monotonic time the caller got control back (async saves), for the step time in the cost block."""
    guarded: bool = True
    """False: the divergence guard has not run yet; ``commit`` runs it first."""


def snapshot(ctx: Context, step: int, state: dict[str, Any], *, guard: bool = True) -> Snapshot:
    """Capture every item and the RNG streams, and run the divergence guard (``guard=False``: the
    commit runs it, on the staged copies, so an async save's caller does not wait for its digests)."""
    started = time.monotonic()

    def take() -> tuple[dict[str, Captured], Any]:
        return capture(state, ctx.keyfn()), (_rng.capture() if ctx.config.capture_rng else None)

    items, rng = on_every_rank(ctx.agreement, "save.capture", take)
    if guard:
        check_replicated(ctx, items, step)
    from .._resume.reshard import declared

    return Snapshot(step, items, rng, started, reshard=declared(state, ctx.config), guarded=guard)


def save(ctx: Context, step: int, state: dict[str, Any]) -> Path:
    return commit(ctx, snapshot(ctx, step, state))


def _report(ctx: Context, step: int, tmp: Path, snap: Snapshot) -> RankReport:
    """Write this rank's part and describe it; a failure is described instead."""
    try:
        try:
            written, (digests, layout_free) = _write_and_digest(ctx, step, tmp, snap.items, snap.rng)
        finally:
            if snap.read_done is not None:
                snap.read_done()  # live tensors (a state larger than the staging pool) may change now
        if snap.rng is not None:
            digests[RNG_ITEM] = digest(snap.rng)
        report = RankReport(
            ctx.agreement.info.host,
            [f.__dict__ for f in written],
            digests,
            ctx.expert.rank if ctx.expert else None,
            layout_free=layout_free,
            reshard=snap.reshard,
        )
        _faults.reached("commit.rank_written")
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException; report all
        report = RankReport(ctx.agreement.info.host, failure=failure_from(exc, rank=ctx.rank, phase="write").to_json())
    _release_host_cache()
    return report


def commit(ctx: Context, snap: Snapshot, *, part: Prepared | None = None) -> Path:
    """Steps 1 to 4 of the protocol for a snapshot; in the caller's or a background thread.

    ``part``: write the snapshot as one role's part of a run step into ``part.tmp`` (prepared by
    the run's commit, ``ckptguard.run``) and stop after its manifest: the run commit renames the
    step directory and moves the tracker once every role on every rank confirmed. Returns ``part.tmp``."""
    step, items = snap.step, snap.items
    if not snap.guarded:
        check_replicated(ctx, items, step)  # collective: every rank raises alike, before prepare
    if part is not None:
        prep, tmp = part, Path(part.tmp)
    else:
        prep = _prepare(ctx, step)
        # This rank's view: on node-local roots its own node's disk, where the name is the same.
        tmp = ctx.root.absolute() / Path(prep.tmp).name
        if prep.nodes:
            return _commit_nodes(ctx, snap, prep, tmp)
    ctx.node_publisher = False
    report = _report(ctx, step, tmp, snap)
    outcome = gather_decide(  # file lists and digests are for rank 0's manifest only
        ctx.agreement,
        "save.written",
        report,
        lambda reports: _publish_or_fail(
            ctx, step, tmp, prep, snap.started, reports, items, snap.cost, part=part is not None
        ),
        decision=Outcome,
        patience=2.0,
    )
    _raise_if_failed(ctx, outcome.failures, step=step, phase=outcome.phase)
    ctx.last_save = (step, _resumed(snap))
    return tmp if part is not None else ctx.root / ctx.naming.name(step)


def _resumed(snap: Snapshot) -> float:
    # Training resumed when the caller got control back: at the end of a sync save, but right
    # after the snapshot of an async one (its commit overlaps the steps that follow).
    return snap.resumed if snap.resumed is not None else time.monotonic()


# ---------------------------------------------------------------- per-node publish (node-local roots)
#
# Each node's first rank publishes its node's part: the files of its ranks and the replicated DCP
# files its ranks read that another node's rank wrote (DCP stores a replicated value once, and only
# rank 0 writes .metadata), copied over torch.distributed and verified by checksum. The rounds, each
# an agreement every rank takes part in:
#
#   write     every rank writes into its node's temp directory and reports; rank 0 plans the copies
#             and builds the global manifest
#   confirm   copies sent and received; each node checks its files (size, xxh3) and writes its node
#             manifest
#   publish   every node confirmed: each node writes the global manifest and renames its temp
#             directory to the step name (an orphan until its tracker moves)
#   tracker   every node published: each node moves its tracker (the commit point)
#
# A kill before every node published leaves every tracker at the previous step; a kill between
# trackers leaves some nodes at the new step and the others holding it published (a valid global
# manifest, written only after every node confirmed), so restore agrees on the new step.


@dataclass(frozen=True)
class NodePlan(Wire):
    """Rank 0's verdict on the write: the failures, or the global manifest and the copies to make."""

    failures: list[dict[str, Any]] = field(default_factory=list)
    manifest: dict[str, Any] = field(default_factory=dict)
    copies: list[dict[str, Any]] = field(default_factory=list)  # {path, size, xxh3, src, dsts}


def _plan_nodes(
    ctx: Context, step: int, tmp: Path, prep: Prepared, started: float, reports: list[RankReport],
    kinds: dict[str, str], extra_cost: dict[str, Any] | None = None,
) -> NodePlan:
    failures = [r.failure for r in reports if r.failure]
    if failures:
        return NodePlan(failures)
    from .checks import rank_reads

    try:
        md = read_dcp_metadata(tmp / _layout.STATE_DIR)
    except (CheckpointError, OSError) as exc:
        return NodePlan([failure_from(exc, rank=0, phase="copy plan").to_json()])
    written = {f["path"]: dict(f, rank=r) for r, rep in enumerate(reports) for f in rep.files}
    nodes: list[dict[str, Any]] = []
    needs: dict[str, list[int]] = {}
    for ranks in prep.nodes:
        held = {f["path"] for r in ranks for f in reports[r].files}
        wanted = set().union(*(rank_reads(md, r) for r in ranks))
        wants = sorted(p for p in wanted - held if p in written)
        nodes.append({"name": reports[ranks[0]].host, "ranks": list(ranks), "copies": wants})
        for path in wants:
            needs.setdefault(path, []).append(ranks[0])
    manifest = _build_manifest(
        ctx, step, tmp / _layout.MANIFEST_NAME, prep, started, reports, kinds, nodes, extra_cost=extra_cost
    )
    copies = [
        {"path": p, "size": written[p]["size"], "xxh3": written[p]["xxh3"], "src": written[p]["rank"], "dsts": d}
        for p, d in sorted(needs.items())
    ]
    return NodePlan(manifest=manifest.to_json(), copies=copies)


def _commit_nodes(ctx: Context, snap: Snapshot, prep: Prepared, tmp: Path) -> Path:
    step = snap.step
    mine = _my_node(ctx, prep)
    leader = mine[0] == ctx.rank
    ctx.node_publisher = leader  # retention then runs on every node's root, by its publishing rank
    published = False
    trash: Path | None = None
    try:
        report = _report(ctx, step, tmp, snap)
        kinds = {n: c.kind.value for n, c in snap.items.items()}
        plan = gather_decide(
            ctx.agreement, "save.written", report,
            lambda reports: _plan_nodes(ctx, step, tmp, prep, snap.started, reports, kinds, snap.cost),
            decision=NodePlan, patience=2.0,
        )
        _raise_if_failed(ctx, plan.failures, step=step, phase="write")
        failure = _copy_files(ctx, step, tmp, plan.copies)
        if leader and failure is None:
            failure = _confirm_node(ctx, step, tmp, prep, plan)
        # The copies and the leaders' checksums of their node's files come first: a longer wait.
        _node_round(ctx, "save.node_confirm", failure, step=step, phase="node confirm", patience=2.0)
        failure = None
        if leader:
            try:
                _layout.atomic_write_json(tmp / _layout.MANIFEST_NAME, plan.manifest)
                _faults.reached("node.before_rename")
                trash = _rename_in(ctx, step, tmp)
                published = True
            except Exception as exc:
                failure = failure_from(exc, rank=ctx.rank, phase="node publish").to_json()
        _node_round(ctx, "save.node_publish", failure, step=step, phase="node publish")
        failure = None
        moved = NodeReport()
        if leader:
            try:
                _faults.reached("node.before_tracker")
                _layout.write_tracker(ctx.root, step)
                _faults.reached("node.after_tracker")
                if trash is not None:
                    shutil.rmtree(trash, ignore_errors=True)  # what is left is retried by empty_trash
            except Exception as exc:
                failure = failure_from(exc, rank=ctx.rank, phase="node tracker").to_json()
            moved = _tracker_now(ctx, failure)
        _tracker_round(ctx, step, prep, plan, moved)
    except BaseException:
        if leader and not published and tmp.exists():
            _discard(ctx, tmp)  # nothing of a save that did not publish may linger on this node
        raise
    ctx.last_save = (step, _resumed(snap))
    return ctx.root / ctx.naming.name(step)


def _node_round(
    ctx: Context, key: str, failure: dict[str, Any] | None, *, step: int, phase: str, patience: float = 1.0
) -> None:
    """Every rank learns whether every node did its part of ``phase``; all raise together if not."""
    outcome = gather_decide(
        ctx.agreement, key, NodeReport(failure),
        lambda reports: Outcome([r.failure for r in reports if r.failure], phase),
        decision=Outcome, patience=patience,
    )
    _raise_if_failed(ctx, outcome.failures, step=step, phase=outcome.phase)


def _tracker_now(ctx: Context, failure: dict[str, Any] | None) -> NodeReport:
    """This node's outcome of the tracker round, with where its tracker really is now."""
    try:
        return NodeReport(failure, _layout.read_tracker(ctx.root))
    except Exception as exc:  # said in the error: that node's restore cannot resolve until it reads
        return NodeReport(failure, None, f"{type(exc).__name__}: {exc}"[:500])


def _tracker_round(ctx: Context, step: int, prep: Prepared, plan: NodePlan, mine: NodeReport) -> None:
    """Every rank learns whether every node moved its tracker; if some did not, all raise together
    with where each node's tracker stands and which step a restore then takes."""

    def decide(reports: list[NodeReport]) -> Outcome:
        failures = [r.failure for r in reports if r.failure]
        if not failures:
            return Outcome()
        nodes = [(plan.manifest["nodes"][i]["name"], ranks, reports[ranks[0]]) for i, ranks in enumerate(prep.nodes)]
        return Outcome(failures, "node tracker", _trackers_after(step, nodes))

    outcome = gather_decide(ctx.agreement, "save.node_tracker", mine, decide, decision=Outcome)
    _raise_if_failed(ctx, outcome.failures, step=step, phase=outcome.phase, consequence=outcome.consequence)


def _trackers_after(step: int, nodes: list[tuple[str, list[int], NodeReport]]) -> str:
    """Where the resume target stands after a failed tracker round (every node had published ``step``
    with its global manifest), as ``restore`` resolves it: the newest step any node's tracker names,
    on every node, when every other node holds that step published (``_resume/restore.py``)."""

    def listing(group: list[tuple[str, list[int], NodeReport]], *, at: bool) -> str:
        return ", ".join(
            f"{name} (ranks {', '.join(map(str, ranks))}){f' at step {rep.tracker}' if at else ''}"
            for name, ranks, rep in group
        )

    moved = [n for n in nodes if n[2].tracker == step]
    unread = [n for n in nodes if n[2].tracker is None]
    behind = [n for n in nodes if n[2].tracker is not None and n[2].tracker != step]
    if unread:
        why = "; ".join(f"{name}: {rep.tracker_error}" for name, _r, rep in unread)
        return (
            f"the trackers of {listing(moved, at=False) or 'no node'} moved to step {step}; "
            f"{listing(behind, at=True) or 'no other node'} did not move; the tracker of {listing(unread, at=False)} "
            f"cannot be read back ({why}). A restore refuses, naming that node's error, until every node's tracker "
            "reads: check that node's disk, then restore."
        )
    if not behind:
        return (
            f"every node's tracker moved to step {step} ({listing(moved, at=False)}), so step {step} is committed and "
            "a restore resumes from it; the failure came after the tracker moved. Fix its cause before the next save."
        )
    if not moved:
        return (
            f"no node's tracker moved ({listing(behind, at=True)}), so the previous committed step stays the resume "
            f"target on every node; the step {step} directories every node published are no resume target, and the "
            "next save removes them. Fix the cause (disk space, permissions, storage health) and save again."
        )
    return (
        f"the trackers of {listing(moved, at=False)} moved to step {step}; those of {listing(behind, at=True)} did "
        f"not, and those nodes hold step {step} published (its global manifest, written after every node "
        f"confirmed). A restore (prefer='latest', the default) agrees on step {step} on every node: it takes the "
        "newest step a node's tracker names when every other node holds it published, and the lagging nodes log "
        f"that their tracker is older. Fix the cause on {', '.join(n[0] for n in behind)}, then train on: the next "
        f"save moves every tracker (step {step} cannot be saved again: it is committed where the tracker moved)."
    )


def _confirm_node(ctx: Context, step: int, tmp: Path, prep: Prepared, plan: NodePlan) -> dict[str, Any] | None:
    """This node's publishing rank: every file of its part is here with its size and xxh3; then the
    node manifest, written last on this node before the agreement."""
    index = next(i for i, ranks in enumerate(prep.nodes) if ctx.rank in ranks)
    node = plan.manifest["nodes"][index]
    ranks, copies = set(node["ranks"]), set(node["copies"])
    files = [f for f in plan.manifest["files"] if f.get("rank") in ranks or f["path"] in copies]
    try:
        bad = _file_problems(tmp, files, checksums=ctx.config.publish_checksums is not False)
        if bad:
            rel, why = bad[0]
            raise OSError(
                _errno.EIO, f"node {node['name']} (ranks {sorted(ranks)}): {len(bad)} of its {len(files)} file(s) "
                f"are not under {tmp} with their recorded size and xxh3, e.g. {rel}: {why}", str(tmp / rel),
            )
        _faults.reached("node.files_verified")
        record = _manifest.node_manifest(step=step, index=index, name=node["name"], ranks=sorted(ranks), files=files)
        _layout.atomic_write_json(tmp / _layout.NODE_MANIFEST_NAME, record)
        _faults.reached("node.confirmed")
    except Exception as exc:
        return failure_from(exc, rank=ctx.rank, phase="node confirm").to_json()
    return None


def _copy_files(ctx: Context, step: int, tmp: Path, copies: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Send each replicated file from the rank that wrote it to every node that reads it (``p2p``).

    Every rank walks the same list in the same order and takes part only where it sends or
    receives, so the pairs never wait on each other in a cycle; a failed pair is known to both
    its ranks within one block, and both go on with the next entry (no peer waits a timeout).
    Returns this rank's first failure."""
    link = _p2p.Link(
        ctx.storage_ctx.process_group, step=step, what="copy of a replicated DCP file to a node that reads it",
        retry="save again", timeout_s=ctx.config.timeout_s,
    )
    first: dict[str, Any] | None = None
    for entry in copies:
        src, dsts = int(entry["src"]), [int(d) for d in entry["dsts"]]
        spec = _p2p.FileSpec(entry["path"], int(entry["size"]), str(entry["xxh3"]))
        problems: list[_p2p.Problem | None] = []
        if ctx.rank == src:
            problems = [_p2p.send_file(link, tmp / spec.path, spec, dst) for dst in dsts]
        elif ctx.rank in dsts:
            problems = [_p2p.recv_file(link, tmp / spec.path, spec, src)]
        for problem in problems:
            if problem is not None and first is None:
                first = WriteFailure(  # the rank that hit it: the same report on both ranks of the pair
                    rank=problem.rank if problem.rank >= 0 else ctx.rank, phase=f"copy of {spec.path}",
                    exc_type=problem.exc_type, message=problem.message, errno=problem.errno, path=problem.path,
                    time_ns=problem.time_ns,
                ).to_json()
    return first
