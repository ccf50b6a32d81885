"""Checkpoint roots on S3-compatible object stores (``s3://bucket/prefix``): the store's side of the commit.

``ObjectStore`` is one root and the primitives its commit runs on: a temporary area per attempt,
conditional create of each step's marker, the tracker's compare-and-set on its ETag, the reads, step
deletion marker-first, gc of what ckptguard created, and a write lease. The commit's order over them
is ``ckptguard._commit.storepublish`` (``begin`` / ``commit`` / ``rotate``), the restore's
``ckptguard._resume.storefetch`` (``resolve`` / ``fetch_step``); ``ckptguard.objectstore.
ObjectStoreCheckpoint`` composes them with a ``CheckpointManager``.
Needs the ``s3`` extra (boto3): ``pip install 'ckptguard[s3]'``.
"""

from ._gc import GcReport
from ._objrecords import Marker, StoredObject, Writer
from ._options import Consistency, ObjectStoreOptions, StoreURL
from ._store import ObjectStore

__all__ = [
    "Consistency",
    "GcReport",
    "Marker",
    "ObjectStore",
    "ObjectStoreOptions",
    "StoreURL",
    "StoredObject",
    "Writer",
]
