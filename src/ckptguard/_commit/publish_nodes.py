"""The per-node publisher: node-local roots, each node publishing its own ranks' part.

Each node's first rank publishes its node's part: the files of its ranks and the replicated DCP
files its ranks read that another node's rank wrote (DCP stores a replicated value once, and only
rank 0 writes .metadata), copied over torch.distributed and verified by checksum. The rounds, each
an agreement every rank takes part in:

  write     every rank writes into its node's temp directory and reports; rank 0 plans the copies
            and builds the global manifest
  confirm   copies sent and received; each node checks its files (size, xxh3) and writes its node
            manifest
  publish   every node confirmed: each node writes the global manifest and renames its temp
            directory to the step name (an orphan until its tracker moves)
  tracker   every node published: each node moves its tracker (the commit point)

A kill before every node published leaves every tracker at the previous step; a kill between
trackers leaves some nodes at the new step and the others holding it published (a valid global
manifest, written only after every node confirmed), so restore agrees on the new step.

The placement (shared root or node-local roots) is decided at prepare (``place``); every other
node's publishing rank then prepares its own root like rank 0 (``prepare_nodes``).
"""

from __future__ import annotations

import dataclasses
import errno as _errno
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from .. import _faults
from .._agree import gather_decide
from .._context import Actions, Context
from .._disk import layout as _layout
from .._records import manifest as _manifest
from .._records.entries import Figure, FileEntry, NodeEntry
from .._records.manifest import rank_reads
from .._types import JsonObject
from ..errors import (
    CheckpointError,
    WriteFailure,
)
from ..storage.unpickler import read_dcp_metadata
from . import p2p as _p2p
from . import rootcommit
from .messages import (
    NodePlan,
    NodeReport,
    NodesSeen,
    Outcome,
    PlaceView,
    Prepared,
    RankReport,
    failure_from,
    raise_if_failed,
)
from .pending import log
from .publish import build_manifest
from .snapshot import Snapshot
from .stepdir import DirRoot, discard, file_problems, prepare_root, rename_in


def place(ctx: Context, step: int, prep: Prepared, nodes: dict[str, list[int]]) -> Prepared:
    """Shared root (every rank sees rank 0's temp directory) or node-local roots (each node's
    ranks see their node's disk, none sees another's); anything in between is refused."""
    name = Path(prep.tmp).name

    def decide(views: list[PlaceView]) -> Prepared:
        if all(v.sees for v in views):
            return prep
        # rank 0's node first; ranks ascending, the first publishes
        order = sorted(nodes.values(), key=min)
        problems = []
        for ranks in order:
            seeing = [r for r in ranks if views[r].sees]
            node = ctx.agreement.info.host if 0 in ranks else _node_of(nodes, ranks[0])
            if seeing and len(seeing) < len(ranks):
                blind = [r for r in ranks if not views[r].sees]
                problems.append(
                    f"{_ranks(blind)} of node {node} cannot see rank 0's temp directory {name} "
                    f"under its root, which {_ranks(seeing)} of the same node see: node-local "
                    f"storage (a separate disk per process at one path) under one node identity, "
                    f"so no node would hold its ranks' files. Give each node its own identity (its "
                    f"host name) and its ranks one disk, or use one shared root"
                )
            elif seeing and 0 not in ranks:
                problems.append(
                    f"node {node} (ranks {ranks}) shares rank 0's disk while other nodes do not: a "
                    f"mix of shared and node-local roots; give every node its own disk, or every "
                    f"rank the same shared root"
                )
        if problems:
            discard(ctx, Path(prep.tmp))
            failure = WriteFailure(
                rank=0,
                phase="placement",
                exc_type="ConfigError",
                message="; ".join(problems),
                path=prep.tmp,
                time_ns=time.time_ns(),
            )
            return Prepared(failure=failure)
        return Prepared(prep.tmp, prep.chain_id, prep.phase, prep.contract_hash, nodes=order)

    sees = (ctx.root.absolute() / name).is_dir()
    placed = gather_decide(ctx.agreement, "save.place", PlaceView(sees), decide, decision=Prepared)
    raise_if_failed(ctx, [placed.failure] if placed.failure else [], step=step, phase="placement")
    return placed


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _node_of(nodes: dict[str, list[int]], rank: int) -> str:
    return next(node for node, ranks in nodes.items() if rank in ranks)


def my_node(ctx: Context, prep: Prepared) -> list[int]:
    return next(ranks for ranks in prep.nodes if ctx.rank in ranks)


