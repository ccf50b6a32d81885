"""Checkpoint roots on S3-compatible object stores (``s3://bucket/prefix``): the store's side of the commit.

``ObjectStore`` is one root: conditional create of each step's marker, the tracker moved by a
conditional write on its ETag and never backwards, resolve from the tracker and markers only,
rotation marker-first, gc of what ckptguard created, and a write lease. It takes committed local
step directories (``ObjectStore.begin`` / ``upload`` / ``commit``) and gives them back
(``resolve`` / ``fetch``); ``ckptguard.objectstore.ObjectStoreCheckpoint`` composes it with a
``CheckpointManager``. Needs the ``s3`` extra (boto3): ``pip install 'ckptguard[s3]'``.
"""

from ._gc import GcReport
from ._objrecords import Marker, StoredObject, Writer
from ._options import Consistency, ObjectStoreOptions, StoreURL
from ._store import ObjectStore, Resolved

__all__ = [
    "Consistency",
    "GcReport",
    "Marker",
    "ObjectStore",
    "ObjectStoreOptions",
    "Resolved",
    "StoreURL",
    "StoredObject",
    "Writer",
]
