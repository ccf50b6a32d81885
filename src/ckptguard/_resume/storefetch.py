"""The restore side of an object-store root: which step (``resolve``), and that step brought into
the local staging root (``fetch_step``).

``resolve`` follows the resume rule of every root (``resolve_local.tracker_step``): the tracker and
that step's marker decide; a listing is read only where the tracker is missing or 0, to refuse
markers that stand without a tracker or to name orphans: tracker 0 or none on a root with no marker
is a fresh start (refused under ``ResumeMode.MUST``); a tracker whose marker is missing or
unreadable, or markers without a tracker, raise ``ResumeError`` (ckptguard writes the marker before
the tracker and rotation never deletes the tracker's step), never a guess.

Contract: every rank calls ``fetch_step`` with the same step; each host whose staging root does not
already hold exactly that step (its manifest equal to the marker's) clears its stale copy (manifest
first: it never looks committed half-deleted), its ranks download a share of the marker's objects
each (``ObjectStore.fetch``: every size checked before anything is requested), and the host's first
rank writes the contract phases the marker carries, then the manifest, last. A host that holds the
step already takes part in the rounds without downloading. The local restore then checks the step as
it checks any committed directory.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from .._agree import Agreement, Wire, on_every_rank
from .._disk.layout import (
    CONTRACT_DIR,
    MANIFEST_NAME,
    atomic_write_json,
    read_json,
    refuse_link,
)
from .._records import contract as _contract
from .._types import JsonObject
from ..config import ResumeMode
from ..errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    ContractMismatchError,
)
from ..storage.s3 import Marker, ObjectStore
from .resolve_local import tracker_step

__all__ = ["Resolved", "fetch_step", "resolve"]


@dataclass(frozen=True)
class Resolved:
    """What ``resolve`` found: the step (0: fresh start) and its marker."""

    step: int
    marker: Marker | None
    reason: str


def resolve(store: ObjectStore, *, must: bool = False) -> Resolved:
    """The step to restore, decided by the resume rule every root follows
    (``resolve_local.tracker_step``: the tracker and that step's marker, this process's reads);
    ``must``: nothing there raises (``ResumeMode.MUST``) instead of a declared fresh start."""
    view = _StoreView(store)
    step, reason = tracker_step(view, ResumeMode.MUST if must else ResumeMode.AUTO)
    return Resolved(step, view.found if step else None, reason)


class _StoreView:
    """An object-store root as the resume rule reads it."""

    repair = (
        "To resume, restore the objects, or set the tracker to an older committed step by hand "
        "(`ckptguard list` shows them)."
    )

    def __init__(self, store: ObjectStore) -> None:
        self.store, self.where = store, str(store.url)
        self.found: Marker | None = None
        self._tracker = store.tracker()[0]  # read once: the rule asks twice (exists, then tracker)

    def exists(self) -> bool:
        """A root record or a tracker, else any marker (a listing, only when both are gone: markers
        that stand without them are a damaged root, refused, never a fresh start)."""
        return self._tracker is not None or self.store.has_root() or bool(self.store.marked_steps())

    def tracker(self) -> int | None:
        return self._tracker

    def uncommitted(self) -> list[int]:
        """The steps whose markers stand without a tracker (a listing: only ever to refuse or to say
        so)."""
        return self.store.marked_steps()

    def marker(self, step: int) -> int:
        marker = self.store.marker(step)
        if marker is None:
            raise CheckpointNotFoundError(
                f"{self.store.where(self.store.naming.name(step), MANIFEST_NAME)} does not exist"
            )
        self.found = marker
        return marker.step


@dataclass(frozen=True)
class _Have(Wire):
    host: str
    same: (
        bool  # the staging root holds exactly this step already (its manifest equals the marker's)
    )


def fetch_step(
    agreement: Agreement, store: ObjectStore, root: Path, step: int, *, host: str
) -> Path:
    """The committed ``step`` of ``store`` in the staging ``root``: downloaded, each host's ranks a
    share, unless there already (collective); returns its directory."""
    rank = agreement.info.rank
    marker = store.marker(step)
    if marker is None:
        raise CheckpointCorruptError(
            f"{store.url}: the marker of step {step} vanished after resolve"
        )
    step_dir = root / store.naming.name(step)
    refuse_link(
        step_dir, f"the staging copy of step {step}"
    )  # _clear below must never delete through a link
    have = _Have(host, _same(step_dir, marker.manifest))
    views = [_Have.from_json(v) for v in agreement.exchange("store.have", have.to_json())]
    peers = [r for r, v in enumerate(views) if v.host == host]
    if all(v.same for v in views):
        return step_dir
    # The rounds below are every rank's (the same views everywhere); a host that holds the step
    # already takes part without downloading anything.
    here = not all(views[r].same for r in peers)
    leader = here and rank == peers[0]
    on_every_rank(agreement, "store.clear", lambda: _clear(step_dir) if leader else None)
    names = sorted(marker.objects) if here else []
    share = {n for i, n in enumerate(names) if i % len(peers) == peers.index(rank)}
    on_every_rank(agreement, "store.fetch", lambda: store.fetch(marker, step_dir, only=share))
    on_every_rank(
        agreement,
        "store.fetched",
        lambda: _finish(store, root, marker, step_dir) if leader else None,
    )
    return step_dir


def _finish(store: ObjectStore, root: Path, marker: Marker, step_dir: Path) -> None:
    """The chain's contract phases (the staging root continues the store's chain), then the
    manifest."""
    own = {p.name: read_json(p, what="contract phase") for p in _contract.phase_files(root)}
    for name, record in sorted(marker.phases.items()):
        if name in own and own[name] != record:
            raise ContractMismatchError(
                f"{root}/{CONTRACT_DIR}/{name} differs from the phase step {marker.step} on "
                f"{store.url} carries: the staging root belongs to another run; give this run "
                f"its own staging directory"
            )
        if name not in own:
            (root / CONTRACT_DIR).mkdir(parents=True, exist_ok=True)
            atomic_write_json(root / CONTRACT_DIR / name, record)
    store.write_manifest(marker, step_dir)


def _same(step_dir: Path, manifest: JsonObject) -> bool:
    try:
        return bool(read_json(step_dir / MANIFEST_NAME, what="manifest") == manifest)
    except (OSError, CheckpointError):
        return False


def _clear(step_dir: Path) -> None:
    """A stale copy of the step in the staging root goes, marker first (it never looks committed
    half-deleted)."""
    manifest = step_dir / MANIFEST_NAME
    if manifest.exists():
        manifest.unlink()
    if step_dir.exists():
        shutil.rmtree(step_dir)
