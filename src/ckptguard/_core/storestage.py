"""The stage of an ``s3://bucket/prefix`` root: a ``CheckpointManager`` whose commits are published
to a store.

Contract. The manager commits ``step`` to its local staging root with the ordinary protocol (every
rank's files, digests, manifest, tracker), then ``published`` publishes that committed directory to
the store (``_commit.storepublish``): rank 0 takes the store's write lease and opens an attempt,
every rank uploads its own files of the step (multipart, checksummed parts), and once every rank
reported success rank 0 creates the marker (``If-None-Match: *``) and moves the tracker
(``If-Match``, never backwards). Any failure raises on every rank; nothing of the step is visible on
the store unless its marker was created. Before a save (``before_save``) the store's lease is
checked on every rank, and a staging commit the store never made (a job killed inside the upload
window) is replaced by the save of that step: the staging root is scratch space, the store alone
says what is committed.

A restore resolves on the store (the tracker and that step's marker, nothing else: ``resolve``), has
each host's ranks download the step's objects into the staging root (a share each; skipped when the
staging root already holds that exact step: ``bring``), and the manager restores from there, so
every check of a local restore (files, digests, contract, topology) applies unchanged. The proof log
lives in the staging root and is copied to the store's ``proof/`` at every publish and at close, and
seeded back from it before a restore when the staging root lost it (a lost node).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import socket
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._agree import Wire, gather_decide, on_every_rank
from .._commit import storelease
from .._commit import storepublish as _publish
from .._commit.busy import check_policy
from .._context import Actions
from .._disk import layout as _layout
from .._disk.layout import MANIFEST_NAME, atomic_write_bytes
from .._dist import make_agreement
from .._records.proofreader import records_dir
from .._records.retention import KeepLast, holds
from .._records.trust import Prefer
from .._resume.resolve_local import Resolution
from .._resume.storefetch import fetch_step, resolve
from .._types import JsonObject
from ..config import CheckpointConfig, OnBusy, ResumeMode
from ..errors import CheckpointError, ConfigError, LeaseHeldError
from ..storage.s3 import ObjectStore, StoreURL

log = logging.getLogger("ckptguard")

STAGING_RECORD = "ckptguard-staging.json"
"""Which store a staging root stages (``{"store": url, "endpoint": endpoint_url}``), written when it
is claimed."""


def _store_id(root: str, config: CheckpointConfig) -> JsonObject:
    endpoint = config.storage.object_store.endpoint_url if config.storage.object_store else None
    return {"store": str(StoreURL.parse(root)), "endpoint": endpoint}


def claim_staging(local: Path, root: str, config: CheckpointConfig) -> None:
    """Make ``local`` the staging root of the store ``root``, or refuse it: the staging keeps only
    its newest step (``KeepLast(1)``), so a directory holding anything else (an existing checkpoint
    root, another store's staging, a link planted at the default path) would lose it. Its record
    (``STAGING_RECORD``) names the store and endpoint; it is created with O_EXCL-like ``link``
    (ranks of one node may claim at once)."""
    mine = _store_id(root, config)
    if (
        config.storage.object_staging is None
    ):  # the default path: this user's directory, never a planted link
        top = Path(tempfile.gettempdir()) / f"ckptguard-staging-{os.getuid()}"
        top.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(top)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            raise ConfigError(
                f"staging root of {root}: {top} is not a directory of this user (uid "
                f"{os.getuid()}): set StorageOptions(object_staging=...) to a directory of yours"
            )
    if local.is_symlink():
        raise ConfigError(
            f"staging root of {root}: {local} is a symbolic link; ckptguard never writes "
            f"through a link (it could reach another root): set "
            f"StorageOptions(object_staging=...) to a directory"
        )
    local.mkdir(parents=True, exist_ok=True)
    record = local / STAGING_RECORD
    for _ in range(50):
        if record.exists():
            break
        others = [e for e in os.listdir(local) if e != STAGING_RECORD and ".tmp-" not in e]
        if others:
            raise ConfigError(
                f"staging root of {root}: {local} already holds {sorted(others)[:5]} and is not a "
                f"staging root (no {STAGING_RECORD}); a staging root keeps only its newest step, "
                f"so an existing checkpoint root there would lose its steps: set "
                f"StorageOptions(object_staging=...) to an empty or new directory"
            )
        tmp = local / f"{STAGING_RECORD}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.write_text(json.dumps(mine, sort_keys=True) + "\n")
        try:
            os.link(
                tmp, record
            )  # fails if another rank of this node claimed it first: its record is compared
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    found = json.loads(_layout.read_small(record, what="staging record"))
    if found != mine:
        raise ConfigError(
            f"staging root of {root}: {local} stages {found.get('store')} (endpoint "
            f"{found.get('endpoint')}), not {mine['store']} (endpoint {mine['endpoint']}): two "
            f"stores must not share a staging root (its steps and proof records would mix). Set "
            f"StorageOptions(object_staging=...) to a directory of this root's; if it is the same "
            f"store under another endpoint, the staging root is scratch (the store holds every "
            f"committed step): delete it"
        )


@dataclass(frozen=True)
class _Empty(Wire):
    pass


@dataclass(frozen=True)
class _Chosen(Wire):
    step: int
    reason: str


def _read_log(path: Path) -> bytes:
    """A rank's proof log read whole, never through a link or a FIFO, at most 1 GiB (the store's
    bound)."""
    return _layout.read_small(path, limit=1 << 30, what="proof records")


class StoreStage:
    """An object-store root (``url``) written through the local staging root ``local``. ``config``
    is the manager's: its ``retention`` is applied on the store (``local_config``, the staging
    root's, keeps its newest step); ``async_save.on_busy``: ``SKIP`` or ``WAIT``. ``namespace``: the
    manager's agreement name."""

    def __init__(
        self,
        url: str,
        local: Path,
        config: CheckpointConfig,
        *,
        process_group: Any | None,
        namespace: str,
    ) -> None:
        check_policy(
            config.async_save.on_busy, f"CheckpointManager({url!r})", (OnBusy.SKIP, OnBusy.WAIT)
        )
        self.store = ObjectStore(
            StoreURL.parse(url),
            config.storage.object_store,
            dir_template=config.storage.dir_template,
        )
        self.url = str(self.store.url)
        self.local = local
        self._config = config
        # the staging root claimed (``claim``): at the first save or restore, after the lease
        self._claimed = False
        self._unseeded = (
            False  # the store's copy of this rank's proof log could not be read (``seed_proof``)
        )
        self.local_config = dataclasses.replace(config, retention=KeepLast(1))
        """The staging root's config: it keeps its newest step (the store rotates by
        ``config.retention``)."""
        self._agreement = make_agreement(
            process_group, timeout_s=config.timeout_s, namespace=f"{namespace}-store"
        )
        # The publish agrees over its own keys: it runs in save_async's thread while the caller's
        # agree above.
        publishing = make_agreement(
            process_group, timeout_s=config.timeout_s, namespace=f"{namespace}-publish"
        )
        info = self._agreement.info
        self.rank = info.rank
        self._host = (
            info.host
        )  # ranks of one host share its staging root (CKPTGUARD_NODE where tests fake nodes)
        self._holder = (
            f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"  # rank 0's lease id
        )
        self._restored: int | None = None
        self._breaking: dict[
            int, bool
        ] = {}  # step -> its save's break_lease, for the publish after its commit
        self._publisher = _publish.Publisher(
            publishing, self.store, local, self._holder, config.retention
        )
        # this job published or restored a step: the root exists, proof copies may go there
        self._rooted = False
        self.last_url: str | None = None
        """The store's marker URL of the last step this job committed there."""

    # ------------------------------------------------------------ save

    def before_save(self, step: int, actions: Actions) -> Actions:
        """The store's lease checked on every rank first (a job refused by it changes nothing, not
        even its staging root), then whether the staging save of ``step`` replaces a staging commit
        the store never made (``_commit.storepublish.replaces``; collective)."""
        self.check_lease(actions.break_lease)
        self.claim()
        self._breaking[step] = actions.break_lease
        if actions.overwrite or not _publish.replaces(
            self._agreement, self.store, self.local, step
        ):
            return actions
        return Actions(overwrite=True, break_lease=actions.break_lease)

    def published(self, step: int, path: Path) -> None:
        """Publish the staging root's commit of ``step`` at ``path`` to the store (collective); the
        store's rotation keeps the restored step and the steps held in the staging root
        (``CheckpointManager.hold``, readers of ``open_step``); this rank's proof log copied after
        it."""
        protect = ({self._restored} if self._restored else set()) | set(holds(self.local))
        url = self._publisher.publish(
            step, path, protect=protect, break_lease=self._breaking.pop(step, False)
        )
        self._rooted, self.last_url = True, url
        self.copy_proof()

    def hold(self, break_lease: bool = False) -> None:
        """Rank 0's part (not collective): create the root record and tracker 0 if absent, then take
        or renew the store's write lease for this job (``LeaseHeldError`` while another live job
        holds it)."""
        _publish.hold(self.store, self._holder, break_lease)

    def check_lease(self, break_lease: bool = False) -> None:
        """Raise ``LeaseHeldError`` on every rank while another live job holds the store's lease
        (collective)."""

        def check(_: list[_Empty]) -> _Empty:
            storelease.check(self.store, self._holder, override=break_lease)
            return _Empty()

        gather_decide(self._agreement, "store.check_lease", _Empty(), check, decision=_Empty)

    # ------------------------------------------------------------ restore

    def before_restore(self, break_lease: bool = False) -> None:
        """The store's lease checked on every rank (``LeaseHeldError`` while another live job holds
        it), and this rank's proof log seeded from the store's copy (collective)."""
        try:
            self.check_lease(break_lease)
        except LeaseHeldError as exc:
            # A reader (an evaluation beside the training job) must never take the writer's lease.
            raise LeaseHeldError(
                f"{exc}. To only read one of its steps while it runs, copy the step out first: "
                f"`ckptguard transfer {self.store.url} DEST_ROOT [--step N]` (or "
                f"ckptguard.ops.storetransfer.from_store), then restore from a "
                f"CheckpointManager(DEST_ROOT)"
            ) from exc
        self.claim()
        self.seed_proof()

    def claim(self) -> None:
        """The staging root claimed for this store on every rank before anything is written there
        (``rootstage.claim_staging``: an existing root, another store's staging or a link is
        refused, alike on every rank; collective)."""
        if not self._claimed:
            on_every_rank(
                self._agreement,
                "store.claim",
                lambda: claim_staging(self.local, self.url, self._config),
            )
            self._claimed = True

    def resolve(self, mode: ResumeMode, prefer: Prefer) -> Resolution:
        """The step a restore loads from the store and why (agreed by all ranks); loads nothing. Its
        ``url`` is the step's marker, its ``path`` the staging root's directory ``bring`` downloads
        it into."""
        if prefer is not Prefer.LATEST:
            raise ConfigError(
                f"{self.url}: prefer='verified' is not supported on an object-store root (its "
                "resume target is the store's tracker step); use prefer='latest'"
            )
        chosen = gather_decide(
            self._agreement,
            "store.resolve",
            _Empty(),
            lambda _: self._choose(mode),
            decision=_Chosen,
        )
        if chosen.step == 0:
            return Resolution(0, None, chosen.reason, mode)
        return Resolution(
            chosen.step,
            self.local / self.store.naming.name(chosen.step),
            chosen.reason,
            mode,
            url=self.marker_url(chosen.step),
        )

    def _choose(self, mode: ResumeMode) -> _Chosen:
        if mode is ResumeMode.NEVER:
            return _Chosen(0, "ResumeMode.NEVER")
        found = resolve(self.store, must=mode is ResumeMode.MUST)
        return _Chosen(found.step, found.reason)

    def bring(self, step: int) -> Path:
        """The committed ``step`` in the staging root: downloaded, each host's ranks a share, unless
        there already (collective, ``_resume.storefetch``). Rotation on the store keeps it from now
        on."""
        self._restored, self._rooted = step, True
        self.claim()
        return fetch_step(self._agreement, self.store, self.local, step, host=self._host)

    # ------------------------------------------------------------ queries

    def committed_steps(self) -> list[int]:
        """The store's committed steps, ascending (this process's reads; no collective)."""
        return self.store.committed_steps()

    def tracker_step(self) -> int:
        """The store's committed step a restore would load (the tracker, its marker checked; 0:
        none)."""
        return resolve(self.store).step

    def marker_url(self, step: int) -> str:
        return self.store.where(self.store.naming.name(step), MANIFEST_NAME)

    # ------------------------------------------------------------ proof records

    def _proof_path(self) -> Path:
        """This rank's proof log in the staging root (the manager's,
        ``ROOT/proof/rank_NNNNN.jsonl``)."""
        return records_dir(self.local) / f"rank_{self.rank:05d}.jsonl"

    def seed_proof(self) -> None:
        """This rank's proof log comes back from the store's copy when the staging root lost it (a
        lost node), so its next copy continues the killed run's records instead of replacing them
        (no collective). A failed read is remembered: ``copy_proof`` then never overwrites the
        store's copy with a log that lacks it (it reads it again and puts the records kept here
        after it)."""
        path = self._proof_path()
        if path.exists():
            return
        try:
            data = self.store.get_proof(path.name)
            if data is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_bytes(path, data)
                self._rooted = True
                log.info(
                    "ckptguard: %s: the proof records of rank %d restored from %s/proof",
                    path,
                    self.rank,
                    self.store.url,
                )
        except (OSError, CheckpointError) as exc:
            self._unseeded = True
            log.warning(
                "ckptguard: reading the store's copy of %s failed (%s: %s); the records start anew "
                "here and the store's copy is not replaced until it is read",
                path,
                type(exc).__name__,
                exc,
            )

    def _reseed(self, path: Path) -> bool:
        """After a failed seed: the store's copy read again and this rank's new records put after it
        (True), or False (still unreadable: the store's copy stays as it is)."""
        try:
            data = self.store.get_proof(path.name)
        except (OSError, CheckpointError) as exc:
            log.warning(
                "ckptguard: the store's copy of %s still cannot be read (%s); it is not replaced "
                "by this rank's newer records (kept in %s)",
                path.name,
                exc,
                path,
            )
            return False
        if data:
            atomic_write_bytes(path, data + (_read_log(path) if path.is_file() else b""))
        self._unseeded = False
        return True

    def copy_proof(self) -> None:
        """This rank's proof log (in the staging root) copied whole to ``proof/`` on the store,
        where ``ckptguard prove s3://...`` reads every rank's; a failed copy is a warning (the step
        is committed)."""
        path = self._proof_path()
        if (
            not self._rooted
        ):  # a proof copy never creates anything under a prefix this job did not write
            return
        try:
            if self._unseeded and not self._reseed(path):
                return
            if path.is_file():
                self.store.put_proof(path.name, _read_log(path))
        except (OSError, CheckpointError) as exc:
            log.warning(
                "ckptguard: copying the proof records %s to %s/proof failed (%s: %s); the copy is "
                "retried at the next save; `ckptguard prove %s` reads them meanwhile",
                path,
                self.store.url,
                type(exc).__name__,
                exc,
                self.local,
            )

    def close(self) -> None:
        """The records since the last save (a restore's) copied to the store; rank 0 releases the
        store's lease."""
        self.copy_proof()
        if self.rank == 0:
            storelease.release(self.store, self._holder)