def prepare_nodes(ctx: Context, step: int, prep: Prepared, actions: Actions) -> None:
    """Each other node's publishing rank prepares its own root like rank 0; all raise on failure."""
    mine = my_node(ctx, prep)
    leader = mine[0] == ctx.rank and ctx.rank != 0
    report = NodeReport()
    if leader:
        try:
            prepare_root(ctx, step, like=prep, actions=actions)
        except Exception as exc:
            report = NodeReport(failure_from(exc, rank=ctx.rank, phase="prepare"))
    outcome = gather_decide(
        ctx.agreement,
        "save.prepare_nodes",
        report,
        lambda rs: Outcome([r.failure for r in rs if r.failure], "prepare"),
        decision=Outcome,
    )
    tmp = ctx.root.absolute() / Path(prep.tmp).name
    if not outcome.failures:
        # Every rank of a node must see the temp directory its first rank created on the node's
        # disk; one that does not (two disks, one node identity) would write where none publishes.
        owner = _layout.read_owner(tmp) or {}
        seen = NodeReport()
        if owner.get("node") != ctx.agreement.info.host:
            found = f"node {owner['node']}'s" if owner.get("node") else "no"
            seen = NodeReport(
                WriteFailure(
                    rank=ctx.rank,
                    phase="placement",
                    exc_type="ConfigError",
                    path=str(tmp),
                    time_ns=time.time_ns(),
                    message=f"rank {ctx.rank} of node {ctx.agreement.info.host} finds {found} "
                    f"temp directory at {tmp}, not the one rank {mine[0]} of its node created: "
                    f"node-local storage (a separate disk per process at one path) under one node "
                    f"identity. Give each node its own identity (its host name) and its ranks one "
                    "disk",
                )
            )
        if mine[0] == ctx.rank:
            seen = NodeReport(seen.failure, _layout.read_tracker(ctx.root) or 0)
        verdict = gather_decide(
            ctx.agreement,
            "save.node_seen",
            seen,
            lambda rs: NodesSeen(
                [r.failure for r in rs if r.failure],
                max(r.tracker for r in rs if r.tracker is not None),
            ),
            decision=NodesSeen,
        )
        outcome = Outcome(verdict.failures, "placement")
        if not verdict.failures and mine[0] == ctx.rank:
            _sweep_unagreed(ctx, verdict.newest, step)
    if outcome.failures and mine[0] == ctx.rank and report.failure is None:
        discard(ctx, tmp)
    raise_if_failed(ctx, outcome.failures, step=step, phase=outcome.phase)


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
            "ckptguard: removed %s: published on this node by a save that no node's tracker "
            "reached (killed between the nodes' publish and their trackers)",
            path,
        )


def _plan_nodes(
    ctx: Context,
    step: int,
    tmp: Path,
    prep: Prepared,
    started: float,
    reports: list[RankReport],
    kinds: dict[str, str],
    extra_cost: Mapping[str, Figure] | None = None,
) -> NodePlan:
    failures = [r.failure for r in reports if r.failure]
    if failures:
        return NodePlan(failures)

    try:
        md = read_dcp_metadata(tmp / _layout.STATE_DIR)
    except (CheckpointError, OSError) as exc:
        return NodePlan([failure_from(exc, rank=0, phase="copy plan")])
    written = {
        f.path: dataclasses.replace(f, rank=r) for r, rep in enumerate(reports) for f in rep.files
    }
    nodes: list[NodeEntry] = []
    needs: dict[str, list[int]] = {}
    for ranks in prep.nodes:
        held = {f.path for r in ranks for f in reports[r].files}
        wanted = set().union(*(rank_reads(md, r) for r in ranks))
        wants = sorted(p for p in wanted - held if p in written)
        nodes.append(NodeEntry(reports[ranks[0]].host, tuple(ranks), tuple(wants)))
        for path in wants:
            needs.setdefault(path, []).append(ranks[0])
    manifest = build_manifest(
        ctx,
        step,
        tmp / _layout.MANIFEST_NAME,
        prep,
        started,
        reports,
        kinds,
        nodes,
        extra_cost=extra_cost,
    )
    copies = [
        {
            "path": p,
            "size": written[p].size,
            "xxh3": written[p].xxh3,
            "src": written[p].rank,
            "dsts": d,
        }
        for p, d in sorted(needs.items())
    ]
    return NodePlan(manifest=manifest.to_json(), copies=copies)


