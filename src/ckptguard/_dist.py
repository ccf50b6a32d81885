"""How ranks agree over torch.distributed: the c10d store's all-gather with timeouts that name
ranks.

Contract of the primitive: ``exchange(phase, payload)`` returns every rank's payload, in rank order,
or raises on every rank that is still alive. A plain gloo/NCCL collective that times out names no
rank and a dead peer can leave it waiting until the process-group timeout, so agreement goes through
the c10d store instead: each rank sets one key per phase and waits for the others' keys with our own
timeout, then says which keys never arrived.

Each ``StoreAgreement`` talks to the store over a connection of its own (``Store.clone()``):
a c10d client serializes its operations, so a background commit blocked in ``wait`` on a
shared client would hold up the training thread's ``set`` (a PreemptionGuard's flag, a
second manager's save) until our timeout fired on every rank.

The messages, the ``Agreement`` protocol, ``LocalAgreement`` and the two combinators
(``on_every_rank``, ``gather_decide``) are in ``_agree``, which needs no torch.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import time
import zlib
from typing import Any

import torch
import torch.distributed as dist

from ._agree import Agreement, LocalAgreement, RankInfo, node_name
from ._log import logger
from .errors import CollectiveTimeoutError, ConfigError

_shared_logged = False


def own_connection(store: dist.Store) -> dist.Store:
    """A client of ``store``'s server of its own, with the same keys (prefixes included).

    A TCPStore client runs one request at a time: while one thread waits for a peer's key
    (up to timeout_s), another thread's ``set`` on the same client waits behind it. Two
    threads of one rank that agree at the same time (a background commit and a
    PreemptionGuard, or two managers' commits) then each wait for a key that the other
    rank's blocked thread cannot post, and every rank times out. The clone is made here,
    while every rank is alive (agreements are created collectively): cloning connects to the
    store's host, and against a dead host it would block for the process group's timeout.
    Where clone() is missing (older torch) or fails, the shared client is kept: the
    behaviour of before, where concurrent agreements on one rank can time out.
    """
    global _shared_logged
    clone = getattr(store, "clone", None)
    if clone is not None:
        try:
            return clone()  # type: ignore[no-any-return]
        except Exception as exc:
            reason = f"{type(store).__name__}.clone() failed ({type(exc).__name__}: {exc})"
    else:
        reason = f"{type(store).__name__} has no clone() in torch {torch.__version__}"
    if not _shared_logged:
        _shared_logged = True
        logger().debug(
            "ckptguard agrees through the process group's shared store client: %s; a save_async "
            "agreeing while another ckptguard collective runs on this rank may time out",
            reason,
        )
    return store


class StoreAgreement:
    """All-gather through the c10d store of the default process group, on a connection of its
    own."""

    def __init__(self, group: Any | None, *, timeout_s: float, namespace: str) -> None:
        store = own_connection(dist.distributed_c10d._get_default_store())
        self.ranks = (
            dist.get_process_group_ranks(group) if group else list(range(dist.get_world_size()))
        )
        rank = dist.get_rank(group) if group else dist.get_rank()
        self.info = RankInfo(rank=rank, world_size=len(self.ranks), host=node_name())
        # Distinct groups and managers must not read each other's keys.
        tag = zlib.crc32(json.dumps([namespace, self.ranks]).encode())
        self._store = dist.PrefixStore(f"ckptguard/{tag:08x}/", store)
        self._timeout = _dt.timedelta(seconds=timeout_s)
        self._seq = 0
        self._previous: str | None = None
        self._deadline: float | None = (
            None  # a gather's phase deadline, shared by the bcast that follows
        )

    def exchange(self, phase: str, payload: Any, *, patience: float = 1.0) -> list[Any]:
        """``patience`` scales the timeout: a phase that follows a collective with the same
        timeout waits longer, so that its peers' own timeout fires first and every rank
        reports the same first error instead of some reporting a timeout."""
        deadline = (
            time.monotonic() + (self._timeout * patience).total_seconds()
        )  # one deadline for the phase
        base, keys = self._keys(phase)
        me = keys[self.info.rank]
        self._post(phase, me, payload)
        self._wait(phase, keys, self._timeout * patience)
        values = self._read(phase, keys)
        # Every rank has read (and acknowledged) the previous phase once all ranks have
        # posted this one, so this rank's keys of that phase can go: the store stays small.
        if self._previous is not None:
            self._delete(
                self._previous, self._previous.rsplit("/", 1)[0] + f"/ack/{self.info.rank}"
            )
        self._previous = me
        self._linger(base, _left(deadline))
        return values

    def gather(self, phase: str, payload: Any, *, patience: float = 1.0) -> list[Any] | None:
        """Every rank posts; only rank 0 waits for and reads them all (others get None).

        Store traffic is then linear in the world size, not quadratic: what only rank 0
        needs (chunk digests, file lists) goes this way, and rank 0 ships its verdict with
        ``bcast``. On rank 0 a missing rank raises CollectiveTimeoutError; rank 0 must pass
        that on to the others in its next broadcast.
        """
        total = (self._timeout * patience).total_seconds()
        self._deadline = time.monotonic() + total  # the bcast of the verdict ends by it too
        _, keys = self._keys(phase)
        self._post(phase, keys[self.info.rank], payload)
        if self.info.rank != 0:
            return None
        # Rank 0 keeps a share of the phase to decide and broadcast, so the others' wait for its
        # verdict ends within the same timeout_s: one deadline, not one per wait (issue 33 item 7).
        self._wait(phase, keys, _dt.timedelta(seconds=total * (1.0 - _DECIDE_SHARE)))
        values = self._read(phase, keys)
        self._delete(*keys)
        return values

    def bcast(self, phase: str, payload: Any = None, *, live: list[int] | None = None) -> Any:
        """Rank 0's payload, on every rank; only rank 0's key is waited for.

        Rank 0 then waits (bounded, failures ignored) for the acknowledgements of the
        ``live`` ranks (default: all), so it does not exit before they have read.
        """
        wait = self._timeout if self._deadline is None else _left(self._deadline)
        self._deadline = None
        base, keys = self._keys(phase)
        if self.info.rank == 0:
            self._post(phase, keys[0], payload)
            others = [
                r for r in (live if live is not None else range(self.info.world_size)) if r != 0
            ]
            acks = [f"{base}ack/{r}" for r in others]
            with contextlib.suppress(Exception):
                self._store.wait(acks, wait)
                self._delete(keys[0], *acks)
            return json.loads(json.dumps(payload))
        self._wait(phase, keys[:1], wait)
        value = self._read(phase, keys[:1])[0]
        with contextlib.suppress(Exception):
            # Store.set takes bytes as well; torch's stub names only str.
            self._store.set(f"{base}ack/{self.info.rank}", b"")  # type: ignore[arg-type]
        return value

    # ------------------------------------------------------------ store primitives

    def _keys(self, phase: str) -> tuple[str, list[str]]:
        """A fresh key per rank for this call; every rank numbers its calls alike."""
        self._seq += 1
        base = f"{self._seq}/{phase}/"
        return base, [f"{base}{r}" for r in range(self.info.world_size)]

    def _post(self, phase: str, key: str, payload: Any) -> None:
        try:
            self._store.set(key, json.dumps(payload))
        except Exception as exc:
            raise self._unreachable(phase, exc) from exc

    def _wait(self, phase: str, keys: list[str], timeout: _dt.timedelta) -> None:
        """Wait for ``keys``; on timeout raise naming the ranks whose keys never came."""
        try:
            self._store.wait(keys, timeout)
        except Exception as exc:
            missing = self._missing(keys)
            if missing is None:
                raise self._unreachable(phase, exc) from exc
            raise CollectiveTimeoutError(
                f"rank {self.info.rank} waited {timeout.total_seconds():.0f} s at "
                f"checkpoint phase {phase!r} and ranks {missing} never arrived (dead, stalled "
                "or not calling the same ckptguard method); every live rank raises this. "
                "Check those ranks' logs for their first error; raise timeout_s if they are "
                "merely slow.",
                phase=phase,
                missing_ranks=missing,
            ) from exc

    def _read(self, phase: str, keys: list[str]) -> list[Any]:
        try:
            return [json.loads(self._store.get(k)) for k in keys]
        except Exception as exc:
            raise self._unreachable(phase, exc) from exc

    def _delete(self, *keys: str) -> None:
        # Housekeeping only: a key left behind costs store memory, never correctness.
        with contextlib.suppress(Exception):
            for key in keys:
                self._store.delete_key(key)

    def _linger(self, base: str, wait: _dt.timedelta) -> None:
        """Wait until every rank has read this phase before returning.

        The store lives in one rank's process (rank 0 under tcp:// init); if that rank
        returned from the last exchange and exited, the others could not read the
        values. A failure here is harmless: this rank already holds every value.
        """
        acks = [f"{base}ack/{r}" for r in range(self.info.world_size)]
        try:
            # bytes work; stub: str
            self._store.set(acks[self.info.rank], b"")  # type: ignore[arg-type]
            self._store.wait(acks, wait)
        except Exception:
            pass

    def _missing(self, keys: list[str]) -> list[int] | None:
        try:
            return [r for r, k in enumerate(keys) if not self._store.check([k])]
        except Exception:
            return None

    def _unreachable(self, phase: str, exc: Exception) -> CollectiveTimeoutError:
        return CollectiveTimeoutError(
            f"rank {self.info.rank} lost the c10d store at checkpoint phase {phase!r} "
            f"({type(exc).__name__}: {exc}); the store's host (usually rank 0) has probably "
            "died. Look at rank 0's log for its first error.",
            phase=phase,
            missing_ranks=[0],
        )


_DECIDE_SHARE = 0.2
"""Of a gather_decide phase's timeout, what rank 0 keeps for its decision and broadcast."""


def _left(deadline: float) -> _dt.timedelta:
    # Never zero: a c10d wait of 0 s would mean "the store's default timeout", not "do not wait".
    return _dt.timedelta(seconds=max(deadline - time.monotonic(), 0.05))


def make_agreement(process_group: Any | None, *, timeout_s: float, namespace: str) -> Agreement:
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise ConfigError(
                "process_group was given but torch.distributed is not initialized; call "
                "init_process_group first, or pass process_group=None for one process"
            )
        return LocalAgreement()
    return StoreAgreement(process_group, timeout_s=timeout_s, namespace=namespace)
