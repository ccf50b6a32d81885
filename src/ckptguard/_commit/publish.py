"""The publish seam: how a written step becomes committed (docs/architecture.md).

Two publishers are here: ``SharedRootPublisher`` (one root every rank sees: rank 0 checks every
rank's reported files, writes the manifest, renames the temp directory to the step name, fsyncs the
root and moves the tracker) and ``RolePartPublisher`` (one role's part of a run step,
``ckptguard.run``: the part's manifest, then nothing; the run publishes). Node-local roots:
``publish_nodes``.
"""

from __future__ import annotations

import dataclasses
import errno as _errno
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from .. import _faults
from .._agree import gather_decide
from .._context import Context
from .._disk import layout as _layout
from .._disk.boxsum import combine_layout_free
from .._records import manifest as _manifest
from .._records.entries import Cost, Figure, FileEntry, NodeEntry, Topology
from .._state.state import digest_kind
from ..errors import (
    WriteFailure,
)
from ..storage.dcp import current_versions
from .messages import Outcome, Prepared, RankReport, failure_from, raise_if_failed
from .snapshot import Snapshot
from .stepdir import discard, file_problems, publish_dir


def save_cost(
    ctx: Context,
    step: int,
    started: float,
    files: Sequence[FileEntry],
    extra: Mapping[str, Figure] | None = None,
) -> Cost:
    """Size and save time, and the save as a fraction of step time (docs/practices.md, 7);
    ``extra``: the async path's and the busy policy's figures."""
    now = time.monotonic()
    step_s = None
    if ctx.last_save is not None and step > ctx.last_save[0]:
        step_s = (started - ctx.last_save[1]) / (step - ctx.last_save[0])
    return Cost(
        bytes=sum(f.size for f in files),
        save_seconds=round(now - started, 3),
        step_seconds=round(step_s, 3) if step_s else None,
        save_fraction_of_step=round((now - started) / step_s, 4) if step_s else None,
        extra=dict(extra or {}),
    )


def build_manifest(
    ctx: Context,
    step: int,
    path: Path,
    prep: Prepared,
    started: float,
    reports: list[RankReport],
    kinds: dict[str, str],
    nodes: Sequence[NodeEntry] | None = None,
    extra_cost: Mapping[str, Figure] | None = None,
) -> _manifest.Manifest:
    files = [dataclasses.replace(f, rank=r) for r, rep in enumerate(reports) for f in rep.files]
    layout = ctx.topology()
    return _manifest.build(
        path=path,
        step=step,
        chain_id=prep.chain_id,
        dir_template=ctx.naming.template,
        topology=Topology(
            layout.pop("world_size"),
            layout,
            tuple(rep.host for rep in reports),
            tuple(int(rep.ep_rank or 0) for rep in reports) if ctx.expert is not None else None,
        ),
        items=kinds,
        files=files,
        digests={str(r): rep.digests for r, rep in enumerate(reports)},
        versions=current_versions(),
        contract={"phase": prep.phase, "hash": prep.contract_hash},
        cost=save_cost(
            ctx, step, started, files, extra_cost
        ),  # optional in format 1: older manifests lack it
        # Optional in format 1 too: per item and key, the digest no sharding changes (a resharded
        # restore compares it).
        layout_free=combine_layout_free([rep.layout_free for rep in reports]),
        reshard=reports[0].reshard
        or None,  # optional in format 1: how each item crosses a world-size change
        nodes=nodes,
        # Format 3: tensor items' per-rank digests cover their structure; their bytes, layout_free
        # above.
        digest_kind={name: digest_kind(kind) for name, kind in kinds.items()},
    )


class Publisher(Protocol):
    """How a prepared step becomes committed: steps 2 to 4 of the protocol for one kind of root.

    ``run`` is called on every rank with the prepared temp directory; it calls ``write`` (this
    rank's part, a ``RankReport`` that never raises), confirms every rank's part across ranks,
    publishes, and returns the step's directory, or raises the same error on every rank. The
    implementations: ``SharedRootPublisher`` (one root every rank sees), ``publish_nodes``
    (node-local roots, each node publishing its ranks' part), ``RolePartPublisher`` (one role's part
    of a run step).
    """

    def run(
        self,
        ctx: Context,
        snap: Snapshot,
        prep: Prepared,
        tmp: Path,
        write: Callable[[], RankReport],
    ) -> Path: ...