class NodePublisher:
    """``Publisher`` of node-local roots (``prep.nodes``): the rounds above."""

    def run(
        self,
        ctx: Context,
        snap: Snapshot,
        prep: Prepared,
        tmp: Path,
        write: Callable[[], RankReport],
    ) -> Path:
        return _commit_nodes(ctx, snap, prep, tmp, write)


def _commit_nodes(
    ctx: Context, snap: Snapshot, prep: Prepared, tmp: Path, write: Callable[[], RankReport]
) -> Path:
    step = snap.step
    mine = my_node(ctx, prep)
    leader = mine[0] == ctx.rank
    ctx.node_publisher = leader  # retention then runs on every node's root, by its publishing rank
    published = False
    trash: Path | None = None
    try:
        report = write()
        kinds = {n: c.kind.value for n, c in snap.items.items()}
        plan = gather_decide(
            ctx.agreement,
            "save.written",
            report,
            lambda reports: _plan_nodes(
                ctx, step, tmp, prep, snap.started, reports, kinds, snap.cost
            ),
            decision=NodePlan,
        )
        raise_if_failed(ctx, plan.failures, step=step, phase="write")
        failure: WriteFailure | None = _copy_files(ctx, step, tmp, plan.copies)
        if leader and failure is None:
            failure = _confirm_node(ctx, step, tmp, prep, plan)
        # The copies and the leaders' checksums of their node's files come first: a longer wait.
        _node_round(
            ctx, "save.node_confirm", failure, step=step, phase="node confirm", patience=2.0
        )
        failure = None
        if leader:
            try:
                _layout.atomic_write_json(tmp / _layout.MANIFEST_NAME, plan.manifest)
                _faults.reached("node.before_rename")
                trash = rename_in(ctx, step, tmp, snap.actions)
                published = True
            except Exception as exc:
                failure = failure_from(exc, rank=ctx.rank, phase="node publish")
        _node_round(ctx, "save.node_publish", failure, step=step, phase="node publish")
        failure = None
        moved = NodeReport()
        if leader:
            try:
                _faults.reached("node.before_tracker")
                rootcommit.complete(DirRoot.of(ctx), step, trash, overwrite=snap.actions.overwrite)
                _faults.reached("node.after_tracker")
            except Exception as exc:
                failure = failure_from(exc, rank=ctx.rank, phase="node tracker")
            moved = _tracker_now(ctx, failure)
        _tracker_round(ctx, step, prep, plan, moved)
    except BaseException:
        if leader and not published and tmp.exists():
            discard(ctx, tmp)  # nothing of a save that did not publish may linger on this node
        raise
    return ctx.root / ctx.naming.name(step)


def _node_round(
    ctx: Context,
    key: str,
    failure: WriteFailure | None,
    *,
    step: int,
    phase: str,
    patience: float = 1.0,
) -> None:
    """Every rank learns whether every node did its part of ``phase``; all raise together if not."""
    outcome = gather_decide(
        ctx.agreement,
        key,
        NodeReport(failure),
        lambda reports: Outcome([r.failure for r in reports if r.failure], phase),
        decision=Outcome,
        patience=patience,
    )
    raise_if_failed(ctx, outcome.failures, step=step, phase=outcome.phase)


def _tracker_now(ctx: Context, failure: WriteFailure | None) -> NodeReport:
    """This node's outcome of the tracker round, with where its tracker really is now."""
    try:
        return NodeReport(failure, _layout.read_tracker(ctx.root))
    except Exception as exc:  # said in the error: that node's restore cannot resolve until it reads
        return NodeReport(failure, None, f"{type(exc).__name__}: {exc}"[:500])


def _tracker_round(
    ctx: Context, step: int, prep: Prepared, plan: NodePlan, mine: NodeReport
) -> None:
    """Every rank learns whether every node moved its tracker; if some did not, all raise together
    with where each node's tracker stands and which step a restore then takes."""

    def decide(reports: list[NodeReport]) -> Outcome:
        failures = [r.failure for r in reports if r.failure]
        if not failures:
            return Outcome()
        nodes = [
            (plan.manifest["nodes"][i]["name"], ranks, reports[ranks[0]])
            for i, ranks in enumerate(prep.nodes)
        ]
        return Outcome(failures, "node tracker", _trackers_after(step, nodes))

    outcome = gather_decide(ctx.agreement, "save.node_tracker", mine, decide, decision=Outcome)
    raise_if_failed(
        ctx, outcome.failures, step=step, phase=outcome.phase, consequence=outcome.consequence
    )


