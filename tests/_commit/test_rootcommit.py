"""One commit rule for every root (``_commit.rootcommit``), the same cases run on its two stores: a
directory (``stepdir.DirRoot``) and an object store on a moto server (``storepublish.BucketRoot``,
through ``begin`` and ``commit`` as the store's publish calls them). Which step a save may take, and
what a commit does to the tracker and to a step already there, must not depend on the kind of
root."""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("boto3", reason="the s3 extra (boto3) is not installed")
pytest.importorskip("moto.server", reason="moto[server] (dev extra) is not installed")

import objstore_helper as h
from ckptguard._commit import rootcommit, storelease, storepublish
from ckptguard._commit.stepdir import DirRoot
from ckptguard._disk import layout
from ckptguard.errors import CommitConflictError, ConfigError, LeaseHeldError
from ckptguard.storage.s3 import Marker, ObjectStore, Writer

TEMPLATE = "step_{step:08d}"


@pytest.fixture(scope="module")
def moto():
    with h.moto_endpoint() as endpoint:
        yield endpoint


class DirCase:
    """A directory root: a step is its directory holding a manifest."""

    refused = ConfigError

    def __init__(self, tmp_path: Path) -> None:
        self.root = tmp_path / "root"
        self.root.mkdir()
        layout.write_tracker(self.root, 0)  # what a save's prepare writes on a new root
        self.naming = layout.StepNaming(TEMPLATE)
        self.store = DirRoot(self.root, self.naming)

    def begin(self, step: int) -> Path:
        rootcommit.admit(self.store, step)
        tmp = self.root / layout.temp_dir_name(self.naming.name(step), secrets.token_hex(6))
        tmp.mkdir()
        layout.write_owner(tmp)
        return tmp

    def commit(self, step: int, staged: Any, who: str) -> None:
        (staged / layout.MANIFEST_NAME).write_text(json.dumps({"who": who}))
        rootcommit.publish(self.store, step, staged)

    def orphan(self, step: int, who: str) -> None:
        """A writer killed between its rename and the tracker."""
        final = self.root / self.naming.name(step)
        final.mkdir()
        (final / layout.MANIFEST_NAME).write_text(json.dumps({"who": who}))

    def who(self, step: int) -> str | None:
        path = self.root / self.naming.name(step) / layout.MANIFEST_NAME
        return json.loads(path.read_text())["who"] if path.exists() else None

    def tracker(self) -> int | None:
        return layout.read_tracker(self.root)

    def rule(self) -> DirRoot:
        return self.store

    def lose_lease(self) -> None:
        """Another job's lease now (this one's was taken over as expired, say)."""
        now = time.time()
        other = {
            "host": "another-host",
            "pid": 7,
            "start": "1",
            "acquired_unix": now,
            "renewed_unix": now,
        }
        (self.root / "lease.json").write_text(json.dumps(other))


class BucketCase:
    """An object-store root: a step is its marker object; this job holds the write lease."""

    refused = CommitConflictError

    def __init__(self, endpoint: str) -> None:
        name = f"rule-{secrets.token_hex(4)}"
        import boto3

        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=name)
        self.store = ObjectStore(f"s3://{name}/run", h.options(endpoint), dir_template=TEMPLATE)
        self.store.ensure_root()
        self.holder = f"job-{secrets.token_hex(4)}"
        storelease.acquire(self.store, self.holder)

    def begin(self, step: int) -> str:
        return storepublish.begin(self.store, step)

    def commit(self, step: int, staged: Any, who: str) -> None:
        storepublish.commit(self.store, step, staged, {}, {"who": who}, lease=self.holder)

    def orphan(self, step: int, who: str) -> None:
        attempt = self.store.open_attempt(step)
        assert self.store.create_marker(Marker(step, attempt, Writer.here(), {}, {"who": who}, {}))

    def who(self, step: int) -> str | None:
        marker = self.store.marker(step)
        return None if marker is None else marker.manifest["who"]

    def tracker(self) -> int | None:
        return self.store.tracker()[0]

    def rule(self) -> storepublish.BucketRoot:
        return storepublish.BucketRoot(self.store, self.holder)

    def lose_lease(self) -> None:
        """Another job's lease now: this one's released (the reviewer's case), then taken."""
        storelease.release(self.store, self.holder)
        storelease.acquire(self.store, "job-B")


@pytest.fixture(params=["directory", "bucket"])
def case(request, tmp_path):
    if request.param == "directory":
        return DirCase(tmp_path)
    return BucketCase(request.getfixturevalue("moto"))


def test_step_0_is_the_fresh_start_on_both_and_never_saved(case):
    with pytest.raises(case.refused, match="reserved for 'fresh start'"):
        case.begin(0)
    case.commit(1, case.begin(1), "first")
    assert (case.who(0), case.who(1), case.tracker()) == (None, "first", 1)


def test_a_rollback_is_a_directory_roots_alone(case):
    case.commit(2, case.begin(2), "two")
    if isinstance(case, DirCase):  # save(..., overwrite=True): admitted, and the tracker moves back
        rootcommit.admit(case.rule(), 1, overwrite=True)
    else:  # an object store never rolls back, whatever the caller passes
        with pytest.raises(case.refused, match="never rolls back"):
            rootcommit.admit(case.rule(), 1, overwrite=True)


def test_a_step_behind_the_tracker_or_committed_is_refused_before_anything_is_written(case):
    case.commit(2, case.begin(2), "two")
    with pytest.raises(case.refused, match="tracker"):
        case.begin(1)
    with pytest.raises(case.refused, match="already committed"):
        case.begin(2)
    assert (case.who(1), case.who(2), case.tracker()) == (None, "two", 2)


def test_a_step_the_tracker_moved_past_while_it_was_written_is_not_published(case):
    three, four = case.begin(3), case.begin(4)
    case.commit(4, four, "four")
    # Before, an object store created the marker of 3 below the tracker and kept the tracker
    # ("committed but the tracker stays"); a directory refused it. Now both refuse, and step 3 never
    # becomes visible.
    with pytest.raises(case.refused, match="tracker moved to step 4"):
        case.commit(3, three, "three")
    assert (case.who(3), case.who(4), case.tracker()) == (None, "four", 4)


def test_an_orphan_is_replaced_by_the_next_save_of_its_step_and_never_counted_before(case):
    case.commit(1, case.begin(1), "one")
    case.orphan(2, "killed between marker and tracker")
    assert case.tracker() == 1
    staged = case.begin(2)  # admitted: a marker newer than the tracker is not a committed step
    case.commit(2, staged, "again")
    assert (case.who(2), case.tracker()) == ("again", 2)


def test_a_commit_needs_the_lease_still_its_own(case):
    # Before, an object store's commit only asked whether another *live* holder had the lease: a
    # lease another job held after this one's was released (or judged expired or dead) let both
    # commit.
    staged = case.begin(1)
    case.lose_lease()
    with pytest.raises(LeaseHeldError):
        case.commit(1, staged, "after losing the lease")
    assert (case.who(1), case.tracker()) == (None, 0)
