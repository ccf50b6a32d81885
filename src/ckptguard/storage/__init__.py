"""The storage seam and its two backends.

``Storage`` is what a backend implements (``write``, ``read_metadata``, ``read``), with the
``StorageContext`` of the collective it runs in and the ``WrittenFile`` list it returns.
``StreamingStorage`` (the default) streams exact bytes through a bounded buffer pool;
``DCPStorage`` goes through PyTorch DCP's own writer. Both write standard DCP files, and
DCP's pickled ``.metadata`` is only ever read through ``read_dcp_metadata``'s restricted
unpickler.
"""

from __future__ import annotations

import importlib as _importlib
import typing as _typing

if (
    _typing.TYPE_CHECKING
):  # the names, for type checkers and the import graph; bound on first use below
    from .base import DCP_METADATA, Storage, StorageContext, WrittenFile
    from .dcp import DCPStorage
    from .streaming import IOStats, StreamingConfig, StreamingStorage
    from .unpickler import read_dcp_metadata

# Each name is imported on first use (PEP 562): the checks of a step directory import
# ``storage.base`` and ``storage.dcpindex``, which need no torch, and must not pay for the
# backends'.
_WHERE = {
    "DCP_METADATA": ".base",
    "Storage": ".base",
    "StorageContext": ".base",
    "WrittenFile": ".base",
    "DCPStorage": ".dcp",
    "IOStats": ".streaming",
    "StreamingConfig": ".streaming",
    "StreamingStorage": ".streaming",
    "read_dcp_metadata": ".unpickler",
}


def __getattr__(name: str) -> _typing.Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(_WHERE[name], __name__), name)  # lazy: PEP 562
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


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
