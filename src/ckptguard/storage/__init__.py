"""The storage seam and its two backends.

``Storage`` is what a backend implements (``write``, ``read_metadata``, ``read``), with the
``StorageContext`` of the collective it runs in and the ``WrittenFile`` list it returns.
``StreamingStorage`` (the default) streams exact bytes through a bounded buffer pool;
``DCPStorage`` goes through PyTorch DCP's own writer. Both write standard DCP files, and
DCP's pickled ``.metadata`` is only ever read through ``read_dcp_metadata``'s restricted
unpickler.
"""

from .base import DCP_METADATA, Storage, StorageContext, WrittenFile
from .dcp import DCPStorage
from .streaming import IOStats, StreamingConfig, StreamingStorage
from .unpickler import read_dcp_metadata

__all__ = [
    "DCP_METADATA",
    "DCPStorage",
    "IOStats",
    "Storage",
    "StorageContext",
    "StreamingConfig",
    "StreamingStorage",
    "WrittenFile",
    "read_dcp_metadata",
]
