"""Peer replicas: each rank's files of a fast-tier step, kept also on a rank of another node.

Contract. Ranks are paired across nodes (``peers``: the rank with the same local index on the
next node, nodes in the order of their first rank). After a step commits, every rank sends the
files it wrote (the manifest's entries of its rank) to its peer over ``torch.distributed``
point-to-point (never through a shared filesystem), and the peer keeps them under
``ROOT/replicas/<step name>/rank_NNNNN/`` with ``replica.json`` written last: a replica without
its marker does not count. Every file is checked against the manifest's size and xxh3 when it
arrives, and again when it is fetched back.

Losing one node then leaves every file of the step on some surviving node: its own ranks'
files on its disk, the lost node's files in its replicas. ``fetch`` rebuilds a replacement
node's root from them: the contract files, the files its ranks need, the manifest last (the
commit marker), then the tracker.

Every file moves through ``p2p`` (the one file transfer between nodes, also used by
per-node publish): in one global order that every rank walks, a rank taking part only in the
transfers it sends or receives, so any plan completes without deadlock. A failure on either
side reaches the peer within one block (both then skip the rest of that pair's files) and both
report the same problem, naming the file, the step and both ranks, for the agreement after.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .._disk import layout as _layout
from .._disk.digest import file_digest
from .._records import manifest as _manifest
from .._records.entries import FileEntry
from .._types import JsonObject
from ..errors import CheckpointCorruptError, CheckpointError
from ..storage.base import DCP_METADATA
from . import p2p as _p2p
from .peerplan import CRAFTED, FETCH_RETRY, Admission, header_specs

REPLICA_DIR = "replicas"
MARKER = "replica.json"
FileSpec = _p2p.FileSpec


def peers(hosts: list[str]) -> list[int | None]:
    """The peer of every rank: same local index on the next node (None with a single node)."""
    nodes: list[str] = []
    for h in hosts:
        if h not in nodes:
            nodes.append(h)
    if len(nodes) < 2:
        return [None] * len(hosts)
    ranks = {n: [r for r, h in enumerate(hosts) if h == n] for n in nodes}
    out: list[int | None] = []
    for r, h in enumerate(hosts):
        nxt = ranks[nodes[(nodes.index(h) + 1) % len(nodes)]]
        out.append(nxt[ranks[h].index(r) % len(nxt)])
    return out


def replica_dir(root: Path, step_name: str, source: int) -> Path:
    return root / REPLICA_DIR / step_name / f"rank_{source:05d}"


def held(root: Path, naming: _layout.StepNaming) -> dict[int, list[int]]:
    """Complete replicas on this disk: step -> the source ranks whose files are here."""
    out: dict[int, list[int]] = {}
    base = root / REPLICA_DIR
    try:
        steps = list(os.scandir(base))
    except OSError:
        return out
    for entry in steps:
        step = naming.parse(entry.name)
        if step is None or not entry.is_dir(follow_symlinks=False):
            continue
        for sub in sorted(Path(entry.path).glob("rank_*")):
            marker = _marker(sub)
            if marker is not None and marker.get("step") == step:
                out.setdefault(step, []).append(int(marker["source_rank"]))
    return out


def _marker(directory: Path) -> JsonObject | None:
    try:
        data = _layout.read_json(directory / MARKER, what="replica marker")
    except Exception:  # absent, torn or crafted: this replica does not count
        return None
    ok = (
        isinstance(data, dict)
        and isinstance(data.get("step"), int)
        and isinstance(data.get("source_rank"), int)
    )
    return data if ok else None


def prune(root: Path, naming: _layout.StepNaming, keep: set[int], sources: list[int]) -> list[int]:
    """Delete this rank's replicas (of ``sources``) of steps not in ``keep``, and the temp
    directories of its pushes that a kill left behind; returns the steps pruned."""
    pruned = []
    try:
        entries = list(os.scandir(root / REPLICA_DIR))
    except OSError:
        return []
    for entry in entries:
        step = naming.parse(entry.name)
        if step is None or not entry.is_dir(follow_symlinks=False):
            continue
        for source in sources:
            final = replica_dir(root, entry.name, source)
            for stale in final.parent.glob(
                f"{final.name}.tmp-*"
            ):  # this rank's pushes are all sealed now
                shutil.rmtree(stale, ignore_errors=True)
            if step not in keep and final.exists():
                shutil.rmtree(final, ignore_errors=True)
                pruned.append(step)
        with contextlib.suppress(OSError):  # the last holder removes the step's folder
            (root / REPLICA_DIR / entry.name).rmdir()
    return sorted(set(pruned))


# ---------------------------------------------------------------- files over torch.distributed
# (``p2p``)


def _link(
    group: Any, step: int | None, what: str, retry: str, timeout_s: float | None
) -> _p2p.Link:
    return _p2p.Link(group, step=step, what=what, retry=retry, timeout_s=timeout_s)


def send_file(path: Path, spec: FileSpec, dst: int, link: _p2p.Link) -> str | None:
    """Send one file of a push or fetch (the receiver calls ``recv_file``); the problem, if it did
    not arrive."""
    problem = _p2p.send_file(link, path, spec, dst)
    return None if problem is None else str(problem)


def recv_file(
    dest: Path,
    spec: FileSpec,
    src: int,
    link: _p2p.Link,
    *,
    refuse: tuple[str, str] | None = None,
) -> str | None:
    problem = _p2p.recv_file(link, dest, spec, src, refuse=refuse)
    return None if problem is None else str(problem)


def send_json(obj: Any, dst: int, group: Any, *, timeout_s: float | None = None) -> None:
    _p2p.send_json(_link(group, None, "header", "", timeout_s), obj, dst)


def recv_json(src: int, group: Any, *, timeout_s: float | None = None) -> Any:
    return _p2p.recv_json(_link(group, None, "header", "", timeout_s), src)


# ---------------------------------------------------------------- push after a commit


def own_files(manifest_files: Sequence[FileEntry], rank: int) -> list[FileSpec]:
    return [FileSpec(f.path, f.size, f.xxh3) for f in manifest_files if f.rank == rank]


def push(
    *,
    root: Path,
    step: int,
    step_name: str,
    manifest_files: Sequence[FileEntry],
    peer_of: list[int | None],
    rank: int,
    group: Any,
    timeout_s: float | None = None,
) -> list[str]:
    """Every rank sends its own files of ``step`` to its peer; returns this rank's problems. After a
    failed file both ranks of the pair skip the rest of it (a replica missing one file does not
    count)."""
    link = _link(
        group,
        step,
        "peer replica",
        "save again (the step is committed; only its replica is missing)",
        timeout_s,
    )
    problems: list[str] = []
    step_dir = root / step_name
    for source, peer in enumerate(peer_of):  # the global order: source rank ascending
        if peer is None:
            continue
        files = own_files(manifest_files, source)
        if source == rank:
            for f in files:
                if (err := send_file(step_dir / f.path, f, peer, link)) is not None:
                    problems.append(err)
                    break
        elif peer == rank:
            final = replica_dir(root, step_name, source)
            tmp = final.with_name(f"{final.name}.tmp-{secrets.token_hex(4)}")
            failed = False
            for f in files:
                if (err := recv_file(tmp / f.path, f, source, link)) is not None:
                    problems.append(err)
                    failed = True
                    break
            problems += _seal(tmp, final, step, source, files, failed=failed)
    return problems


def _seal(
    tmp: Path, final: Path, step: int, source: int, files: list[FileSpec], *, failed: bool
) -> list[str]:
    """Marker last, then the rename; a failed replica is removed, never left to look complete."""
    if failed:
        shutil.rmtree(tmp, ignore_errors=True)
        return []
    try:
        marker = {"step": step, "source_rank": source, "files": [f.__dict__ for f in files]}
        _layout.atomic_write_json(tmp / MARKER, marker)
        if final.exists():
            shutil.rmtree(final)  # a replica of the same step saved again (overwrite)
        os.rename(tmp, final)
        _layout.fsync_dir(final.parent)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        return [f"sealing the replica {final}: {exc}"]
    return []


# ---------------------------------------------------------------- fetch at restore


def fetch_plan(
    root: Path, step_name: str, needed: set[str], manifest_files: Sequence[FileEntry], source: int
) -> tuple[list[FileSpec], list[Path]]:
    """What a sender sends to rebuild ``source``'s part of a step: the manifest first (the receiver
    admits every later file by it; it is published last, at ``seal_fetch``), the contract files, and
    every file the rank needs (from this node's step directory, else from the replica of
    ``source``). Returns the specs and where the sender reads each."""

    step_dir = root / step_name
    manifest = step_dir / _layout.MANIFEST_NAME
    size, xxh = file_digest(str(manifest))
    specs: list[FileSpec] = [FileSpec(_layout.MANIFEST_NAME, size, xxh)]
    paths: list[Path] = [manifest]
    for p in sorted((root / _layout.CONTRACT_DIR).glob("phase_*.json")):
        size, xxh = file_digest(str(p))
        specs.append(FileSpec(f"{_layout.CONTRACT_DIR}/{p.name}", size, xxh, "root"))
        paths.append(p)
    by_path = {f.path: f for f in manifest_files}
    for rel in sorted(
        needed
    ):  # state/.metadata sorts before the shards: the receiver admits them by it
        f = by_path[rel]
        local = step_dir / rel
        replica = replica_dir(root, step_name, source) / rel
        src = local if _has_size(local, f.size) else replica
        specs.append(FileSpec(rel, f.size, f.xxh3))
        paths.append(src)
    return specs, paths


def _has_size(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except OSError:
        return False


def send_part(
    specs: list[FileSpec],
    paths: list[Path],
    dst: int,
    group: Any,
    *,
    step: int | None = None,
    timeout_s: float | None = None,
) -> list[str]:
    """Send a rank's part of a step (``fetch_plan``) to ``dst``, which calls ``recv_part``: a header
    (the step and the specs), then the files; both stop at the first file that failed."""
    if step is None:
        step = _step_of(paths[0]) if paths else None
    link = _link(group, step, "fetch from a peer replica", FETCH_RETRY, timeout_s)
    _p2p.send_json(link, {"step": step, "files": [s.__dict__ for s in specs]}, dst)
    for s, p in zip(specs, paths, strict=True):
        if (err := send_file(p, s, dst, link)) is not None:
            return [err]
    return []


def _step_of(manifest: Path) -> int | None:
    """The step a manifest records, for the errors of a transfer (None where it does not read)."""
    try:
        step = _layout.read_json(manifest, what="manifest").get("step")
    except Exception:  # the transfer of this very file reports what is wrong with it
        return None
    return step if isinstance(step, int) else None


def recv_part(
    root: Path,
    tmp: Path,
    rank: int,
    src: int,
    group: Any,
    *,
    step: int,
    timeout_s: float | None = None,
) -> list[str]:
    """Receive ``rank``'s part of ``step`` (the step every rank agreed) into ``tmp`` (a temp
    directory of this node's root): the manifest first, as ``fetched_manifest(tmp, rank)``, then
    only the files it lists for ``rank`` (its extras, the DCP metadata and the shards the metadata
    says it reads), under ``tmp``, and the contract phases it names, staged in ``tmp`` and linked
    into the root once the whole part arrived (where present they must be the same bytes).

    The header and its paths come from the peer: one that names any other file (a tracker, the trust
    record, a hold, another step's marker, another rank's extras) or does not parse plants nothing;
    the file is refused within the exchange, so the sender hears it at once and both report it."""

    link = _link(group, step, "fetch from a peer replica", FETCH_RETRY, timeout_s)
    header = _p2p.recv_json(link, src)
    if (
        isinstance(header, dict) and "error" in header
    ):  # the sender could not read its part: nothing follows
        return [str(header.get("error"))]
    specs, refusal = header_specs(header, step)
    if not specs:  # not even the first file's size: no exchange can follow, the sender times out
        return [
            f"fetch from a peer replica, step {step}: rank {rank} refuses rank {src}'s "
            f"header: {refusal}; rank {src}'s ckptguard is another version, or the peer is "
            f"not this job's; {FETCH_RETRY}"
        ]
    staged = fetched_manifest(tmp, rank).parent
    if (
        err := recv_file(fetched_manifest(tmp, rank), specs[0], src, link, refuse=refusal)
    ) is not None:
        return [err]
    try:
        manifest = _manifest.read(staged)
        if manifest.step != step:
            raise CheckpointCorruptError(f"the manifest sent is of step {manifest.step}")
    except CheckpointError as exc:
        shutil.rmtree(staged, ignore_errors=True)
        return [
            _refuse_next(specs[1:], tmp, src, link, (f"the part: {exc}", CRAFTED.format(src=src)))
            or f"fetch from a peer replica, step {step}: rank {rank} refuses "
            f"rank {src}'s manifest: {exc}"
        ]
    admit = Admission(manifest, rank, tmp, staged, src)
    for spec in specs[1:]:
        dest, why = admit.where(spec)
        if (err := recv_file(dest, spec, src, link, refuse=why)) is not None:
            return [err]
        if why is None and spec.path == f"{_layout.STATE_DIR}/{DCP_METADATA}":
            admit.learn_reads(dest)
    return admit.finish(root)


def _refuse_next(
    rest: list[FileSpec], tmp: Path, src: int, link: _p2p.Link, why: tuple[str, str]
) -> str | None:
    """The sender sends its next file (if any): refuse it, so it stops there and hears why."""
    if not rest:
        return None
    return recv_file(tmp / "refused", rest[0], src, link, refuse=why)  # nothing is written


def fetched_manifest(tmp: Path, rank: int) -> Path:
    return tmp / f".fetched-{rank:05d}" / _layout.MANIFEST_NAME


def seal_fetch(
    tmp: Path,
    final: Path,
    rank: int,
    node_record: Callable[[_manifest.Manifest], _manifest.NodeManifest | None],
) -> None:
    """The first receiving rank of a node, after every rank's fetch arrived intact: the manifest and
    the node manifest (``node_record(manifest)``) in the temp directory, then the step directory in
    place (a rename, or where part of the step was still here, its files with the manifest last)."""

    os.replace(
        fetched_manifest(tmp, rank), tmp / _layout.MANIFEST_NAME
    )  # a temp directory: not committed yet
    for staged in tmp.glob(".fetched-*"):
        shutil.rmtree(staged)
    record = node_record(_manifest.read(tmp))
    if record is not None:
        _layout.atomic_write_json(tmp / _layout.NODE_MANIFEST_NAME, record.to_json())
    (tmp / _layout.OWNER_NAME).unlink(missing_ok=True)
    if not final.exists():
        os.rename(tmp, final)
    else:  # part of the step was still here (a rank lost only some files): fill it in, marker last
        moved = sorted(
            (p for p in tmp.rglob("*") if p.is_file()),
            key=lambda p: p.name == _layout.MANIFEST_NAME,
        )
        for p in moved:
            dest = final / p.relative_to(tmp)
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(p, dest)
        shutil.rmtree(tmp, ignore_errors=True)
    _layout.fsync_dir(final)
    _layout.fsync_dir(final.parent)