def _trackers_after(step: int, nodes: list[tuple[str, list[int], NodeReport]]) -> str:
    """Where the resume target stands after a failed tracker round (every node had published
    ``step`` with its global manifest), as ``restore`` resolves it: the newest step any node's
    tracker names, on every node, when every other node holds that step published
    (``_resume/restore.py``)."""

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
            f"the trackers of {listing(moved, at=False) or 'no node'} moved to step "
            f"{step}; {listing(behind, at=True) or 'no other node'} did not move; the "
            f"tracker of {listing(unread, at=False)} cannot be read back ({why}). A "
            f"restore refuses, naming that node's error, until every node's tracker reads: "
            f"check that node's disk, then restore."
        )
    if not behind:
        return (
            f"every node's tracker moved to step {step} ({listing(moved, at=False)}), so step "
            f"{step} is committed and a restore resumes from it; the failure came after the "
            f"tracker moved. Fix its cause before the next save."
        )
    if not moved:
        return (
            f"no node's tracker moved ({listing(behind, at=True)}), so the previous committed step "
            f"stays the resume target on every node; the step {step} directories every node "
            f"published are no resume target, and the next save removes them. Fix the cause (disk "
            f"space, permissions, storage health) and save again."
        )
    return (
        f"the trackers of {listing(moved, at=False)} moved to step {step}; those of "
        f"{listing(behind, at=True)} did not, and those nodes hold step {step} published (its "
        f"global manifest, written after every node confirmed). A restore (prefer='latest', "
        f"the default) agrees on step {step} on every node: it takes the newest step a node's "
        f"tracker names when every other node holds it published, and the lagging nodes log "
        f"that their tracker is older. Fix the cause on {', '.join(n[0] for n in behind)}, "
        f"then train on: the next save moves every tracker (step {step} cannot be saved again: "
        f"it is committed where the tracker moved)."
    )


def _confirm_node(
    ctx: Context, step: int, tmp: Path, prep: Prepared, plan: NodePlan
) -> WriteFailure | None:
    """This node's publishing rank: every file of its part is here with its size and xxh3; then the
    node manifest, written last on this node before the agreement."""
    index = next(i for i, ranks in enumerate(prep.nodes) if ctx.rank in ranks)
    node = plan.manifest["nodes"][index]
    ranks, copies = set(node["ranks"]), set(node["copies"])
    entries = [FileEntry.from_json(f) for f in plan.manifest["files"]]
    files = [f for f in entries if f.rank in ranks or f.path in copies]
    try:
        bad = file_problems(tmp, files, checksums=ctx.config.storage.publish_checksums is not False)
        if bad:
            rel, why = bad[0]
            raise OSError(
                _errno.EIO,
                f"node {node['name']} (ranks {sorted(ranks)}): {len(bad)} of its {len(files)} "
                f"file(s) are not under {tmp} with their recorded size and xxh3, e.g. {rel}: {why}",
                str(tmp / rel),
            )
        _faults.reached("node.files_verified")
        record = _manifest.node_manifest(
            step=step, index=index, name=node["name"], ranks=ranks, files=files
        )
        _layout.atomic_write_json(tmp / _layout.NODE_MANIFEST_NAME, record.to_json())
        _faults.reached("node.confirmed")
    except Exception as exc:
        return failure_from(exc, rank=ctx.rank, phase="node confirm")
    return None


def _copy_files(
    ctx: Context, step: int, tmp: Path, copies: list[JsonObject]
) -> WriteFailure | None:
    """Send each replicated file from the rank that wrote it to every node that reads it (``p2p``).

    Every rank walks the same list in the same order and takes part only where it sends or
    receives, so the pairs never wait on each other in a cycle; a failed pair is known to both
    its ranks within one block, and both go on with the next entry (no peer waits a timeout).
    Returns this rank's first failure."""
    link = _p2p.Link(
        ctx.storage_ctx.process_group,
        step=step,
        what="copy of a replicated DCP file to a node that reads it",
        retry="save again",
        timeout_s=ctx.config.timeout_s,
    )
    first: WriteFailure | None = None
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
                # the rank that hit it: the same report on both ranks of the pair
                first = WriteFailure(
                    rank=problem.rank if problem.rank >= 0 else ctx.rank,
                    phase=f"copy of {spec.path}",
                    exc_type=problem.exc_type,
                    message=problem.message,
                    errno=problem.errno,
                    path=problem.path,
                    time_ns=problem.time_ns,
                )
    return first
