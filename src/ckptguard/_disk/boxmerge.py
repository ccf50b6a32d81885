"""Every rank's layout-free partials (``boxsum.layout_free_partials``) combined into one digest per item and
DCP key (``combine_layout_free``), which no sharding changes: the manifest's layout-free table, and what a
restore, an export or a verify compares with it. Torch-free (xxh3 only)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import xxhash

_MASK = (1 << 64) - 1

REPLICAS_DIFFER = "replicas differ"


def combine_layout_free(views: list[Mapping[str, list[str]]]) -> dict[str, dict[str, str]]:
    """Every rank's partials into ``{item: {key: digest}}``, which no sharding changes.

    A chunk reported by several ranks with different bytes gives the key the value
    ``REPLICAS_DIFFER`` (it never equals a recorded digest)."""
    chunks: dict[str, list[str]] = {}
    differ: set[tuple[str, str]] = set()
    for view in views:
        for cid, entry in view.items():
            item, key = entry[0], entry[1]
            prev = chunks.setdefault(cid, list(entry))
            if prev[2:] != list(entry[2:]):
                differ.add((item, key))
    sums: dict[tuple[str, str], list[Any]] = {}
    for item, key, header, part in chunks.values():
        acc = sums.setdefault((item, key), [header, 0])
        acc[1] = (acc[1] + int(part, 16)) & _MASK
    out: dict[str, dict[str, str]] = {}
    for (item, key), (header, total) in sorted(sums.items()):
        value = xxhash.xxh3_64(f"{header}|{total:016x}".encode()).hexdigest()
        out.setdefault(item, {})[key] = REPLICAS_DIFFER if (item, key) in differ else value
    return out
