"""Ranks as Ray actors: how a group of actors forms the process group ckptguard saves over.

Contract: rank 0's actor calls ``open_rendezvous()``, which starts the c10d TCP store on
this node's IP and a port the kernel picks (no fixed port, no bind-then-release race) and
returns its address. The driver passes that address to every actor, and each actor
(rank 0 included) calls ``join_process_group(rank=..., world_size=..., address=...)`` at
the same time. After that, ``CheckpointManager`` inside the actors behaves exactly as under
``torchrun``: saves commit on every rank or raise on every rank, and a rank that dies (an
``ray.kill``, Ray's OOM killer, a SIGKILL) makes every live rank raise within
``CheckpointConfig.timeout_s``, naming the missing ranks.

Rank 0's actor holds the store: if it dies, the others lose the rendezvous and raise
``CollectiveTimeoutError`` naming rank 0. Restart the whole group after any death; a
process group cannot be repaired in place.
"""

from __future__ import annotations

import datetime as _dt
import socket
from typing import Any

import torch.distributed as dist

from ..errors import ConfigError

__all__ = ["join_process_group", "node_ip", "open_rendezvous"]

_master_store: dict[str, Any] = {}


def node_ip() -> str:
    """This node's IP as Ray sees it (the address other nodes reach), or loopback without Ray."""
    try:
        import ray
    except ImportError:
        return "127.0.0.1"
    try:
        # ray: unannotated
        return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
    except Exception:  # not inside a Ray worker or driver
        return socket.gethostbyname(socket.gethostname())


def open_rendezvous(*, timeout_s: float = 600.0, host: str | None = None) -> str:
    """Start the group's TCP store in this process (rank 0); return ``"ip:port"`` for the others."""
    if _master_store:
        raise ConfigError(
            "open_rendezvous: this process already holds a rendezvous store; call it once per "
            "group, on rank 0's actor, and restart the actor to form a new group"
        )
    ip = host or node_ip()
    store = dist.TCPStore(
        ip,
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=_dt.timedelta(seconds=timeout_s),
        use_libuv=True,
    )
    address = f"{ip}:{store.port}"
    _master_store[address] = store
    return address


def _parse(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ConfigError(
            f"join_process_group(address={address!r}): expected 'ip:port' from open_rendezvous()"
        )
    return host, int(port)


def join_process_group(
    *, rank: int, world_size: int, address: str, timeout_s: float = 600.0, backend: str = "gloo"
) -> None:
    """Join the default process group through rank 0's store; blocks until every rank joined."""
    if dist.is_initialized():
        raise ConfigError(
            f"join_process_group(rank={rank}): torch.distributed is already initialized in this "
            f"actor; a Ray actor belongs to one group for its lifetime (restart it to join another)"
        )
    if not 0 <= rank < world_size:
        raise ConfigError(f"join_process_group: rank {rank} is outside world_size {world_size}")
    host, port = _parse(address)
    timeout = _dt.timedelta(seconds=timeout_s)
    store = _master_store.get(address)
    if store is None:
        store = dist.TCPStore(host, port, is_master=False, timeout=timeout, use_libuv=True)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
