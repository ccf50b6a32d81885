"""The restore of a ``TieredCheckpoint``: the collective choice of a tier and step, peer fetches.

Every rank reports what it can load (``view``: fast steps complete on its own disk, peer replicas
it holds, the persistent tier's step); rank 0 picks the newest step that EVERY rank can load
from some tier (``choose``); ranks lacking the fast step's files fetch them from their peers'
replicas (``fetch``, checked against the manifest's xxh3); after the restore one rank per node
points its fast tracker at the restored step (``align_fast``). See ``ckptguard.tiers``.
"""

from __future__ import annotations

import enum
import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from .._agree import Wire
from .._commit import replica as _replica
from .._context import Context
from .._disk import layout as _layout
from .._records import manifest as _manifest
from .._records.manifest import files_needed
from .._resume.resolve_local import Resolution, resolve_local
from ..config import ResumeMode
from ..errors import CheckpointError, CheckpointIncompleteError, error_payload, rebuild
from .rootstage import RootStage

log = logging.getLogger("ckptguard")


class Tier(str, enum.Enum):
    """Where a step was saved or restored from."""

    FAST = "fast"
    """The node-local tier (``/dev/shm``, NVMe): every ``fast_every`` steps."""
    PERSISTENT = "persistent"
    """The shared filesystem or an object store: every ``persistent_every`` steps."""


@dataclass(frozen=True)
class View(Wire):
    """What one rank can load: fast steps complete on its disk, replicas it holds, the persistent
    step."""

    host: str
    complete: list[int] = field(default_factory=list)
    published: list[int] = field(
        default_factory=list
    )  # complete here, newer than this node's tracker
    missing: dict[str, list[str]] = field(
        default_factory=dict
    )  # str(step) -> files this rank lacks
    replicas: dict[str, list[int]] = field(
        default_factory=dict
    )  # str(step) -> source ranks held here
    persistent: int = 0  # the persistent tier's committed step (0: none)
    persistent_error: dict[str, Any] | None = None
    error: dict[str, Any] | None = None


@dataclass(frozen=True)
class Choice(Wire):
    # "fast", "persistent", or "" (nothing committed anywhere: the managers' own fresh start)
    tier: str = ""
    step: int = 0
    senders: dict[str, int] = field(default_factory=dict)  # str(receiver rank) -> sender rank
    detail: str = ""
    fell_back: bool = False  # a newer step exists on part of the job: said as a warning


