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
import time
import uuid
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
from .._resume.state import Captured, capture, digests_and_layout_free
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
from . import layout as _layout
from . import lease as _lease
from . import manifest as _manifest

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


@dataclass(frozen=True)
class Prepared(Wire):
    """Rank 0's reply to prepare: the temp directory and the contract phase in force, or its failure."""

    tmp: str = ""
    chain_id: str = ""
    phase: int = 0
    contract_hash: str = ""
    failure: dict[str, Any] | None = None


@dataclass(frozen=True)
class RankReport(Wire):
    """What one rank wrote (files with sizes and checksums, per-item digests), or its first error."""

    host: str
    files: list[dict[str, Any]] = field(default_factory=list)
    digests: dict[str, str] = field(default_factory=dict)
    ep_rank: int | None = None
    failure: dict[str, Any] | None = None
    layout_free: dict[str, list[str]] = field(default_factory=dict)  # item -> partials (see digest.layout_free)


@dataclass(frozen=True)
class Outcome(Wire):
    """Rank 0's publish outcome: no failures means committed."""

    failures: list[dict[str, Any]] = field(default_factory=list)
    phase: str = "write"


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


def _raise_if_failed(ctx: Context, shipped: list[dict[str, Any]], *, step: int, phase: str) -> None:
    failures = [WriteFailure.from_json(f) for f in shipped]
    if not failures:
        return
    first = min(failures, key=lambda f: (f.time_ns, f.rank))
    raise CheckpointWriteError(
        f"save of step {step} under {ctx.root} failed at {phase}; first error: {first.describe()}. "
        f"All {ctx.world} ranks raise this together; the tracker was not moved, so the previous "
        "committed step stays the resume target. Fix the cause (disk space, permissions, "
        "storage health) and save again.",
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


def _prepare_root(ctx: Context, step: int) -> Prepared:
    """Rank 0: root, tracker 0, phase 0, sweep, existing-step check, temp directory."""
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
        _contract.write_phase(root, 0, _contract.initial_phase(uuid.uuid4().hex, ctx.config.contract))
    phase = _contract.check(root, ctx.config.contract, where=f"save of step {step}")
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
    nonce = secrets.token_hex(6)
    tmp = root / _layout.temp_dir_name(name, nonce)
    tmp.mkdir()
    (tmp / _layout.STATE_DIR).mkdir()
    _layout.write_owner(tmp)
    return Prepared(
        tmp=str(tmp), chain_id=phase["chain_id"], phase=phase["phase"], contract_hash=phase["contract_hash"]
    )


def _prepare(ctx: Context, step: int) -> Prepared:
    def decide(requests: list[PrepareRequest]) -> Prepared:
        steps = [r.step for r in requests]
        if len(set(steps)) > 1:
            raise ConfigError(
                f"ranks called save with different steps {steps} (index = rank); every rank must save the same step"
            )
        roots = [r.root for r in requests]
        if len(set(roots)) > 1:
            # Rank 0 creates the temp directory and every rank writes into it by its absolute path:
            # a rank with another root would publish into rank 0's and leave its own root empty.
            listing = "; ".join(f"rank {r}: {root}" for r, root in enumerate(roots))
            raise ConfigError(
                f"save of step {step}: ranks passed different checkpoint roots ({listing}). Every rank must "
                "pass the same root on storage they all share; node-local roots (a disk per node) cannot be "
                "published atomically yet: use shared storage, or stage_dir= for node-local staging"
            )
        try:
            return _prepare_root(ctx, step)
        except CheckpointError:
            raise
        except Exception as exc:  # an OSError of the root: reported like a write failure, with errno and path
            return Prepared(failure=failure_from(exc, rank=0, phase="prepare").to_json())

    request = PrepareRequest(step, str(ctx.root.absolute()))
    prep = gather_decide(ctx.agreement, "save.prepare", request, decide, decision=Prepared)
    _raise_if_failed(ctx, [prep.failure] if prep.failure else [], step=step, phase="prepare")
    return prep


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


def _publish(
    ctx: Context, step: int, tmp: Path, prep: Prepared, started: float, reports: list[RankReport],
    kinds: dict[str, str],
) -> None:
    _faults.reached("commit.before_manifest")
    files = [dict(f, rank=r) for r, rep in enumerate(reports) for f in rep.files]
    cost = _cost(ctx, step, started, files)
    manifest = _manifest.build(
        path=tmp / _layout.MANIFEST_NAME,
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
    )
    _layout.atomic_write_json(
        manifest.path, manifest.to_json(), before_rename=lambda: _faults.reached("commit.manifest_tmp_written")
    )
    _faults.reached("commit.before_rename")
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
    _faults.reached("commit.before_tracker")
    _layout.write_tracker(ctx.root, step)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)  # what is left is retried by empty_trash


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
    ctx: Context, step: int, tmp: Path, prep: Prepared, started: float, reports: list[RankReport], items: dict[str, Any]
) -> Outcome:
    """Rank 0: publish if every rank wrote its part, else discard; the outcome every rank raises on."""
    failures = [r.failure for r in reports if r.failure] or _unseen_files(tmp, reports)
    if failures:
        _discard(ctx, tmp)
        return Outcome(failures, "write")
    try:
        _publish(ctx, step, tmp, prep, started, reports, {n: c.kind.value for n, c in items.items()})
    except Exception as exc:
        if tmp.exists():  # refused or failed before the rename: nothing of it may linger
            _discard(ctx, tmp)
        return Outcome([failure_from(exc, rank=0, phase="publish").to_json()], "publish")
    return Outcome()


