"""Ray's memory-monitor settings as the running cluster has them, and the object store's share of a
PSS.

Contract: ``cluster_ray_config()`` returns the ``RayConfig`` (``ckptguard.memory.ray``) in force
and says where each value came from: the cluster's system config held by its GCS (what
``ray.init(_system_config=...)`` or ``ray start --system-config`` set), else this process's
``RAY_memory_usage_threshold``/``RAY_min_memory_free_bytes`` (which Ray's raylet reads the same
way at start), else Ray's defaults. It connects to nothing: without a connected Ray (a driver
after ``ray.init`` or code inside an actor) the source says so and env/defaults are used.
``with_cluster_threshold(plan_inputs)`` returns plan inputs whose Ray threshold is the cluster's.

``object_store_pss(pid)`` sums the PSS of a process's mappings of Ray's plasma store (shared
memory under ``/dev/shm`` or a ``plasma`` file): the part of a worker's PSS that is the object
store's, not the worker's own. Unreadable figures are None with a reason, never 0.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .ray import RayConfig

__all__ = [
    "ClusterRayConfig",
    "ObjectStoreShare",
    "cluster_ray_config",
    "object_store_pss",
    "with_cluster_threshold",
]

_KEYS = {"memory_usage_threshold": "threshold", "min_memory_free_bytes": "min_memory_free_bytes"}


@dataclass(frozen=True, kw_only=True)
class ClusterRayConfig:
    """The monitor settings in force and where each came from ("cluster", "env" or "default")."""

    config: RayConfig
    sources: dict[str, str]
    why: str


def _cluster_system_config() -> tuple[dict[str, Any] | None, str]:
    try:
        import ray  # optional: the integration extra
    except ImportError:
        return None, "ray is not installed"
    if not ray.is_initialized():
        return (
            None,
            "no connected Ray cluster in this process (call ray.init or run inside an actor)",
        )
    try:
        from ray._private.state import state  # optional: ray's private state API, when ray is there

        # ray's private API carries no annotations.
        config = state.get_system_config()  # type: ignore[no-untyped-call]
        return dict(config), "read from the cluster's GCS"
    except Exception as exc:  # a private API: say so instead of guessing
        return None, f"the cluster's system config could not be read ({type(exc).__name__}: {exc})"


def _coerce(key: str, raw: Any) -> Any:
    try:
        if key == "threshold":
            return float(raw)
        value = int(raw)
    except (TypeError, ValueError):
        raise ConfigError(
            f"Ray system config {key}={raw!r} is not a number; fix the cluster's system config"
        ) from None
    return value if value >= 0 else None


def cluster_ray_config(environ: Mapping[str, str] | None = None) -> ClusterRayConfig:
    """Ray's threshold and min-free rule as the cluster has them (cluster > env > default)."""
    env_cfg = RayConfig.from_env(environ)
    system, why = _cluster_system_config()
    kwargs: dict[str, Any] = {}
    sources: dict[str, str] = {}
    env = os.environ if environ is None else environ
    for ray_key, field in _KEYS.items():
        if system is not None and ray_key in system:
            kwargs[field] = _coerce(field, system[ray_key])
            sources[field] = "cluster"
        else:
            kwargs[field] = getattr(env_cfg, field)
            sources[field] = "env" if f"RAY_{ray_key}" in env else "default"
    return ClusterRayConfig(config=RayConfig(**kwargs), sources=sources, why=why)


def with_cluster_threshold(
    inputs: Any, environ: Mapping[str, str] | None = None
) -> tuple[Any, ClusterRayConfig]:
    """``PlanInputs`` with ``ray_threshold`` replaced by the cluster's, when the cluster set one."""
    found = cluster_ray_config(environ)
    if found.sources["threshold"] == "default":
        return inputs, found
    return dataclasses.replace(inputs, ray_threshold=found.config.threshold), found


@dataclass(frozen=True, kw_only=True)
class ObjectStoreShare:
    """One process's PSS and the part of it that maps Ray's object store (bytes, per process)."""

    pid: int
    pss: int | None
    object_store_pss: int | None
    why: str


def _is_plasma(path: str) -> bool:
    return "plasma" in path or path.startswith("/dev/shm/")


def object_store_pss(pid: int, *, proc_root: Path = Path("/proc")) -> ObjectStoreShare:
    """PSS of ``pid`` and of its mappings of the plasma store, from ``/proc/PID/smaps``."""
    try:
        text = (proc_root / str(pid) / "smaps").read_text()
    except OSError as exc:
        why = (
            f"/proc/{pid}/smaps unreadable ({exc.strerror or exc}); run as the same user or with "
            "CAP_SYS_PTRACE"
        )
        return ObjectStoreShare(pid=pid, pss=None, object_store_pss=None, why=why)
    total = plasma = 0
    current = ""
    for line in text.splitlines():
        head = line.split(None, 1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            parts = line.split(None, 5)
            current = parts[5].strip() if len(parts) > 5 else ""
        elif head == "Pss:":
            kib = int(line.split()[1]) * 1024
            total += kib
            if _is_plasma(current):
                plasma += kib
    return ObjectStoreShare(
        pid=pid, pss=total, object_store_pss=plasma, why="summed from /proc/PID/smaps"
    )