class TierRestore:
    """The restore side of the tiers, over the fast tier's context and the persistent tier's
    (``stage``: its root's stage; an object store's committed step is the store's, not its staging
    root's)."""

    def __init__(
        self,
        fast: Context,
        persistent: Context | None,
        *,
        replicas: int,
        hosts: list[str],
        stage: RootStage | None = None,
    ) -> None:
        self.fast = fast
        self.persistent = persistent
        self.replicas = replicas
        self.hosts = hosts
        self.stage = stage

    @property
    def rank(self) -> int:
        return self.fast.rank

    def view(self) -> View:
        host = self.fast.agreement.info.host
        try:
            complete, published, missing = self._fast_steps()
            replicas = {
                str(s): r for s, r in _replica.held(self.fast.root, self.fast.naming).items()
            }
        except Exception as exc:  # shipped: no rank waits for a peer that raised
            return View(host, error=error_payload(exc))
        persistent, perror = 0, None
        if self.persistent is not None:
            try:
                stored = self.stage.tracker_step() if self.stage is not None else None
                persistent = (
                    stored
                    if stored is not None
                    else resolve_local(
                        self.persistent.root, self.persistent.naming, ResumeMode.AUTO, None
                    ).step
                )
            except Exception as exc:
                perror = error_payload(exc)
        return View(host, complete, published, missing, replicas, persistent, perror)

    def _fast_steps(self) -> tuple[list[int], list[int], dict[str, list[str]]]:
        """Fast steps whose files this rank has on its own disk (sizes as the manifest says):
        committed ones (up to the tracker), and published ones past it (node-local roots: a save
        stopped between the nodes' trackers; they count only where another node's tracker names
        them). For the others, the files this rank lacks."""
        root, naming, rank = self.fast.root, self.fast.naming, self.rank
        tracker = _layout.read_tracker(root) if root.is_dir() else None
        complete: list[int] = []
        published: list[int] = []
        missing: dict[str, list[str]] = {}
        if tracker is None:
            # Steps but no tracker was never written by ckptguard: raised as the manager's resolve
            # does.
            resolve_local(root, naming, ResumeMode.AUTO, None)
            return complete, published, missing
        for step, path in sorted(_layout.step_dirs(root, naming).items()):
            try:
                manifest = _manifest.read(path)
                if manifest.world_size != self.fast.world or manifest.step != step:
                    continue  # another layout: restore decides, on its own tier
                if step > tracker and not manifest.nodes:
                    continue  # an orphan on a shared root: never a resume target
                needed = files_needed(path, manifest, rank)
            except CheckpointError:
                continue
            sizes = {f.path: f.size for f in manifest.files}
            lacking = sorted(p for p in needed if not _size_is(path / p, sizes.get(p, -1)))
            if lacking:
                missing[str(step)] = [str(path / p) for p in lacking[:5]]
            else:
                (complete if step <= tracker else published).append(step)
        return complete, published, missing

    def choose(self, views: list[View], broken: dict[int, str]) -> Choice:
        """Rank 0: the newest step every rank can load, preferring the fast tier at equal steps; a
        fast step in ``broken`` (its fetch failed) is loadable only where no rank needs a fetch."""
        errors = {r: v.error for r, v in enumerate(views) if v.error}
        if errors:
            r = min(errors)
            raise rebuild(errors[r], note=f"(rank {r}, reading the fast tier) ")
        fast_steps = {
            s for v in views for s in v.complete
        }  # committed: some node's tracker names it
        best: tuple[int, dict[str, int]] | None = None
        for step in sorted(fast_steps, reverse=True):
            senders = self._senders(views, step)
            if senders and step in broken:
                continue
            if senders is not None:
                best = (step, senders)
                break
        newest = max(fast_steps, default=0)
        gap = self._gap(views, newest) if newest and (best is None or best[0] < newest) else ""
        if newest in broken:
            gap = f"its replicas failed: {broken[newest]}"
        perrors = {r: v.persistent_error for r, v in enumerate(views) if v.persistent_error}
        persistent = min(v.persistent for v in views) if not perrors else 0
        if best is not None and best[0] >= persistent:
            step, senders = best
            fetched = (
                f", ranks {sorted(int(r) for r in senders)} from peer replicas on ranks "
                f"{sorted(set(senders.values()))}"
                if senders
                else " on every rank's own disk"
            )
            older = (
                f"; the newer fast step {newest} is not loadable on every rank ({gap})"
                if gap
                else ""
            )
            if (
                perrors
            ):  # said, not hidden: the fallback a later loss of this tier would need is broken
                older += f"; the persistent tier cannot be read: {perrors[min(perrors)]['message']}"
            return Choice(
                Tier.FAST.value,
                step,
                senders,
                f"tier fast: step {step}{fetched}{older}",
                bool(gap or perrors),
            )
        if persistent:
            why = (
                f" (the fast tier's newest step {newest} cannot be loaded on every rank: {gap})"
                if gap
                else ""
            )
            if best is not None:
                why = f" (newer than the fast tier's newest loadable step {best[0]})"
            return Choice(
                Tier.PERSISTENT.value,
                persistent,
                {},
                f"tier persistent: step {persistent}{why}",
                bool(gap),
            )
        if newest or perrors:
            where = f"the fast tier's newest step {newest} is incomplete: {gap}" if newest else ""
            if perrors:
                r = min(perrors)
                where += f"{'; ' if where else ''}the persistent tier: {perrors[r]['message']}"
            elif self.persistent is None:
                where += "; there is no persistent tier"
            else:
                home = self.stage.url if self.stage is not None else self.persistent.root
                where += f"; the persistent tier {home} holds no committed step"
            raise CheckpointIncompleteError(
                f"restore refused: no step can be loaded by every rank from any tier ({where}). "
                + (
                    "No peer replica holds the missing files. "
                    if self.replicas
                    else "Without replicas=1 the files of a lost node exist nowhere else. "
                )
                + "Copy the missing files back (ckptguard transfer), or "
                "restore(path=...) a step you trust"
            )
        return Choice()

    @staticmethod
    def _senders(views: list[View], step: int) -> dict[str, int] | None:
        """For every rank that lacks ``step``, a rank on another node that holds its replica and the
        step."""
        senders: dict[str, int] = {}
        for r, v in enumerate(views):
            if step in v.complete or step in v.published:
                continue
            holder = next(
                (
                    h
                    for h, w in enumerate(views)
                    if w.host != v.host
                    and step in w.complete + w.published
                    and r in w.replicas.get(str(step), [])
                ),
                None,
            )
            if holder is None:
                return None
            senders[str(r)] = holder
        return senders

    def _gap(self, views: list[View], step: int) -> str:
        """Which rank lacks which files of ``step`` (for a rank whose disk has no trace of the step,
        rank 0 names the files from its own copy of the step, where it has one)."""
        lacking = []
        for r, v in enumerate(views):
            if step in v.complete or step in v.published:
                continue
            files = v.missing.get(str(step)) or self._expected(step, r)
            what = (
                f"missing {', '.join(files)}" if files else f"no committed step {step} on its disk"
            )
            lacking.append(f"rank {r} (host {v.host}): {what}")
        return "; ".join(lacking[:8]) + (" ..." if len(lacking) > 8 else "")

    def _expected(self, step: int, rank: int) -> list[str]:
        path = self.fast.root / self.fast.naming.name(step)
        try:
            needed = files_needed(path, _manifest.read(path), rank)
        except (CheckpointError, OSError):
            return []
        return [str(path / p) for p in sorted(needed)[:5]] + (["..."] if len(needed) > 5 else [])

    def fetch(self, choice: Choice) -> None:
        """Rebuild the lacking ranks' part of the chosen fast step from their peers' replicas: into
        a temp directory of the node's root, checked against the manifest, then sealed (node
        manifest, manifest, rename) by the node's first receiving rank once every rank's part
        arrived."""
        ctx = self.fast
        name = ctx.naming.name(choice.step)
        group = ctx.storage_ctx.process_group
        receivers = sorted(int(r) for r in choice.senders)
        nonce = xxhash.xxh3_64_hexdigest(json.dumps([choice.step, receivers]).encode())[:12]
        tmp = self.fast.root / _layout.temp_dir_name(
            name, nonce
        )  # the same on every receiver of a node
        problems: list[str] = []
        if self.rank in receivers:
            try:
                (tmp / _layout.STATE_DIR).mkdir(
                    parents=True, exist_ok=True
                )  # an empty node's root is rebuilt too
                _layout.write_owner(tmp, node=ctx.agreement.info.host)  # swept if this process dies
            except OSError as exc:
                problems.append(f"creating {tmp}: {exc}")
        for receiver in receivers:
            sender = choice.senders[str(receiver)]
            try:
                if self.rank == sender:
                    try:
                        step_dir = self.fast.root / name
                        manifest = _manifest.read(step_dir)
                        needed = files_needed(step_dir, manifest, receiver)
                        specs, paths = _replica.fetch_plan(
                            self.fast.root, name, needed, manifest.files, receiver
                        )
                    except (
                        OSError,
                        CheckpointError,
                        KeyError,
                    ) as exc:  # told to the receiver, which then stops
                        why = (
                            f"rank {self.rank} cannot send step {choice.step}: "
                            f"{type(exc).__name__}: {exc}"
                        )
                        _replica.send_json({"error": why}, receiver, group)
                        problems.append(why)
                        continue
                    problems += _replica.send_part(specs, paths, receiver, group)
                elif self.rank == receiver:
                    problems += _replica.recv_part(
                        self.fast.root, tmp, receiver, sender, group, step=choice.step
                    )
            except (
                OSError,
                CheckpointError,
                RuntimeError,
            ) as exc:  # RuntimeError: a peer died mid-transfer
                problems.append(f"{type(exc).__name__}: {exc}")
                break  # the agreement below names the ranks that never arrived

        def failed(bad: list[str]) -> CheckpointIncompleteError:
            return CheckpointIncompleteError(
                f"fetching step {choice.step} from peer replicas failed ({' | '.join(bad)}); "
                f"nothing was loaded. Check the disks of the ranks named, then restore again"
            )

        try:
            bad = after_transfers(ctx.agreement, "tiers.fetch", problems)
            if bad:
                raise failed(bad)  # on every rank alike: the same list everywhere
        except CheckpointError:
            if self.rank in receivers:
                shutil.rmtree(
                    tmp, ignore_errors=True
                )  # nothing of a failed fetch lingers on the node
            raise
        sealer = (
            next((r for r in receivers if self.hosts[r] == self.hosts[self.rank]), None)
            == self.rank
        )
        failure: list[str] = []
        if sealer:
            try:
                _replica.seal_fetch(tmp, self.fast.root / name, self.rank, self._node_record)
                tracker = _layout.read_tracker(self.fast.root)
                if tracker is None or tracker < choice.step:
                    _layout.write_tracker(self.fast.root, choice.step)
            except (OSError, CheckpointError) as exc:
                failure = [f"sealing {tmp}: {type(exc).__name__}: {exc}"]
        if bad := after_transfers(ctx.agreement, "tiers.fetch_sealed", failure):
            raise failed(bad)
        log.info(
            "ckptguard: rebuilt step %d on ranks %s from peer replicas (xxh3 "
            "checked against the manifest)",
            choice.step,
            receivers,
        )

    def _node_record(self, manifest: _manifest.Manifest) -> _manifest.NodeManifest | None:
        """The node manifest of the node this rank's part belongs to (node-local roots); None on a
        shared root (no ``nodes`` in the manifest)."""
        index = manifest.node_of(self.rank)
        if index is None or manifest.nodes is None:
            return None
        node = manifest.nodes[index]
        return _manifest.node_manifest(
            step=manifest.step,
            index=index,
            name=node.name,
            ranks=node.ranks,
            files=manifest.node_files(index),
        )

    def resolution(self, choice: Choice, mode: ResumeMode) -> Resolution:
        """The step ``choice`` names as a ``Resolution``: its directory in the chosen tier (nothing
        fetched); a persistent step on an object store carries its marker's URL (``url``) beside the
        staging directory."""
        ctx = self.fast if choice.tier == Tier.FAST.value else self.persistent
        assert ctx is not None
        name = ctx.naming.name(choice.step)
        stored = self.stage is not None and choice.tier == Tier.PERSISTENT.value
        url = self.stage.marker_url(choice.step) if stored and self.stage is not None else None
        return Resolution(choice.step, ctx.root / name, choice.detail, mode, url=url)

    def align_fast(self, step: int, tier: Tier) -> None:
        """After a restore of ``step``, one rank per node points its fast tracker at the step where
        the node holds it committed (a node rebuilt from replicas, one a stopped save left behind),
        or, when its tracker is past it (a newer step only part of the job had), back at the newest
        step it holds up to ``step``, so the next fast saves are not refused as going backwards.
        Newer steps stay on disk as orphans (``ckptguard gc --orphans`` removes them)."""
        root = self.fast.root
        if self.hosts.index(self.hosts[self.rank]) != self.rank or not root.is_dir():
            return
        tracker = _layout.read_tracker(root)
        if tracker is None or tracker == step:
            return
        held = [
            s
            for s, path in _layout.step_dirs(root, self.fast.naming).items()
            if s <= step and (path / _layout.MANIFEST_NAME).is_file()
        ]
        if tier is Tier.FAST and step in held:
            target = step
        elif tracker > step:
            target = max(held, default=0)
        else:
            return
        _layout.write_tracker(root, target)
        log.warning(
            "ckptguard: fast tier %s: tracker moved from step %d to %d after the restore of "
            "step %d from the %s tier%s",
            root,
            tracker,
            target,
            step,
            tier.value,
            "; the newer steps there are orphans now (kept; `ckptguard gc --orphans` removes them)"
            if tracker > target
            else "",
        )


def after_transfers(agreement: Any, phase: str, problems: list[str]) -> list[str]:
    """Every rank's problems, on every rank. An all-gather, not rank 0's verdict: a rank still
    blocked in a transfer with a dead peer arrives up to one timeout late, and every live rank must
    then name the dead one (waiting 2x the timeout for it), not the late one."""
    views = agreement.exchange(phase, problems[:5], patience=2.0)
    return [f"rank {r}: {'; '.join(v)}" for r, v in enumerate(views) if v]


def _size_is(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except OSError:
        return False