def _unseen_files(tmp: Path, reports: list[RankReport], *, publisher: int = 0) -> list[dict[str, Any]]:
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
        bad = _file_problems(tmp, rep.files)
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


def _file_problems(base: Path, files: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(path, why) for each reported file that is not under ``base`` with its size and xxh3.

    The sizes first (one stat each), then the checksums, hashed in parallel threads (the
    hash and the reads release the GIL)."""
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
    if not sized:
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


def snapshot(ctx: Context, step: int, state: dict[str, Any]) -> Snapshot:
    """Capture every item, the RNG streams and the digests, and run the divergence guard."""
    started = time.monotonic()

    def take() -> tuple[dict[str, Captured], Any]:
        return capture(state, ctx.keyfn()), (_rng.capture() if ctx.config.capture_rng else None)

    items, rng = on_every_rank(ctx.agreement, "save.capture", take)
    check_replicated(ctx, items, step)
    return Snapshot(step, items, rng, started)


def save(ctx: Context, step: int, state: dict[str, Any]) -> Path:
    return commit(ctx, snapshot(ctx, step, state))


def commit(ctx: Context, snap: Snapshot) -> Path:
    """Steps 1 to 4 of the protocol for a snapshot; in the caller's or a background thread."""
    step, items, rng = snap.step, snap.items, snap.rng
    prep = _prepare(ctx, step)
    tmp = Path(prep.tmp)
    try:
        written = _write_rank(ctx, step, tmp, items, rng)
        # Both digests in one pass over the bytes: the per-rank one and the one no sharding changes.
        digests, layout_free = digests_and_layout_free(items)
        if rng is not None:
            digests[RNG_ITEM] = digest(rng)
        report = RankReport(
            ctx.agreement.info.host,
            [f.__dict__ for f in written],
            digests,
            ctx.expert.rank if ctx.expert else None,
            layout_free=layout_free,
        )
        _faults.reached("commit.rank_written")
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException; report all
        report = RankReport(ctx.agreement.info.host, failure=failure_from(exc, rank=ctx.rank, phase="write").to_json())
    _release_host_cache()
    outcome = gather_decide(  # file lists and digests are for rank 0's manifest only
        ctx.agreement,
        "save.written",
        report,
        lambda reports: _publish_or_fail(ctx, step, tmp, prep, snap.started, reports, items),
        decision=Outcome,
        patience=2.0,
    )
    _raise_if_failed(ctx, outcome.failures, step=step, phase=outcome.phase)
    ctx.last_save = (step, time.monotonic())
    return ctx.root / ctx.naming.name(step)
