"""The commit rule of a root, written once over the store that holds it (``RootStore``).

Two stores implement it: a directory (``stepdir.DirRoot``: a step is visible once its written temp
directory, manifest inside, is renamed to the step's name) and an object store
(``storepublish.BucketRoot``: once its marker object is created, if absent). What a step is, where
its bytes go before the commit and how they get there (a temp directory, a staging root and an
upload) is each store's; which step a save may take and the order that makes it committed is here:

``admit`` (before anything is written), with T the tracker (None: a new root) and s the step:
  - s < 1: refused (step 0 is the tracker of a new root: "fresh start");
  - s < T: refused unless ``overwrite`` (a deliberate rollback, on a store whose ``ROLLBACK``
    allows it);
  - s visible and s <= T: committed: refused unless ``overwrite``;
  - s visible and s > T: an orphan, its writer killed between marker and tracker: replaced by
    this save.

``make_visible`` then ``complete`` (the write done and checked):
  1. the write lease is still this job's;
  2. the tracker has not moved past s (or onto a visible s) since ``admit``, unless ``overwrite``;
  3. what is there under s (an orphan, or the step an overwrite replaces) is uncommitted first,
     put back if step 4 fails;
  4. s made visible (the commit point); what step 3 moved aside can no longer come back;
  5. the tracker moved to s: forward only, unless ``overwrite``;
  6. what step 3 moved aside deleted.
Without ``overwrite``, a kill between any two of these leaves either the old step committed or s
visible and newer than the tracker (an orphan the next save of s replaces, ``admit``'s third case);
never a partial step as latest. With ``overwrite`` (directory roots only) a kill can leave less: a
rollback killed before step 5 leaves s rewritten below the tracker; an overwrite of the tracker's
own step killed between steps 3 and 4 leaves the tracker naming a step that is gone from its place
(a restore refuses it, naming the step), its old directory kept whole, manifest included, in the
root's trash until put back by hand.
"""

from __future__ import annotations

from enum import Enum
from typing import Protocol

from .. import _faults

__all__ = ["Refusal", "RootStore", "admit", "complete", "make_visible", "publish"]


class Refusal(Enum):
    RESERVED = "reserved"  # step 0, the tracker of a new root
    BEHIND = "behind"  # older than the tracker
    COMMITTED = "committed"  # already committed
    MOVED = "moved"  # the tracker moved past the step while it was written


class RootStore(Protocol):
    """One root's primitives; the rule above decides when each is called."""

    BEFORE_VISIBLE: str | None  # the fault point right before step 4 (tests kill there), if any
    BEFORE_TRACKER: str  # the fault point between steps 4 and 5
    ROLLBACK: bool  # whether ``overwrite`` may replace a committed step and move the tracker back

    def tracker(self) -> int | None:
        """The tracker's step; None on a root that has none yet."""
        ...

    def visible(self, step: int) -> bool:
        """Whether ``step``'s commit marker is there (its manifest, or its marker object)."""
        ...

    def refuse(self, why: Refusal, step: int, tracker: int | None) -> Exception:
        """The error this store raises for ``why``, in its own words (what, where, what to do)."""
        ...

    def confirm_lease(self, step: int) -> None:
        """Raise ``LeaseHeldError`` unless this job still holds the root's write lease."""
        ...

    def uncommit(self, step: int) -> object | None:
        """Make whatever is under ``step`` invisible (marker first); a handle for
        ``put_back``/``finish``, or None."""
        ...

    def put_back(self, step: int, undo: object) -> None:
        """Make what ``uncommit`` moved aside visible again, as it was."""
        ...

    def make_visible(self, step: int, staged: object) -> None:
        """The commit point: ``staged`` (the store's own handle of the written step) becomes
        ``step``."""
        ...

    def sealed(self, step: int, undo: object | None) -> None:
        """Right after the commit point: what ``uncommit`` moved aside can no longer be put back."""
        ...

    def move_tracker(self, step: int, *, back: bool) -> None:
        """The tracker set to ``step``: only forward, unless ``back`` (a rollback the store
        admitted)."""
        ...

    def finish(self, step: int, undo: object | None) -> None:
        """After the tracker moved: delete what ``uncommit`` moved aside; check the commit
        stands."""
        ...


def admit(store: RootStore, step: int, *, overwrite: bool = False) -> None:
    """Raise the store's refusal if a save of ``step`` may not go ahead (the rule above)."""
    if step < 1:
        raise store.refuse(Refusal.RESERVED, step, store.tracker())
    overwrite = overwrite and store.ROLLBACK
    tracker = store.tracker()
    if tracker is not None and step < tracker and not overwrite:
        raise store.refuse(Refusal.BEHIND, step, tracker)
    if tracker is not None and step <= tracker and not overwrite and store.visible(step):
        raise store.refuse(Refusal.COMMITTED, step, tracker)


def make_visible(
    store: RootStore, step: int, staged: object, *, overwrite: bool = False
) -> object | None:
    """Steps 1 to 4; returns what step 3 moved aside, for ``complete``."""
    overwrite = overwrite and store.ROLLBACK
    store.confirm_lease(step)
    tracker = store.tracker()
    moved = tracker is not None and (tracker > step or (tracker == step and store.visible(step)))
    if moved and not overwrite:
        raise store.refuse(Refusal.MOVED, step, tracker)
    undo = store.uncommit(step)
    try:
        if store.BEFORE_VISIBLE is not None:
            _faults.reached(store.BEFORE_VISIBLE)
        store.make_visible(step, staged)
    except BaseException:
        if undo is not None:  # the step the tracker may name goes back, committed as before
            store.put_back(step, undo)
        raise
    store.sealed(step, undo)
    return undo


def complete(store: RootStore, step: int, undo: object | None, *, overwrite: bool = False) -> None:
    """Steps 5 and 6."""
    store.move_tracker(step, back=overwrite and store.ROLLBACK)
    store.finish(step, undo)


def publish(store: RootStore, step: int, staged: object, *, overwrite: bool = False) -> None:
    """Steps 1 to 6 in one go (a root every writer sees; node-local roots run the two halves in
    rounds)."""
    undo = make_visible(store, step, staged, overwrite=overwrite)
    _faults.reached(store.BEFORE_TRACKER)
    complete(store, step, undo, overwrite=overwrite)
