"""How ranks agree, the half that needs no torch: the messages and the two combinators.

Two combinators carry the whole cross-rank protocol (in the spirit of DCP's ``_DistWrapper``):

- ``on_every_rank(agreement, phase, fn)``: every rank runs ``fn``; if it raised anywhere,
  every rank raises the lowest failing rank's error (class, message and fields);
- ``gather_decide(agreement, phase, mine, decide, decision=...)``: every rank posts a small
  frozen dataclass, rank 0 gathers them, decides and broadcasts the decision (or its error,
  raised on every rank). Store traffic is linear in the world size.

They run over an ``Agreement`` (``LocalAgreement`` for one process; ``_dist.StoreAgreement``
over the c10d store, the half that imports torch). Kept apart from ``_dist`` so that the records
and checks that speak in ``Wire`` messages (trust, the lease, the resume decision) load without
torch: the operator commands (``ckptguard list``, ``gc``, ``resolve``) start in well under a second.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Protocol, TypeVar

from ._types import JsonObject
from .errors import CollectiveTimeoutError, error_payload, rebuild

NODE_ENV = "CKPTGUARD_NODE"
"""For tests only: the node identity this process reports instead of its host name.

Ranks on one node share its disk; with node-local roots each node publishes its own ranks'
files. Tests fake two nodes on one machine (a private mount namespace per node) and set
this in each rank before creating a manager; it is read once per manager."""


def node_name() -> str:
    """This process's node: the host name, or ``CKPTGUARD_NODE`` where a test fakes nodes."""
    return os.environ.get(NODE_ENV) or socket.gethostname()


@dataclass(frozen=True)
class RankInfo:
    """Who this process is within the group that saves together."""

    rank: int
    world_size: int
    host: str

    @classmethod
    def single(cls) -> RankInfo:
        return cls(rank=0, world_size=1, host=node_name())


class Agreement(Protocol):
    info: RankInfo

    def exchange(self, phase: str, payload: Any, *, patience: float = 1.0) -> list[Any]: ...

    def gather(self, phase: str, payload: Any, *, patience: float = 1.0) -> list[Any] | None: ...

    def bcast(self, phase: str, payload: Any = None, *, live: list[int] | None = None) -> Any: ...


class LocalAgreement:
    """One process: nothing to agree with."""

    def __init__(self) -> None:
        self.info = RankInfo.single()

    def exchange(self, phase: str, payload: Any, *, patience: float = 1.0) -> list[Any]:
        return [json.loads(json.dumps(payload))]

    def gather(self, phase: str, payload: Any, *, patience: float = 1.0) -> list[Any] | None:
        return self.exchange(phase, payload)

    def bcast(self, phase: str, payload: Any = None, *, live: list[int] | None = None) -> Any:
        return self.exchange(phase, payload)[0]


# ---------------------------------------------------------------- the two combinators


class Wire:
    """A message between ranks: a frozen dataclass of JSON values and of records (frozen dataclasses
    of JSON values: they travel as ``asdict`` gives them), with ``to_json``/``from_json``.
    ``READERS`` names the fields that hold records, with the reader that rebuilds each from its
    JSON."""

    READERS: ClassVar[Mapping[str, Callable[[Any], Any]]] = {}

    def to_json(self) -> JsonObject:
        return asdict(self)  # type: ignore[call-overload, no-any-return]

    @classmethod
    def from_json(cls: type[W], data: JsonObject) -> W:
        read = cls.READERS
        return cls(**{k: read[k](v) if k in read else v for k, v in data.items()})


W = TypeVar("W", bound=Wire)
D = TypeVar("D", bound=Wire)
T = TypeVar("T")


def on_every_rank(
    agreement: Agreement, phase: str, fn: Callable[[], T], *, patience: float = 1.0
) -> T:
    """``fn()`` on every rank; if it raised on any rank, every rank raises the lowest failing rank's
    error.

    A local error is shipped instead of raised at once, so no rank waits at a later agreement
    for a peer that already gave up. The failing rank re-raises its own exception (traceback kept).
    """
    value: Any = None
    mine: BaseException | None = None
    try:
        value = fn()
    except Exception as exc:
        mine = exc
    if agreement.info.world_size == 1:
        if mine is not None:
            raise mine
        return value  # type: ignore[no-any-return]
    shipped = error_payload(mine) if mine is not None else None
    views = agreement.exchange(phase, {"error": shipped}, patience=patience)
    failed = [(rank, v["error"]) for rank, v in enumerate(views) if v.get("error")]
    if failed:
        rank, error = failed[0]
        if rank == agreement.info.rank and mine is not None:
            raise mine
        raise rebuild(error, note=f"(rank {rank}) ")
    return value  # type: ignore[no-any-return]


def gather_decide(
    agreement: Agreement,
    phase: str,
    mine: W,
    decide: Callable[[list[W]], D],
    *,
    decision: type[D],
    patience: float = 1.0,
) -> D:
    """Every rank posts ``mine``; rank 0 gathers every rank's message, runs ``decide`` and
    broadcasts the decision. If rank 0 found a rank missing, or ``decide`` raised, every rank raises
    that error, and rank 0 waits only for the ranks it saw. Only rank 0 runs ``decide``."""
    head: dict[str, Any] = {}
    own: BaseException | None = None
    try:
        views = agreement.gather(phase, mine.to_json(), patience=patience)
    except CollectiveTimeoutError as exc:  # rank 0 only: a rank never posted
        views, own = None, exc
        head = {"error": error_payload(exc), "missing": exc.missing_ranks}
    if views is not None:
        try:
            head = {"value": decide([type(mine).from_json(v) for v in views]).to_json()}
        except Exception as exc:
            own, head = exc, {"error": error_payload(exc)}
    missing = set(head.get("missing", []))
    live = [r for r in range(agreement.info.world_size) if r not in missing]
    head = agreement.bcast(f"{phase}.decision", head, live=live)
    if head.get("error"):
        if own is not None:
            raise own
        raise rebuild(head["error"], note="(reported by rank 0) ")
    return decision.from_json(head["value"])


@dataclass(frozen=True)
class _Nothing(Wire):
    """A rank's part of an agreement where only rank 0 acts."""


@dataclass(frozen=True)
class _Text(Wire):
    text: str


def rank0_does(agreement: Agreement, phase: str, fn: Callable[[], str]) -> str:
    """Rank 0 runs ``fn`` (a root-level write, say); every rank returns its result or raises its
    error."""
    return gather_decide(agreement, phase, _Nothing(), lambda _: _Text(fn()), decision=_Text).text
