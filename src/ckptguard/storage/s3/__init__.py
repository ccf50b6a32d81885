"""Checkpoint roots on S3-compatible object stores (``s3://bucket/prefix``): the store's side of the
commit.

``ObjectStore`` is one root and the primitives its commit runs on: a temporary area per attempt,
conditional create of each step's marker, the tracker's compare-and-set on its ETag, the reads, step
deletion marker-first, the listings and deletes gc (``ckptguard.ops.gc``, ``ops.storegc``) decides
over, and a write lease. The commit's order over them is ``ckptguard._commit.storepublish``
(``begin`` / ``commit`` / ``rotate``), the restore's ``ckptguard._resume.storefetch`` (``resolve`` /
``fetch_step``); ``ckptguard._core.storestage`` composes them into the stage a
``CheckpointManager("s3://bucket/prefix")`` publishes each commit through. Needs the ``s3`` extra
(boto3): ``pip install 'ckptguard[s3]'``. The options and the URL need nothing beyond the standard
library (``CheckpointConfig`` holds ``ObjectStoreOptions``); the rest is imported at first use (PEP
562), so ``import ckptguard`` works without boto3.
"""

from __future__ import annotations

import importlib as _importlib
import typing as _typing

from ._options import Consistency, ObjectStoreOptions, StoreURL

if _typing.TYPE_CHECKING:
    from ._objrecords import Marker, StoredObject, Writer
    from ._store import ObjectStore

__all__ = [
    "Consistency",
    "Marker",
    "ObjectStore",
    "ObjectStoreOptions",
    "StoreURL",
    "StoredObject",
    "Writer",
]

# The names that need boto3 (the s3 extra), and the module of each.
_WHERE = {
    "Marker": "._objrecords",
    "StoredObject": "._objrecords",
    "Writer": "._objrecords",
    "ObjectStore": "._store",
}


def __getattr__(name: str) -> _typing.Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(_WHERE[name], __name__), name)  # lazy: PEP 562
    globals()[name] = value
    return value