def write_marker_or_fail(
    ctx: Context,
    snap: Snapshot,
    prep: Prepared,
    tmp: Path,
    reports: list[RankReport],
    then: Callable[[], None],
) -> Outcome:
    """Rank 0: write the commit marker if every rank wrote its part, then ``then()`` (the
    publisher's rename and tracker, or nothing for a role's part); else discard. The outcome every
    rank raises on."""
    # A shared root: sizes unless asked (publish_checksums None: the placement round already showed
    # every rank sees this temp directory, and a read-back of every rank's bytes on rank 0 would
    # cost one more read of the whole state per save).
    failures = [r.failure for r in reports if r.failure] or _unseen_files(
        tmp, reports, checksums=ctx.config.storage.publish_checksums is True
    )
    if failures:
        discard(ctx, tmp)
        return Outcome(failures, "write")
    try:
        _faults.reached("commit.before_manifest")
        kinds = {n: c.kind.value for n, c in snap.items.items()}
        manifest = build_manifest(
            ctx,
            snap.step,
            tmp / _layout.MANIFEST_NAME,
            prep,
            snap.started,
            reports,
            kinds,
            extra_cost=snap.cost,
        )
        _layout.atomic_write_json(
            manifest.path,
            manifest.to_json(),
            before_rename=lambda: _faults.reached("commit.manifest_tmp_written"),
        )
        then()
    except Exception as exc:
        if tmp.exists():  # refused or failed before the rename: nothing of it may linger
            discard(ctx, tmp)
        return Outcome([failure_from(exc, rank=0, phase="publish")], "publish")
    return Outcome()


def confirm_and_publish(
    ctx: Context,
    snap: Snapshot,
    prep: Prepared,
    tmp: Path,
    write: Callable[[], RankReport],
    then: Callable[[], None],
) -> None:
    """Every rank writes its part and reports; rank 0 writes the marker and runs ``then``; all raise
    alike."""
    outcome = gather_decide(  # file lists and digests are for rank 0's manifest only
        ctx.agreement,
        "save.written",
        write(),
        lambda reports: write_marker_or_fail(ctx, snap, prep, tmp, reports, then),
        decision=Outcome,
    )
    raise_if_failed(ctx, outcome.failures, step=snap.step, phase=outcome.phase)


def _unseen_files(
    tmp: Path, reports: list[RankReport], *, publisher: int = 0, checksums: bool = True
) -> list[WriteFailure]:
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
        bad = file_problems(tmp, rep.files, checksums=checksums)
        if bad:
            rel, why = bad[0]
            missing = all(w == "absent" for _r, w in bad)
            where = (
                "the root is node-local storage (a separate disk per node) but the ranks report "
                "one node: give each node its own identity (its host name), or use a root on "
                "storage every rank shares"
                if missing
                else "the bytes on disk are not what the rank wrote (another writer, "
                "or a storage fault): check "
                "the storage, then save again"
            )
            out.append(
                WriteFailure(
                    rank=rank,
                    phase="publish check",
                    exc_type="FileNotFoundError" if missing else "CheckpointCorruptError",
                    message=(
                        f"rank {rank} (node {rep.host}) reported {len(rep.files)} file(s) of which "
                        f"{len(bad)} are not under {tmp} as rank {publisher} (the publishing rank) "
                        f"reads them, e.g. {rel}: {why}; {where}"
                    ),
                    errno=_errno.ENOENT if missing else _errno.EIO,
                    path=str(tmp / rel),
                    time_ns=time.time_ns(),
                )
            )
    return out


class SharedRootPublisher:
    """``Publisher`` of a root every rank sees."""

    def run(
        self,
        ctx: Context,
        snap: Snapshot,
        prep: Prepared,
        tmp: Path,
        write: Callable[[], RankReport],
    ) -> Path:
        ctx.node_publisher = False

        def rename_and_move_tracker() -> None:
            _faults.reached("commit.before_rename")
            publish_dir(ctx, snap.step, tmp, snap.actions)

        confirm_and_publish(ctx, snap, prep, tmp, write, rename_and_move_tracker)
        return ctx.root / ctx.naming.name(snap.step)


class RolePartPublisher:
    """``Publisher`` of one role's part of a run step: the role's ranks write into ``<run
    temp>/<role>/``, rank 0 of the role writes the part's manifest as a single-role step would;
    nothing is renamed and no tracker moves."""

    def run(
        self,
        ctx: Context,
        snap: Snapshot,
        prep: Prepared,
        tmp: Path,
        write: Callable[[], RankReport],
    ) -> Path:
        ctx.node_publisher = False
        confirm_and_publish(ctx, snap, prep, tmp, write, lambda: None)
        return tmp
