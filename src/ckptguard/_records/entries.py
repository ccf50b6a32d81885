"""The typed parts of a manifest: file entries, node entries, the topology and the cost block.

Each is a frozen dataclass with ``to_json`` (the object written to disk, unchanged from the
dict form earlier releases wrote: same keys, optional keys only when set) and ``from_json``
(which checks the shape and raises ``ValueError`` with what is wrong; ``_records.manifest``
turns that into one ``CheckpointCorruptError`` naming the file).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .._types import JsonObject

Scalar = int | float | str | bool | None
Figure = Scalar | list[int]
"""A value of the cost block's extra figures (staging, skipped and queued saves; the skipped
steps)."""


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class FileEntry:
    """One file of a step: its path relative to the step directory, size, xxh3, and the rank that
    wrote it (None: a file no one rank owns, e.g. in an export or a manifest of earlier
    releases)."""

    path: str
    size: int
    xxh3: str
    rank: int | None = None

    def to_json(self) -> JsonObject:
        out: dict[str, Any] = {"path": self.path, "size": self.size, "xxh3": self.xxh3}
        if self.rank is not None:
            out["rank"] = self.rank
        return out

    @classmethod
    def from_json(cls, value: object) -> FileEntry:
        if not (
            isinstance(value, dict)
            and isinstance(value.get("path"), str)
            and is_int(value.get("size"))
            and value["size"] >= 0
            and isinstance(value.get("xxh3"), str)
            and (value.get("rank") is None or is_int(value.get("rank")))
        ):
            raise ValueError(
                "'files' must be a list of {path: str, size: int, xxh3: str, rank: int} entries"
            )
        return cls(value["path"], value["size"], value["xxh3"], value.get("rank"))


def files_from_json(value: object) -> tuple[FileEntry, ...]:
    if not isinstance(value, list):
        raise ValueError(
            "'files' must be a list of {path: str, size: int, xxh3: str, rank: int} entries"
        )
    return tuple(FileEntry.from_json(f) for f in value)


def files_to_json(files: Iterable[FileEntry]) -> list[JsonObject]:
    return [f.to_json() for f in files]


@dataclass(frozen=True)
class NodeEntry:
    """One node of a node-local root (format 2): its name, its ranks, and the files copied to it
    (replicated DCP files another node's rank wrote)."""

    name: str
    ranks: tuple[int, ...]
    copies: tuple[str, ...] = ()

    def to_json(self) -> JsonObject:
        return {"name": self.name, "ranks": list(self.ranks), "copies": list(self.copies)}

    @classmethod
    def from_json(cls, value: object) -> NodeEntry:
        if not (
            isinstance(value, dict)
            and isinstance(value.get("name"), str)
            and isinstance(value.get("ranks"), list)
            and all(is_int(r) for r in value["ranks"])
            and isinstance(value.get("copies"), list)
            and all(isinstance(c, str) for c in value["copies"])
        ):
            raise ValueError("a node is {name: str, ranks: [int], copies: [str]}")
        return cls(value["name"], tuple(value["ranks"]), tuple(value["copies"]))


@dataclass(frozen=True)
class Topology:
    """The world a step was saved by: its size, the parallel layout, each rank's host and (expert
    parallel) each rank's EP rank. ``layout`` holds the layout's sizes (``dp``, ``tp``, ``pp``,
    ``ep``) as written."""

    world_size: int
    layout: Mapping[str, int] = field(default_factory=dict)
    rank_hosts: tuple[str, ...] | None = None
    ep_ranks: tuple[int, ...] | None = None

    @property
    def ep(self) -> int:
        return int(self.layout.get("ep", 1))

    def shape(self) -> dict[str, int]:
        """What a restore compares with its own world: the size and the layout (not where the ranks
        ran)."""
        return {"world_size": self.world_size, **self.layout}

    def to_json(self) -> JsonObject:
        out: dict[str, Any] = self.shape()
        if self.rank_hosts is not None:
            out["rank_hosts"] = list(self.rank_hosts)
        if self.ep_ranks is not None:
            out["ep_ranks"] = list(self.ep_ranks)
        return out

    @classmethod
    def from_json(cls, value: object, *, max_world: int) -> Topology:
        if not isinstance(value, dict) or not is_int(value.get("world_size")):
            raise ValueError("'topology' must be an object with an int 'world_size'")
        world = value["world_size"]
        if not 1 <= world <= max_world:
            raise ValueError(f"'topology.world_size' is {world}, outside 1..{max_world}")
        layout = {
            k: v for k, v in value.items() if k not in ("world_size", "rank_hosts", "ep_ranks")
        }
        if not all(is_int(v) for v in layout.values()):
            raise ValueError("the layout sizes of 'topology' must be ints")
        hosts, ep_ranks = value.get("rank_hosts"), value.get("ep_ranks")
        if hosts is not None and not (
            isinstance(hosts, list) and all(isinstance(h, str) for h in hosts)
        ):
            raise ValueError("'topology.rank_hosts' must be a list of host names")
        if ep_ranks is not None and not (
            isinstance(ep_ranks, list) and all(is_int(r) for r in ep_ranks)
        ):
            raise ValueError("'topology.ep_ranks' must be a list of ints")
        return cls(
            world,
            layout,
            None if hosts is None else tuple(hosts),
            None if ep_ranks is None else tuple(ep_ranks),
        )


_COST_FIELDS = ("bytes", "save_seconds", "step_seconds", "save_fraction_of_step")


@dataclass(frozen=True)
class Cost:
    """What a save cost: its bytes and seconds, the step time it was measured against and the save
    as a fraction of it; ``extra``: the figures of the async path and the busy policy (staging,
    skipped and queued saves), by name, as written."""

    bytes: int
    save_seconds: float | None = None
    step_seconds: float | None = None
    save_fraction_of_step: float | None = None
    extra: Mapping[str, Figure] = field(default_factory=dict)

    def figure(self, name: str) -> Figure:
        """One figure by its on-disk name (a field or an extra; None when absent)."""
        return getattr(self, name) if name in _COST_FIELDS else self.extra.get(name)

    def to_json(self) -> JsonObject:
        return {
            "bytes": self.bytes,
            "save_seconds": self.save_seconds,
            "step_seconds": self.step_seconds,
            "save_fraction_of_step": self.save_fraction_of_step,
            **self.extra,
        }

    @classmethod
    def from_json(cls, value: object) -> Cost | None:
        """The cost block, or None for a manifest without one (format 1) or with one this release
        cannot read (the cost is informative: a step is never refused over it)."""
        if not isinstance(value, dict) or not is_int(value.get("bytes")):
            return None
        if not all(value.get(k) is None or is_number(value.get(k)) for k in _COST_FIELDS[1:]):
            return None
        return cls(
            value["bytes"],
            value.get("save_seconds"),
            value.get("step_seconds"),
            value.get("save_fraction_of_step"),
            {k: v for k, v in value.items() if k not in _COST_FIELDS},
        )


def nodes_from_json(value: object, world: int) -> tuple[NodeEntry, ...]:
    shape = (
        "'nodes' must be a list of {name: str, ranks: [int], copies: [str]} covering every "
        "rank once"
    )
    if not isinstance(value, list) or not value:
        raise ValueError(shape)
    try:
        nodes = tuple(NodeEntry.from_json(n) for n in value)
    except ValueError:
        raise ValueError(shape) from None
    if sorted(r for n in nodes for r in n.ranks) != list(range(world)):
        raise ValueError(shape)
    return nodes
